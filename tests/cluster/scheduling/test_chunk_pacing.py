"""Prefill chunks sized by time while other requests decode on the worker (chunk_pacing.py): alone a prompt takes the
setting's chunk; beside decoding requests a chunk moves, growing slowly and shrinking fast, to the size that costs
CHUNK_SHARE of their round as measured while no chunk ran beside it; within [MIN_CHUNK_TOKENS, the setting]."""

import pytest

from specserve.cluster.scheduling.chunk_pacing import (
    CHUNK_SHARE,
    MAX_GROW,
    MAX_SHRINK,
    MIN_CHUNK_TOKENS,
    MIN_PROMPT_SHARE,
    ChunkPacer,
)
from specserve.cluster.scheduling.pass_cost import attended
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
    """A CPU-like cost: a fixed part and a part per position; the size settles where the chunk's own positions cost
    CHUNK_SHARE x their round (0.1 s), whatever the fixed part."""
    pacer = ChunkPacer(512)
    pacer.round_ran("t1", 0.1, pacer.epoch("t1"))
    cost = lambda n: 0.05 + 0.002 * n  # noqa: E731
    sizes = [_chunk(pacer, "t1", True, cost) for _ in range(12)]
    assert sizes[0] == 128 and all(b <= a * MAX_GROW for a, b in zip(sizes, sizes[1:], strict=False))
    assert abs(0.002 * sizes[-1] - CHUNK_SHARE * 0.1) < 0.005  # 150 tokens: 0.3 s of their own
    heavy = ChunkPacer(512)  # a fixed part over their round (many rows beside it): the prompt keeps 3/4 of a pass
    heavy.round_ran("t1", 0.1, heavy.epoch("t1"))
    sizes = [_chunk(heavy, "t1", True, lambda n: 0.2 + 0.002 * n) for _ in range(16)]
    assert abs(sizes[-1] - 300) <= 5  # 0.6 s of its own against the pass's 0.2: MIN_PROMPT_SHARE, not 150's 0.3
    flat = ChunkPacer(512)  # a GPU-like cost, flat to a knee: the chunk grows to the setting
    flat.round_ran("t1", 0.1, flat.epoch("t1"))
    assert [_chunk(flat, "t1", True, lambda n: 0.02) for _ in range(8)][-1] == 512
    assert pacer.size("t2", others_decoding=True) == 512  # another worker measured nothing


def test_a_round_with_a_chunk_beside_it_is_not_the_round_a_chunk_is_sized_by():
    """Else a chunk would be sized by the rounds it lengthened, and grow without end."""
    pacer = ChunkPacer(256)
    start = pacer.epoch("t1")
    pacer.round_ran("t1", 0.1, start)
    during = pacer.epoch("t1")
    pacer.started("t1", True, "a")
    pacer.round_ran("t1", 5.0, during)  # planned before the chunk started: ignored
    pacer.round_ran("t1", 5.0, pacer.epoch("t1"))  # planned while it runs: ignored
    while_it_ran = pacer.epoch("t1")
    pacer.chunk_ran("t1", 64, 0.8, "a")
    pacer.round_ran("t1", 5.0, while_it_ran)  # planned while it ran, answered after it: ignored too
    pacer.round_ran("t1", 5.0, pacer.epoch("t1"))  # between its chunks, or beside its first round: ignored
    assert pacer.status()["t1"]["round_ms"] == 100.0
    assert pacer.size("t1", True, "a") == round(64 * (CHUNK_SHARE + 1) * 0.1 / 0.8)  # not fitted yet: in proportion
    pacer.ended("a")  # its first round is in
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
    assert len(s.plan_prefill_chunk(long).new_tokens) == round(16 * MAX_GROW)  # one step of at most MAX_GROW
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


def test_two_prompts_at_different_depths_are_each_sized_by_their_positions_cost_there():
    """One fit per worker, of what a pass costs by its positions and by the keys its chunk attends over: a prompt
    3K positions in takes smaller chunks than one at its start, each at its own depth's cost (fitted per prompt on
    its chunk's positions alone, a prompt's growing depth read as a growing fixed part; fitted as one, two prompts'
    costs made no line: chunks of 256 beside the streams)."""
    from specserve.cluster.scheduling.pass_cost import attended

    cost = lambda n, depth: 0.04 + 0.002 * (n + 8) + 0.0012 * attended(n, depth)  # noqa: E731 - 8: the streams'
    pacer = ChunkPacer(256)
    pacer.round_ran("t1", 0.1, pacer.epoch("t1"))
    depths = {"deep": 3000, "shallow": 0}
    sizes: dict[str, list[int]] = {prompt: [] for prompt in depths}
    for _ in range(10):  # in turn, each from its own depth
        for prompt, depth in depths.items():
            n = pacer.size("t1", True, prompt)
            pacer.started("t1", True, prompt)
            pacer.chunk_ran("t1", n, cost(n, depth), prompt, batch_positions=n + 8, depth=depth)
            depths[prompt] = depth + n
            sizes[prompt].append(n)
    for prompt, depth in depths.items():
        n = sizes[prompt][-1]
        own = 0.002 * n + 0.0012 * attended(n, depth - n)
        assert abs(own - CHUNK_SHARE * 0.1) < 0.02, (prompt, sizes)
    assert sizes["deep"][-1] < 0.6 * sizes["shallow"][-1], sizes


