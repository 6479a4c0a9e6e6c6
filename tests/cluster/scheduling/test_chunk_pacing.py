"""Prefill chunks sized by time while other requests decode on the worker (chunk_pacing.py): alone a prompt takes the
setting's chunk; beside decoding requests a chunk moves, by proportional steps, to the size that costs CHUNK_SHARE of
their round as measured while no chunk ran beside it; within [MIN_CHUNK_TOKENS, the setting]."""

import pytest

from specserve.cluster.scheduling.chunk_pacing import CHUNK_SHARE, MAX_STEP, MIN_CHUNK_TOKENS, ChunkPacer
from specserve.cluster.scheduling.scheduler import Scheduler
from specserve.workers.config.request import SamplingParams, SpecParams
from specserve.workers.service.results import VerifyResult

SPEC = SpecParams(method="ngram", k=3)


def _chunk(pacer: ChunkPacer, worker: str, others: bool, seconds_per_token) -> int:
    n = pacer.size(worker, others)
    pacer.started(worker, others)
    pacer.chunk_ran(worker, n, seconds_per_token(n))
    return n


def test_alone_or_unmeasured_a_chunk_is_the_setting():
    pacer = ChunkPacer(256)
    assert pacer.size("t1", others_decoding=False) == 256
    assert pacer.size("t1", others_decoding=True) == 256  # no round measured: nothing to weigh a chunk against
    pacer.round_ran("t1", 0.1, pacer.epoch("t1"))
    assert pacer.size("t1", others_decoding=False) == 256
    assert pacer.size("t1", others_decoding=True) == 64  # a quarter, until a chunk beside them is measured


def test_beside_decoding_requests_the_size_converges_to_what_costs_its_share_of_their_round():
    """A CPU-like cost: a fixed part and a part per position; the size settles where a chunk costs CHUNK_SHARE x
    their round (0.1 s), not where the per-position cost of small chunks says."""
    pacer = ChunkPacer(512)
    pacer.round_ran("t1", 0.1, pacer.epoch("t1"))
    cost = lambda n: 0.05 + 0.002 * n  # noqa: E731
    sizes = [_chunk(pacer, "t1", True, cost) for _ in range(12)]
    assert sizes[0] == 128 and all(b <= a * MAX_STEP for a, b in zip(sizes, sizes[1:], strict=False))
    assert abs(cost(sizes[-1]) - CHUNK_SHARE * 0.1) < 0.01  # 75 tokens: 0.2 s
    deep = ChunkPacer(512)  # a fixed part over the budget (deep in a long prompt): the prompt's share, not tiny
    deep.round_ran("t1", 0.1, deep.epoch("t1"))
    sizes = [_chunk(deep, "t1", True, lambda n: 0.3 + 0.002 * n) for _ in range(12)]
    assert abs(sizes[-1] - 150) <= 2  # its positions half the pass: 0.3 s = 150 x 2 ms beside 0.3 s fixed
    flat = ChunkPacer(512)  # a GPU-like cost, flat to a knee: the chunk grows to the setting
    flat.round_ran("t1", 0.1, flat.epoch("t1"))
    assert [_chunk(flat, "t1", True, lambda n: 0.02) for _ in range(4)][-1] == 512
    assert pacer.size("t2", others_decoding=True) == 512  # another worker measured nothing


def test_a_round_with_a_chunk_beside_it_is_not_the_round_a_chunk_is_sized_by():
    """Else a chunk would be sized by the rounds it lengthened, and grow without end."""
    pacer = ChunkPacer(256)
    start = pacer.epoch("t1")
    pacer.round_ran("t1", 0.1, start)
    during = pacer.epoch("t1")
    pacer.started("t1", True)
    pacer.round_ran("t1", 5.0, during)  # planned before the chunk started: ignored
    pacer.round_ran("t1", 5.0, pacer.epoch("t1"))  # planned while it runs: ignored
    while_it_ran = pacer.epoch("t1")
    pacer.chunk_ran("t1", 64, 0.4)
    pacer.round_ran("t1", 5.0, while_it_ran)  # planned while it ran, answered after it: ignored too
    assert pacer.status()["t1"]["round_ms"] == 100.0
    assert pacer.size("t1", True) == round(64 * CHUNK_SHARE * 0.1 / 0.4)
    pacer.round_ran("t1", 0.3, pacer.epoch("t1"))  # after it: counts
    assert pacer.status()["t1"]["round_ms"] > 100.0
    pacer.forget("t1")
    assert pacer.size("t1", True) == 256 and MIN_CHUNK_TOKENS <= 32


def _reply(seconds: float) -> VerifyResult:
    return VerifyResult(accepted=0, next_token=5, batch_rows=1, batch_tokens=1, batch_seconds=seconds)


