"""Goodput planning: how many tokens each request of a batch drafts this round, to commit the most tokens per second
for the whole batch. One planner for every path (the in-process engine is a batch of one; the scheduler plans each
target worker's requests together) and every chain drafter (an EAGLE-3 head, prompt lookup, a draft model).

A target worker verifies its requests' rounds in one packed forward (each row feeds its own positions), so a round
of the batch costs T(rows, mean width + 1) on the target plus the drafting on the critical path, and commits
sum_i (1 + E_i(k_i)) tokens, E_i the expected accepted tokens of request i's chain of k_i (acceptance.py). The
planner tries every width w (0: a plain decoding step for the whole batch) and keeps the one with the most
committed tokens per second: SmartSpec's goodput (arXiv 2406.14066) over a measured cost surface, with no table to
write. Plain decoding batches well (4 rows cost far less than 4 single steps), so under load a width that paid at
one stream stops paying, and the planner drafts less or nothing; when the load drops, it drafts again.

T is measured where the target runs (`VerifySurface`: a profile at the worker's start, rows x widths), and refined
online from the batches the worker reports (`VerifyTimings`): no shape is assumed (a CPU's cost rises slowly and
not monotonically with width; a GPU's is flat to a knee). Pure functions and small state, torch-free.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from specserve.workers.speculation.methods import LOOKUP_CHAIN
from specserve.workers.speculation.planner.acceptance import expected_accepted
from specserve.workers.speculation.planner.costs import (
    ChunkBeside,
    DecayedByRows,
    DraftCost,
    VerifySurface,
    VerifyTimings,
    packed_seconds,
)

MAX_AUTO_K = 8  # the longest chain k='auto' drafts: a head's acceptance at position 9+ is too small to pay for it


@dataclass(frozen=True)
class Option:
    """One way a request can draft this round: its drafter, the acceptance it expects at each position (given the
    one before accepted), at most len(rates) tokens, and for prompt lookup the continuation itself."""

    source: str  # "head" | "ngram" | "draft"
    rates: tuple[float, ...]
    tokens: tuple[int, ...] = ()  # prompt lookup's continuation
    match: int = 0  # prompt lookup's matched suffix length


@dataclass(frozen=True)
class RowChoice:
    """One request in the batch: its options this round, and the k it asked for (None: 'auto')."""

    options: tuple[Option, ...]
    fixed_k: int | None = None
    budget: int = 0  # the most it may draft this round (tokens left, k's cap)


@dataclass(frozen=True)
class ChainPlan:
    """What a request drafts this round: k tokens from `source` ("none", k = 0: a plain step)."""

    source: str  # "head" | "ngram" | "draft" | "none"
    k: int
    tokens: tuple[int, ...] = ()  # prompt lookup's continuation (source "ngram"), k of them
    match: int = 0  # prompt lookup's matched suffix length

    @classmethod
    def of(cls, option: Option, k: int) -> ChainPlan:
        return cls(option.source, k, option.tokens[:k], option.match) if k else NO_DRAFT


NO_DRAFT = ChainPlan("none", 0)  # a plain step


@dataclass(frozen=True)
class BatchPlan:
    rows: tuple[ChainPlan, ...]
    width: int  # the widest chain (0: a plain step for every request)
    rate: float  # expected committed tokens per second of the batch's rounds, realized rounds' slowdown included
    seconds: float = 0.0  # the round's planned seconds, T(rows, width + 1) + drafting (before the slowdown)


@dataclass(frozen=True)
class RoundForecast:
    """What a round was planned as: drafting or plain, on a worker with `rows` requests, taking `seconds`."""

    drafting: bool
    rows: int
    seconds: float


@dataclass
class RealizedRounds:
    """How much longer a target worker's rounds take than planned, drafting rounds and plain ones apart, per batch
    size: each round's wall time (from its plan to its commit) over its planned T(rows, widest + 1) + drafting, as a
    decayed mean that starts from 1 (worth `prior_weight` rounds, so that one disturbed round does not decide). The
    plan sees the forward and the drafter's cost; it cannot see that when some requests draft and others do not, or
    their drafts come back at different times, the worker's requests meet fewer forward passes (a round then waits
    for another's pass: 4 served streams on the 2-core CPU met 2.1 rows a pass drafting, 3.1 plain), nor the draft
    hop's queueing, the batcher's waits and other requests' prefills. A mode not seen yet is taken at its plan, and
    each round of the other mode relaxes a mode's mean back towards its plan: a slowdown seen in a few disturbed rounds
    that stopped a worker drafting is tried again rather than believed for ever (the planner cannot re-measure a mode
    it no longer plans: a single-stream request over a 1.4K-token prompt drafted once, met 1.4x its forecast, and
    never drafted again)."""

    decay: float = 0.95
    prior_weight: float = 2.0
    min_factor: float = 0.5
    max_factor: float = 4.0

    def __post_init__(self):
        self._by_mode = {mode: DecayedByRows(self.decay, 1.0, self.prior_weight) for mode in (True, False)}

    def observe(self, forecast: RoundForecast, seconds: float) -> None:
        if forecast.seconds <= 0 or seconds <= 0:
            return
        ratio = min(self.max_factor, max(self.min_factor, seconds / forecast.seconds))
        self._by_mode[forecast.drafting].add(forecast.rows, ratio)
        self._by_mode[not forecast.drafting].relax(forecast.rows)

    def factor(self, drafting: bool, rows: int) -> float:
        """The slowdown of this mode at this batch size: its own when seen, else the nearest seen size's, else 1."""
        return self._by_mode[drafting].at(rows)