def test_while_a_prompt_prefills_a_decoding_round_is_told_of_the_chunk_in_its_pass():
    """From a prompt's first chunk to its last (`ended`), `beside` is its next chunk: that chunk's positions, at the
    prompt's fitted seconds per position (before two sizes were measured, the latest chunk's per position)."""
    from specserve.workers.speculation.planner.costs import ChunkBeside

    pacer = ChunkPacer(256)
    pacer.round_ran("t1", 0.2, pacer.epoch("t1"))
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
    assert pacer.status()["t1"]["pass_fit_ms"] == pytest.approx([50.0, 4.0, 0.0], abs=1e-6)  # what the status shows
    assert fitted.seconds == pytest.approx(0.004 * fitted.positions)  # the fit's part per position, not the fixed
    assert pacer.beside("t2") is None  # another worker
    pacer.ended("a")
    assert pacer.beside("t1") is None


def test_a_pass_that_also_carried_another_prompts_rest_does_not_shrink_the_next_chunks():
    """A chunk's pass may carry others' positions (another prompt's last 67, a new request's prompt): the fit is of
    the pass's positions, all of them, so the chunks after it stay at their budget (fitted on the chunk's alone, a
    second prompt's chunks went to a quarter of their size for 20 chunks)."""
    cost = lambda n: 0.05 + 0.004 * n  # noqa: E731 - every position of the pass
    pacer = ChunkPacer(256)
    pacer.round_ran("t1", 0.1, pacer.epoch("t1"))
    sizes = []
    for i in range(12):
        n = pacer.size("t1", True, "b")
        pacer.started("t1", True, "b")
        others = 67 if i == 0 else 0  # its first pass also carried the other prompt's rest
        pacer.chunk_ran("t1", n, cost(n + others), "b", batch_positions=n + others)
        sizes.append(n)
    budget = CHUNK_SHARE * 0.1 / 0.004  # 75 positions of its own
    assert all(abs(n - budget) <= 2 for n in sizes[4:]), sizes  # back within MAX_GROW steps


def test_chunks_converged_on_one_size_move_smoothly_when_their_cost_is_noisy():
    """Deeper in the prompt each position costs more: the fit of the worker's passes has a term for the keys a chunk
    attends over, so ten milliseconds of noise no longer halve a chunk or grow it by half (fitted on the chunk's
    positions alone, the served run's chunks of 50 went to 100 and back)."""
    pacer = ChunkPacer(256)
    pacer.round_ran("t1", 0.1, pacer.epoch("t1"))
    sizes, depth = [], 0
    for i in range(60):
        n = pacer.size("t1", True, "a")
        pacer.started("t1", True, "a")
        seconds = 0.1 + n * (0.003 + 1e-6 * depth) + (0.01 if i % 3 else -0.02)
        pacer.chunk_ran("t1", n, seconds, "a", batch_positions=n + 8, depth=depth)
        sizes.append(n)
        depth += n
    steps = [b / a for a, b in zip(sizes[4:], sizes[5:], strict=False)]  # after the fit's first few passes
    assert sum(not 0.8 <= step <= 1.25 for step in steps) <= 2, sizes  # fitted on the chunk's positions: 10
    assert sizes[-1] < 0.8 * max(sizes[4:20])  # and they shrink as the positions grow dearer


def test_a_few_slow_rounds_between_prompts_do_not_pace_the_next_one():
    """The rounds around a prompt's first round (its rest, its head's catch-up over its positions) are slow though no
    chunk runs: the pace is the median of the latest rounds, which a few do not move (a decayed mean went from 91 to
    227 ms, and the next prompt's passes to 0.9 s)."""
    pacer = ChunkPacer(256)
    for _ in range(20):
        pacer.round_ran("t1", 0.1, pacer.epoch("t1"))
    for _ in range(6):
        pacer.round_ran("t1", 0.8, pacer.epoch("t1"))
    assert pacer.status()["t1"]["round_ms"] == 100.0
    for _ in range(20):  # the rounds stay slow: the pace follows
        pacer.round_ran("t1", 0.8, pacer.epoch("t1"))
    assert pacer.status()["t1"]["round_ms"] == 800.0


