"""The multi-turn workload's figures (cluster/bench/multi_turn.py) from its turns: TTFT by turn, the second turn's
speedup, conversation throughput, tokens per round and identity, per mode and between modes."""

import pytest

from specserve.cluster.bench.multi_turn import OFF, ON, MultiTurnConfig, Turn, format_multi_turn, summary

CFG = MultiTurnConfig(conversations=2, turns=3, pairs=1)


def _run(ttfts, latency, tpr, ids=(1, 2)):
    return [Turn(c, t + 1, 1000 + 50 * t, ttfts[t], latency, 10, tpr, list(ids)) for c in range(2) for t in range(3)]


def test_the_summary_compares_turns_and_modes():
    arms = {ON: [_run([4.0, 0.5, 0.4], 2.0, 2.0)], OFF: [_run([4.0, 4.0, 4.4], 5.0, 2.2)]}
    s = summary(arms, CFG)
    on, off = s["modes"][ON], s["modes"][OFF]
    assert on["second_turn_ttft_speedup"] == pytest.approx(8.0) and off["second_turn_ttft_speedup"] == 1.0
    assert on["tokens_per_s"] == pytest.approx(60 / 12) and off["tokens_per_s"] == pytest.approx(60 / 30)
    assert s["throughput_vs_off"] == pytest.approx(2.5)
    assert s["later_turns_tokens_per_round_vs_off"] == pytest.approx(2.0 / 2.2)
    assert on["by_turn"][3]["prompt_tokens"] == 1100 and s["identical"]
    assert "8.0x faster" in format_multi_turn(s | {"modes": s["modes"]})


def test_one_turn_that_differs_between_modes_is_not_identical():
    arms = {ON: [_run([1, 1, 1], 1, 1)], OFF: [_run([1, 1, 1], 1, 1, ids=(1, 3))]}
    assert not summary(arms, CFG)["identical"]
