"""The goodput planner (workers/speculation/planner/goodput.py) on synthetic cost surfaces and acceptance profiles: it
picks the k with the most committed tokens per second for one request and for a batch, 0 where nothing pays, each row's
best drafter, and the measured surface's interpolation and online correction."""

import itertools

import pytest

from specserve.workers.speculation.planner.acceptance import expected_accepted
from specserve.workers.speculation.planner.costs import (
    DraftCost,
    VerifyCosts,
    VerifySurface,
    VerifyTimings,
    packed_seconds,
)
from specserve.workers.speculation.planner.goodput import (
    NO_DRAFT,
    Option,
    RealizedRounds,
    RoundForecast,
    RowChoice,
    plan_batch,
)
from tests.helpers.cost_surfaces import cpu_seconds, cpu_surface, gpu_seconds, gpu_surface

HEAD = DraftCost(step_s=0.0037, fixed_s=0.0009)  # ~0.064 of a CPU target step a drafted token
COSTS = {"head": HEAD, "draft": DraftCost(step_s=0.006)}


def head_row(rates, budget: int = 8, fixed: int | None = None) -> RowChoice:
    return RowChoice((Option("head", tuple(rates[:budget])),), fixed, budget)


def brute_force(rows: list[RowChoice], packed, costs, batched: bool, only: list[int] | None = None) -> float:
    """The best batch rate over every assignment of k per row (small batches only; `only`: that one), the verify
    `packed(rows, columns)`."""
    best = 0.0
    for ks in [only] if only else itertools.product(*[range(0, r.budget + 1) for r in rows]):
        drafting = [costs[r.options[0].source].of(k) for r, k in zip(rows, ks, strict=True) if k]
        d = (max(drafting) if batched else sum(drafting)) if drafting else 0.0
        committed = sum(1 + expected_accepted(r.options[0].rates, k) for r, k in zip(rows, ks, strict=True))
        best = max(best, committed / (packed(len(rows), sum(k + 1 for k in ks)) + d))
    return best


@pytest.mark.parametrize("shape", ["cpu", "gpu"])
@pytest.mark.parametrize("a", [0.05, 0.3, 0.6, 0.9])
def test_one_request_gets_the_goodput_optimal_k(shape, a):
    surface, seconds = (cpu_surface(), cpu_seconds) if shape == "cpu" else (gpu_surface(), gpu_seconds)
    row = head_row([a] * 8)
    plan = plan_batch([row], surface, COSTS, 8, batched_drafts=False)
    rate = lambda k: (1 + expected_accepted(row.options[0].rates, k)) / (seconds(1, k + 1) + HEAD.of(k))  # noqa: E731
    best = max(range(9), key=rate)
    assert plan.rows[0].k == best and plan.rate == pytest.approx(rate(best))
    if a == 0.05:
        assert plan.rows[0] == NO_DRAFT  # nothing pays: a plain step


@pytest.mark.parametrize("shape", ["cpu", "gpu"])
@pytest.mark.parametrize("rates", [(0.7, 0.6, 0.5, 0.4), (0.35, 0.15, 0.1, 0.1), (0.9, 0.9, 0.9, 0.9)])
def test_a_batch_plan_is_as_good_as_any_assignment_of_k(shape, rates):
    """A packed pass (each row pays for its own positions): the planner's widths, each row drafting up to the width,
    come within 3% of the best assignment of k per row, and its rate is its plan's."""
    surface = cpu_surface() if shape == "cpu" else gpu_surface()
    packed = lambda rows, columns: packed_seconds(surface, rows, columns)  # noqa: E731
    rows = [head_row(rates, budget=4), head_row(rates[:2] + (0.2, 0.2), budget=4), head_row(rates, budget=2)]
    plan = plan_batch(rows, surface, COSTS, 4, batched_drafts=True)
    ks = [p.k for p in plan.rows]
    assert plan.rate == pytest.approx(brute_force(rows, packed, COSTS, batched=True, only=ks), rel=1e-9)
    assert plan.rate >= 0.97 * brute_force(rows, packed, COSTS, batched=True)