def test_a_chunk_grows_slowly_and_shrinks_fast():
    """A chunk too big is a long gap for every stream beside it, one too small a slightly later first token: after a
    cheap pass it grows at most MAX_GROW, after a dear one it shrinks up to MAX_SHRINK."""
    pacer = ChunkPacer(512)
    pacer.round_ran("t1", 0.1, pacer.epoch("t1"))
    grown = [_chunk(pacer, "t1", True, lambda n: 0.0005 * n) for _ in range(4)]  # cheap: wants the setting at once
    assert grown == [128, 160, 200, 250]
    shrunk = [_chunk(pacer, "t1", True, lambda n: 0.05 * n) for _ in range(2)]  # 100x dearer
    assert shrunk[0] / MAX_SHRINK <= shrunk[1] < shrunk[0] / MAX_GROW


def test_a_prompt_alone_does_not_teach_the_fit_its_fixed_part():
    """Alone, a prompt feeds whole chunks of one size: their passes cannot tell a fixed part from a part per
    position, and a fit from them (0.6 s "fixed") sized the chunks beside streams far too big. Only passes beside
    decoding requests are fitted."""
    pacer = ChunkPacer(256)
    for depth in range(0, 4096, 256):  # a 4K prompt alone
        pacer.started("t1", False, "alone")
        pacer.chunk_ran("t1", 256, 0.2 + 0.001 * depth, "alone", depth=depth)
    pacer.ended("alone")
    assert pacer.status()["t1"]["pass_fit_ms"] is None
    pacer.round_ran("t1", 0.1, pacer.epoch("t1"))
    for _ in range(3):
        _chunk(pacer, "t1", True, lambda n: 0.05 + 0.004 * n)
    assert pacer.status()["t1"]["pass_fit_ms"] is not None


def test_the_rows_cost_without_the_chunk_anchors_the_fits_fixed_part():
    """Passes of one shape (a few dozen positions, the depth creeping) barely tell a fixed part from a part per key:
    with each pass's rows measured alone (`base_s`), the fit's fixed part is theirs, and the chunks' own positions
    settle at CHUNK_SHARE of the round while noise moves the passes."""
    pacer = ChunkPacer(256)
    pacer.round_ran("t1", 0.1, pacer.epoch("t1"))
    rows_s, per_position, per_key = 0.07, 0.0015, 0.0015  # at depth 3K a position costs 6 ms, as on the CPU
    own, depth = [], 1500
    for i in range(60):
        n = pacer.size("t1", True, "a")
        pacer.started("t1", True, "a")
        chunk_s = per_position * n + per_key * attended(n, depth)
        noise = (0.04, -0.03, 0.01, -0.02)[i % 4]
        pacer.chunk_ran("t1", n, rows_s + chunk_s + noise, "a", batch_positions=n + 4, depth=depth, base_s=rows_s)
        own.append(chunk_s)
        depth += n // 4  # creeping: the passes' shapes barely differ
    fixed_ms = pacer.status()["t1"]["pass_fit_ms"][0]
    assert 0.5 * 1e3 * rows_s < fixed_ms < 1.5 * 1e3 * rows_s, fixed_ms  # unanchored such fits drifted to 4x
    assert all(abs(s - CHUNK_SHARE * 0.1) < 0.06 for s in own[20:]), [round(s, 3) for s in own]


def test_the_scheduler_anchors_a_chunks_pass_with_its_rows_profiled_alone():
    """The rows beside a chunk are priced by the worker's start-up profile (`PlannerCosts.profiled`), not by the
    online correction that passes with chunks in them move."""
    from specserve.workers.speculation.planner.costs import PlannerCosts
    from tests.helpers.cost_surfaces import cpu_surface

    s = Scheduler(["d1"], ["t1"], prefill_chunk=128)
    s.planner_costs = PlannerCosts(cpu_surface())
    seen = []
    pacer_ran = s.chunks.chunk_ran
    s.chunks.chunk_ran = lambda *a, **kw: seen.append(kw.get("base_s")) or pacer_ran(*a, **kw)
    chat = s.add(list(range(3, 23)), SamplingParams(max_new_tokens=200), SPEC, frozenset())
    for _ in range(3):
        s.apply_round(chat, s.plan_round(chat), VerifyResult(0, 7), [], round_s=0.1)
    long = s.add(list(range(3, 1003)), SamplingParams(max_new_tokens=4), SPEC, frozenset())
    call = s.plan_prefill_chunk(long)
    n = len(call.new_tokens)
    s.prefilled(long, call, VerifyResult(0, 5, batch_rows=2, batch_tokens=n + 1, batch_seconds=0.5))
    assert seen == [pytest.approx(cpu_surface().at(1, 1))]


