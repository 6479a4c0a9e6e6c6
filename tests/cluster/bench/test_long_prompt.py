"""The long-prompt bench's split of the streams' gaps by what the long prompts were doing when each gap ended."""

from specserve.cluster.bench.long_prompt import _by_phase, _per_round
from specserve.cluster.bench.traffic import Timed


def test_gaps_split_by_the_long_prompts_phase():
    # one long prompt sent at 10 s: its first token at 15 s, its last at 18 s
    longs = [Timed(10.0, arrivals=[5.0, 6.0, 8.0])]
    gaps = [(9.0, 0.1), (11.0, 0.3), (14.9, 0.4), (15.0, 0.7), (17.5, 0.9), (18.5, 0.2)]
    split = _by_phase(gaps, longs)
    assert {name: p["gaps"] for name, p in split.items()} == {"prefilling": 2, "decoding": 2, "neither": 2}
    assert split["decoding"]["max"] == 0.9 and split["prefilling"]["max"] == 0.4
    assert abs(split["neither"]["p50"] - 0.15) < 1e-9


def test_a_phase_without_gaps_is_counted_empty():
    split = _by_phase([(1.0, 0.2)], [Timed(5.0, arrivals=[1.0])])
    assert split["neither"]["gaps"] == 1 and split["prefilling"] == {"gaps": 0} == split["decoding"]


def test_tokens_a_round_tell_plain_steps_from_drafting():
    plain = [Timed(0.0, rounds=32, accepted=0), Timed(1.0, rounds=16, accepted=0)]
    drafting = [Timed(0.0, rounds=10, accepted=22), Timed(1.0, rounds=6, accepted=10)]
    assert _per_round(plain) == 1.0 and _per_round(drafting) == 3.0 and _per_round([]) == 0.0