def test_speculation_that_pays_alone_stops_paying_as_a_cpu_target_batches():
    """A CPU-like target: a weak head (0.2 at position 1) pays at one stream; with 16 streams plain steps batch so
    well that no chain pays. On a GPU-like surface (flat until its knee, the head 5% of a step a token) the same
    head pays at 16 streams too."""
    rates = (0.2, 0.3, 0.3, 0.3, 0.3, 0.3, 0.3, 0.3)
    alone = plan_batch([head_row(rates)], cpu_surface(), COSTS, 8, batched_drafts=True)
    crowd = plan_batch([head_row(rates)] * 16, cpu_surface(), COSTS, 8, batched_drafts=True)
    gpu_head = {"head": DraftCost(step_s=0.001)}
    gpu = plan_batch([head_row(rates)] * 16, gpu_surface(), gpu_head, 8, batched_drafts=True)
    assert alone.width > 0 and crowd.width == 0 and gpu.width > 0
    assert all(p == NO_DRAFT for p in crowd.rows)


def test_each_row_takes_its_best_drafter_and_rows_with_nothing_to_draft_stay_plain():
    lookup = Option("ngram", (0.9, 0.9, 0.9), tokens=(5, 6, 7), match=3)
    head = Option("head", (0.3,) * 4)
    rows = [RowChoice((lookup, head), None, 4), RowChoice((), None, 4), RowChoice((head,), None, 0)]
    plan = plan_batch(rows, cpu_surface(), COSTS, 8, batched_drafts=True)
    assert plan.rows[0].source == "ngram" and plan.rows[0].tokens == (5, 6, 7)[: plan.rows[0].k]
    assert plan.rows[1] == NO_DRAFT and plan.rows[2] == NO_DRAFT


def test_a_fixed_k_drafts_its_k_and_no_longer_makes_auto_rows_ride_along():
    """A packed pass: the fixed row's 3 drafts widen no one else's row, so an 'auto' row that accepts almost nothing
    drafts only what its own positions pay for (padded to the widest, it drafted 3 'for free'); drafted one request
    after another, nothing."""
    rows = [head_row([0.01] * 8, budget=8, fixed=3), head_row([0.01] * 8)]
    batched = plan_batch(rows, cpu_surface(), COSTS, 8, batched_drafts=True)
    serial = plan_batch(rows, cpu_surface(), COSTS, 8, batched_drafts=False)
    packed = lambda n, columns: packed_seconds(cpu_surface(), n, columns)  # noqa: E731
    best = max(brute_force(rows, packed, COSTS, batched=True, only=[3, k]) for k in range(9))
    assert batched.rows[0].k == 3 and batched.rows[1].k < 3 and batched.rate == pytest.approx(best)
    assert [p.k for p in serial.rows] == [3, 0]


def test_the_surface_interpolates_rows_and_extrapolates_widths():
    s = VerifySurface((1, 4), ((1.0, 2.0, 3.0), (4.0, 5.0, 6.0)))
    assert s.at(1, 2) == 2.0 and s.at(2, 1) == pytest.approx(2.0) and s.at(8, 1) == pytest.approx(8.0)
    assert s.at(1, 5) == pytest.approx(5.0)  # linear past the widest measured
    assert VerifySurface.single(VerifyCosts((0.1, 0.2))).at(3, 2) == pytest.approx(0.6)
    with pytest.raises(ValueError):
        VerifySurface((4, 1), ((1.0,), (1.0,)))


def test_online_timings_correct_the_profile_per_batch_size():
    """A draft worker on the same cores makes every batch of 4 cost 1.5x its profile: the planner sees it; batch
    sizes never observed take the nearest observed correction."""
    timings = VerifyTimings(cpu_surface())
    assert timings.at(4, 3) == pytest.approx(cpu_seconds(4, 3))
    for _ in range(50):
        timings.observe(4, 12, 1.5 * cpu_seconds(4, 3))
    assert timings.at(4, 3) == pytest.approx(1.5 * cpu_seconds(4, 3), rel=1e-3)
    assert timings.factor(5) == pytest.approx(1.5, rel=1e-3) and timings.surface().at(4, 1) > cpu_seconds(4, 1)
    timings.observe(0, 0, 1.0)  # nothing to learn from an empty batch
    assert timings.factor(1) == pytest.approx(1.5, rel=1e-3)