def _alone_s(n: int, depth: int) -> float:
    """A CPU-like pass of a chunk alone: 50 ms of weights, 2.4 ms a position, 1.1 ms a thousand keys."""
    return 0.05 + 0.0024 * n + 0.0011 * attended(n, depth)


def test_beside_fast_rounds_a_prompt_keeps_its_share_of_each_pass_at_what_its_positions_cost_alone():
    """Rounds of 20 ms would pace chunks to 60 ms of their own, against passes whose rest (the weights, the rows and
    what serving beside them adds: 100 ms) would then be most of each pass, and the prompt would take ~2.5x its time
    alone. Counted at their cost in the worker's passes alone (a prompt prefilled with nothing beside it), a chunk's
    positions are MIN_PROMPT_SHARE of its passes, and the passes are of one length, shallow or deep."""
    pacer = ChunkPacer(256)
    for depth in range(0, 4096, 256):  # a prompt alone: whole chunks
        pacer.started("t1", False, "alone")
        pacer.chunk_ran("t1", 256, _alone_s(256, depth), "alone", batch_positions=256, depth=depth)
    pacer.ended("alone")
    pacer.round_ran("t1", 0.02, pacer.epoch("t1"))
    shares, passes, depth = [], [], 0
    while depth < 4096:
        n = pacer.size("t1", True, "a")
        pacer.started("t1", True, "a")
        # beside: the rows and serving 100 ms, and deep a position costs a little more than alone
        pass_s = _alone_s(n, depth) + 0.1 + 0.0002 * attended(n, depth)
        pacer.chunk_ran("t1", n, pass_s, "a", batch_positions=n + 4, depth=depth)
        alone_own = n * _alone_s(256, max(depth + n / 2 - 128, 0)) / 256  # their share of a whole chunk alone
        shares.append(alone_own / pass_s)
        passes.append(pass_s)
        depth += n
    steady = list(zip(shares, passes, strict=True))[14:]  # once grown (MAX_GROW a chunk) from the first chunks' sizes
    assert abs(sum(s * p for s, p in steady) / sum(p for _, p in steady) - MIN_PROMPT_SHARE) < 0.04  # about
    assert all(abs(s - MIN_PROMPT_SHARE) < 0.08 for s in shares[14:]), [round(s, 2) for s in shares]
    assert max(passes[14:]) < 1.2 * min(passes[14:]), passes  # about one length, shallow or 4K deep
    assert n > 3 * CHUNK_SHARE * 0.02 / (0.0024 + 0.0011 * 4)  # 3x what the rounds alone would pace at 4K deep


def test_without_passes_alone_the_floor_counts_a_chunks_own_time_by_its_passes_beside():
    """A worker that never prefilled a prompt alone: the chunk's own positions as the fit of its passes beside prices
    them, at least MIN_PROMPT_SHARE of the pass."""
    pacer = ChunkPacer(512)
    pacer.round_ran("t1", 0.02, pacer.epoch("t1"))
    sizes = [_chunk(pacer, "t1", True, lambda n: 0.1 + 0.002 * n) for _ in range(20)]
    own = 0.002 * sizes[-1]
    assert abs(own / (own + 0.1) - MIN_PROMPT_SHARE) < 0.02, sizes
    assert pacer.status()["t1"]["pass_rest_ms"] == pytest.approx(100, abs=5)


def test_only_passes_with_nothing_decoding_beside_measure_a_chunks_cost_alone():
    """Passes beside requests whose round is not measured yet are not paced, yet not alone either: their rows would
    make the positions' cost alone look dearer, and the floor's rest smaller."""
    pacer = ChunkPacer(256)
    for depth in range(0, 1024, 256):
        pacer.started("t1", True, "a")  # others decode, no round of theirs measured: the setting's chunk
        pacer.chunk_ran("t1", 256, _alone_s(256, depth) + 0.1, "a", batch_positions=260, depth=depth)
    assert pacer.status()["t1"]["alone_fit_ms"] is None and pacer.status()["t1"]["pass_fit_ms"] is None
    for depth in range(0, 1024, 256):
        pacer.started("t1", False, "b")
        pacer.chunk_ran("t1", 256, _alone_s(256, depth), "b", batch_positions=256, depth=depth)
    fixed, _, per_key = pacer.status()["t1"]["alone_fit_ms"]
    assert fixed == pytest.approx(1e3 * (0.05 + 0.0024 * 256), rel=0.02) and per_key == pytest.approx(1.1, rel=0.02)