def _value(option: Option, k: int) -> float:
    return expected_accepted(option.rates, min(k, len(option.rates)))


def _planned(plan: ChainPlan, options: Sequence[Option]) -> float:
    """Expected accepted tokens of a plan made from `options`."""
    option = next(o for o in options if o.source == plan.source)
    return _value(option, plan.k)


def choose_row(row: RowChoice, width: int, share_s: float, costs: Mapping[str, DraftCost]) -> ChainPlan:
    """The row's best option when the batch's chains are at most `width` long: the most committed tokens per second
    of its share of the round (its share of the verify plus its own drafting); prompt lookup wins ties (free)."""
    limit = min(width, row.budget) if row.fixed_k is None else min(row.fixed_k, row.budget)
    if limit <= 0 or not row.options:
        return NO_DRAFT
    if row.fixed_k is not None:  # a fixed k: the option expected to accept the most (ties: prompt lookup)
        best = max(row.options, key=lambda o: (_value(o, limit), o.source == LOOKUP_CHAIN))
        return ChainPlan.of(best, min(limit, len(best.rates)))

    def rate(o: Option) -> float:
        k = min(limit, len(o.rates))
        return (1.0 + _value(o, k)) / (share_s + costs.get(o.source, DraftCost()).of(k))

    best = max(row.options, key=lambda o: (rate(o), o.source == LOOKUP_CHAIN))
    return ChainPlan.of(best, min(limit, len(best.rates)))


def _drafting_s(plans: Sequence[ChainPlan], costs: Mapping[str, DraftCost], batched: bool) -> float:
    """Seconds of the round's drafting on its critical path: a draft worker drafts its rows in one batch (the
    longest chain's cost), the in-process engine one request after another (the sum)."""
    by_row = [costs.get(p.source, DraftCost()).of(p.k) for p in plans if p.k]
    if not by_row:
        return 0.0
    return max(by_row) if batched else sum(by_row)


def plan_batch(
    rows: Sequence[RowChoice],
    verify: VerifyTimings | VerifySurface,
    costs: Mapping[str, DraftCost],
    max_width: int,
    batched_drafts: bool = True,
    realized: RealizedRounds | None = None,
    beside: ChunkBeside | None = None,
) -> BatchPlan:
    """Each request's draft for this round, maximising the batch's committed tokens per second:

        rate(w) = sum_i (1 + E_i(k_i)) / ((T(rows, mean k_i + 1) + drafting) * slowdown(drafting or not, rows)),

    k_i <= w (fixed-k rows: their k), over w = 0..max_width (w = 0: no 'auto' row drafts); slowdown: the worker's
    realized rounds over their plans (`RealizedRounds`; 1 without). The pass is packed, so each row pays for its own
    positions (`packed_seconds`); the rows under a width draft up to it, each with its best option. A prompt's chunk
    `beside` them in the pass adds its positions to the committed tokens and its seconds to the round's."""
    n = len(rows)
    chunk, chunk_s = (beside.positions, beside.seconds) if beside is not None else (0, 0.0)
    best: BatchPlan | None = None
    for width in range(0, max_width + 1):
        plans, widest = [], 0
        share = verify.at(n, width + 1) / n  # a row's share of a round at this width, beside its drafter's cost
        for row in rows:
            plan = choose_row(row, width, share, costs)
            plans.append(plan)
            widest = max(widest, plan.k)
        if widest < width and width > 0:
            break  # no row can draft this many: wider widths plan the same
        columns = sum(p.k + 1 for p in plans)
        seconds = packed_seconds(verify, n, columns) + _drafting_s(plans, costs, batched_drafts) + chunk_s
        slowdown = realized.factor(widest > 0, n) if realized is not None else 1.0
        committed = sum(1.0 + (_planned(p, row.options) if p.k else 0.0) for p, row in zip(plans, rows, strict=True))
        rate = (committed + chunk) / (seconds * slowdown)
        if best is None or rate > best.rate * (1.0 + 1e-9):
            best = BatchPlan(tuple(plans), widest, rate, seconds)
    return best