def test_realized_rounds_start_at_the_plan_and_learn_each_mode_per_batch_size():
    realized = RealizedRounds()
    assert realized.factor(True, 4) == 1.0 and realized.factor(False, 4) == 1.0  # nothing seen: the plan stands
    for _ in range(40):
        realized.observe(RoundForecast(True, 4, 0.1), 0.2)  # drafting rounds took twice their plan
        realized.observe(RoundForecast(False, 4, 0.1), 0.11)
    assert realized.factor(True, 4) == pytest.approx(2.0, rel=0.1)  # the prior's weight keeps it a little nearer 1
    assert realized.factor(False, 4) == pytest.approx(1.1, rel=0.1)
    assert realized.factor(True, 6) == realized.factor(True, 4)  # the nearest seen batch size
    one = RealizedRounds()
    one.observe(RoundForecast(True, 8, 0.1), 10.0)  # one disturbed round (another request's prefill): bounded
    assert 1.0 < one.factor(True, 8) <= 2.0
    for _ in range(8 * 5):  # five batch rounds of the other mode, 8 rows each: barely moved
        one.observe(RoundForecast(False, 8, 0.1), 0.1)
    assert one.factor(True, 8) > 1.25
    for _ in range(8 * 55):  # sixty in all: the drafting mode, no longer planned, has drifted back to its plan
        one.observe(RoundForecast(False, 8, 0.1), 0.1)
    assert 1.0 < one.factor(True, 8) < 1.1 and one.factor(False, 8) == pytest.approx(1.0)


def test_drafting_that_pays_on_paper_stops_when_its_rounds_take_longer_than_planned():
    """Four requests of a head with good acceptance: on paper drafting wins; when drafting rounds are measured at
    twice their plan (the worker's requests split across forward passes) and plain ones at theirs, plain steps win;
    when both are slower alike, drafting still does."""
    rows = [head_row((0.6, 0.5, 0.4, 0.3))] * 4
    paper = plan_batch(rows, cpu_surface(), COSTS, 8)
    split = RealizedRounds()
    alike = RealizedRounds()
    for _ in range(40):
        split.observe(RoundForecast(True, 4, 0.1), 0.2)
        split.observe(RoundForecast(False, 4, 0.1), 0.1)
        alike.observe(RoundForecast(True, 4, 0.1), 0.2)
        alike.observe(RoundForecast(False, 4, 0.1), 0.2)
    assert paper.width > 0 and paper.seconds > 0
    assert plan_batch(rows, cpu_surface(), COSTS, 8, realized=split).width == 0
    alike_plan = plan_batch(rows, cpu_surface(), COSTS, 8, realized=alike)
    assert alike_plan.width == paper.width
    assert alike_plan.rate == pytest.approx(paper.rate / alike.factor(True, 4)) and alike.factor(True, 4) > 1.8


def test_beside_a_prompts_chunk_the_batch_drafts_no_wider_and_its_forecast_counts_the_chunk():
    """A chunk's positions count as tokens of the pass and its seconds as the round's (ChunkBeside): the width is
    the one with the most tokens a second of both, narrower beside a chunk of cheap positions, and the round's
    forecast includes the chunk."""
    from specserve.workers.speculation.planner.costs import ChunkBeside

    rows = [head_row((0.8, 0.7, 0.6, 0.5, 0.4, 0.35, 0.3, 0.25))] * 4
    alone = plan_batch(rows, cpu_surface(), COSTS, 8, batched_drafts=True)
    chunk = ChunkBeside(96, 96 * 0.006)  # deep in a long prompt: 6 ms a position
    beside = plan_batch(rows, cpu_surface(), COSTS, 8, batched_drafts=True, beside=chunk)
    assert 0 < beside.width < alone.width
    shallow = plan_batch(rows, cpu_surface(), COSTS, 8, batched_drafts=True, beside=ChunkBeside(96, 96 * 0.002))
    assert shallow.width == 0  # its positions commit more a second than any drafted one
    packed = lambda n, columns: packed_seconds(cpu_surface(), n, columns)  # noqa: E731
    with_chunk = lambda k: ((4 * (1 + expected_accepted(rows[0].options[0].rates, k)) + 96)  # noqa: E731
                            / (packed(4, 4 * (k + 1)) + HEAD.of(k) + chunk.seconds))  # fmt: skip
    assert beside.rate == pytest.approx(max(with_chunk(k) for k in range(9)))
    assert beside.seconds == pytest.approx(packed(4, 4 * (beside.width + 1)) + HEAD.of(beside.width) + chunk.seconds)