def test_the_scheduler_paces_a_long_prompt_beside_a_decoding_request_and_chunks_its_rest():
    s = Scheduler([], ["t1"], prefill_chunk=64)
    chat = s.add(list(range(3, 13)), SamplingParams(max_new_tokens=50), SPEC, frozenset())
    for _ in range(3):  # chat decodes: its first round is its prompt's, then steady rounds of 0.1 s
        s.plan_round(chat)
        s.plan_verify(chat, [], b"")
        s.apply_round(chat, chat.round, VerifyResult(0, 7), [], round_s=0.1)
    long = s.add(list(range(3, 503)), SamplingParams(max_new_tokens=4), SPEC, frozenset())
    first = s.plan_prefill_chunk(long)
    assert len(first.new_tokens) == 16  # a quarter of the setting beside chat
    s.prefilled(long, first, _reply(0.05))  # 16 positions in 0.05 s: the budget is 0.2 s
    assert len(s.plan_prefill_chunk(long).new_tokens) == 32  # one step of at most MAX_STEP
    s.release(chat)
    third = s.plan_prefill_chunk(long)
    assert len(third.new_tokens) == 64  # alone: the setting
    long.told["t1"] = list(range(3, 503))[:450]  # 50 left: beside nobody, within a chunk: the first round's
    assert s.plan_prefill_chunk(long) is None


def test_tree_rounds_pace_a_long_prompts_chunks_as_chain_rounds_do():
    """The served default drafts trees: its decoding rounds are what chunks beside them are paced by (before, only a
    chain's round was counted, so beside a tree method every chunk took the whole setting: 4 chat streams' gaps
    1.5-3 s while a 4K prompt prefilled in chunks of 256)."""
    s = Scheduler([], ["t1"], prefill_chunk=64)
    chat = s.add(list(range(3, 13)), SamplingParams(max_new_tokens=50), SpecParams(method="ngram-tree", k=3),
                 frozenset())  # fmt: skip
    for _ in range(3):  # its first round is its prompt's, then plain tree rounds (no lookup match) of 0.1 s
        plan = s.plan_round(chat)
        s.plan_verify(chat, [], b"")
        s.apply_round(chat, plan, VerifyResult(0, 7), round_s=0.1)
    assert s.chunks.status()["t1"]["round_ms"] == 100.0
    long = s.add(list(range(3, 503)), SamplingParams(max_new_tokens=4), SPEC, frozenset())
    assert len(s.plan_prefill_chunk(long).new_tokens) == 16  # a quarter of the setting beside chat, as for chains


def _alternate(pacer: ChunkPacer, costs: dict, rounds: int = 8) -> dict[str, list[int]]:
    """Prompts chunking in turn on one worker (one chunk in flight at a time), each at its own cost."""
    sizes: dict[str, list[int]] = {prompt: [] for prompt in costs}
    for _ in range(rounds):
        for prompt, cost in costs.items():
            n = pacer.size("t1", True, prompt)
            pacer.started("t1", True)
            pacer.chunk_ran("t1", n, cost(n), prompt)
            sizes[prompt].append(n)
    return sizes


def test_two_prompts_chunking_at_different_depths_are_each_sized_by_their_own_cost():
    """Two prompts' chunks in turn on one worker at different depths (before prompts prefilled first come, first
    served, as a second long prompt arrived while the first still prefilled). Fitted as one, the two costs make no
    line: here the deep prompt's chunks went 25, 34, 19, 76, 40 tokens (25 its own), and in a served run to 256
    beside the streams."""
    deep = lambda n: 0.15 + 0.006 * n  # noqa: E731 - 3K positions into its prompt: more attention a position
    shallow = lambda n: 0.04 + 0.001 * n  # noqa: E731
    pacer = ChunkPacer(256)
    pacer.round_ran("t1", 0.1, pacer.epoch("t1"))
    first = _alternate(pacer, {"a": deep})["a"]
    assert first[-1] == 25  # its fixed part is most of the budget: its positions half the pass (0.15 s = 25 x 6 ms)
    sizes = _alternate(pacer, {"a": deep, "b": shallow})
    assert sizes["b"][0] == 25  # a new prompt starts at the worker's latest size
    assert max(sizes["a"]) == 25, sizes
    assert abs(shallow(sizes["b"][-1]) - CHUNK_SHARE * 0.1) < 0.01, sizes  # 260 tokens (the setting's 256)


def test_while_a_prompt_prefills_a_decoding_round_is_told_of_the_chunk_in_its_pass():
    """From a prompt's first chunk to its last (`ended`), `beside` is its next chunk: that chunk's positions, at the
    prompt's fitted seconds per position (before two sizes were measured, the latest chunk's per position)."""
    from specserve.workers.speculation.planner.costs import ChunkBeside

    pacer = ChunkPacer(256)
    pacer.round_ran("t1", 0.1, pacer.epoch("t1"))
    assert pacer.beside("t1") is None  # nothing prefills there
    n = pacer.size("t1", True, "a")
    pacer.started("t1", True, "a")
    assert pacer.beside("t1") is None  # no chunk of it measured yet: nothing to weigh it by
    pacer.chunk_ran("t1", n, 0.05 + 0.004 * n, "a")
    first = pacer.beside("t1")
    assert first == ChunkBeside(pacer.size("t1", True, "a"), pytest.approx(first.positions * (0.05 + 0.004 * n) / n))
    for _ in range(4):
        n = pacer.size("t1", True, "a")
        pacer.started("t1", True, "a")
        pacer.chunk_ran("t1", n, 0.05 + 0.004 * n, "a")
    fitted = pacer.beside("t1")
    assert fitted.positions == pacer.size("t1", True, "a")
    assert fitted.seconds == pytest.approx(0.004 * fitted.positions)  # the fit's part per position, not the fixed
    assert pacer.beside("t2") is None  # another worker
    pacer.ended("a")
    assert pacer.beside("t1") is None
