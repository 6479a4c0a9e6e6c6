"""What the planner weighs, as measured where the models run: the target's verify cost per width (one row,
`VerifyCosts`) or over batch sizes too (`VerifySurface`, a worker's start-up profile, corrected online by the
batches it runs: `VerifyTimings`), and a drafter's cost of k drafts (`DraftCost`). No shape is assumed: a CPU's
verify cost rises slowly and not monotonically with width; a GPU's is flat to a knee. Pure values, torch-free.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field

from specserve.workers.speculation.methods import HEAD_CHAIN, MODEL_CHAIN

PROFILE_ROWS = (1, 2, 4, 8)  # batch sizes a target worker profiles at start (others are interpolated)


@dataclass(frozen=True)
class VerifyCosts:
    """verify_s[w - 1]: seconds of one target forward over w new positions (w = drafted + 1), measured."""

    verify_s: tuple[float, ...]

    @property
    def max_k(self) -> int:
        return len(self.verify_s) - 1

    def verify(self, k: int) -> float:
        return self.verify_s[min(k, self.max_k)]

    def mean_verify(self, k: float) -> float:
        """A packed batch whose rows draft k on average (fractional): between the widths around it."""
        low = math.floor(k)
        return self.verify(low) + (self.verify(low + 1) - self.verify(low)) * (k - low)


@dataclass(frozen=True)
class ChunkBeside:
    """Another request's prompt chunk that shares a decoding round's forward pass (chunked prefill): its positions,
    and what they add to the pass's seconds (the chunk's fitted cost per position times them, cluster/scheduling/
    chunk_pacing.py). The planners count its positions as tokens the pass commits, one for one with decoded ones (a
    token budget's exchange rate, as vLLM's `max_num_batched_tokens` charges a step's prefill and decode tokens
    alike): a drafted position then pays only where it is expected to commit more than the prompt's position it
    displaces, and beside a deep prompt's chunk the rounds verify narrower."""

    positions: int
    seconds: float


@dataclass(frozen=True)
class DraftCost:
    """A drafter's seconds for k drafts: fixed_s + k step_s (n-gram lookup: zero)."""

    step_s: float = 0.0
    fixed_s: float = 0.0

    def of(self, k: int) -> float:
        return self.fixed_s + k * self.step_s if k else 0.0


@dataclass(frozen=True)
class VerifySurface:
    """seconds[r][w - 1]: one target forward over rows[r] rows of w new positions each, measured. Other row counts
    are interpolated linearly (extrapolated past the largest from its last two), other widths likewise."""

    rows: tuple[int, ...]
    seconds: tuple[tuple[float, ...], ...]

    def __post_init__(self):
        if not self.rows or len(self.rows) != len(self.seconds) or list(self.rows) != sorted(set(self.rows)):
            raise ValueError("a verify surface needs distinct increasing row counts, one cost row each")
        if any(not row or min(row) <= 0 for row in self.seconds):
            raise ValueError("every measured cost must be positive")

    @classmethod
    def single(cls, costs: VerifyCosts) -> VerifySurface:
        """A surface from one row's costs per width (a batch of one)."""
        return cls((1,), (tuple(costs.verify_s),))

    @property
    def max_width(self) -> int:
        return min(len(row) for row in self.seconds)

    def _at_width(self, r: int, width: int) -> float:
        row = self.seconds[r]
        if width <= len(row):
            return row[max(1, width) - 1]
        slope = (row[-1] - row[-2]) if len(row) > 1 else row[-1]
        return row[-1] + max(0.0, slope) * (width - len(row))

    def at(self, rows: int, width: int) -> float:
        """Seconds of a forward over `rows` rows padded to `width` new positions."""
        rows = max(1, rows)
        i = bisect.bisect_left(self.rows, rows)
        if i < len(self.rows) and self.rows[i] == rows:
            return self._at_width(i, width)
        if len(self.rows) == 1:  # one measured batch size: scale by rows (an upper bound: batching only helps)
            return self._at_width(0, width) * rows / self.rows[0]
        hi = min(max(i, 1), len(self.rows) - 1)  # the measured pair around `rows` (the last two past the largest)
        lo = hi - 1
        r0, r1 = self.rows[lo], self.rows[hi]
        t0, t1 = self._at_width(lo, width), self._at_width(hi, width)
        return max(1e-9, t0 + (t1 - t0) * (rows - r0) / (r1 - r0))

    def for_rows(self, rows: int, widest: int) -> VerifyCosts:
        """A batch of `rows` rows' cost per width 1..widest, as one row's VerifyCosts (its rate is the batch's)."""
        return VerifyCosts(tuple(self.at(rows, w) for w in range(1, widest + 1)))


def packed_seconds(verify: VerifySurface | VerifyTimings, rows: int, columns: int) -> float:
    """A packed pass (runtime/ragged.py) of `rows` rows feeding `columns` positions in all: the measured cost of
    `rows` rows of the mean width, between the widths around it. A row pays for its own positions, not the widest's
    (the surface is measured on rows of one width, where the two agree)."""
    rows = max(1, rows)
    mean = max(1.0, columns / rows)
    low = math.floor(mean)
    t = verify.at(rows, low)
    return t + (verify.at(rows, low + 1) - t) * (mean - low) if mean > low else t


@dataclass
class DecayedByRows:
    """A decayed mean of a ratio per batch size, read at the nearest size seen (ties: the smaller), with `prior`
    worth `prior_weight` observations under it; `prior` alone before any."""

    decay: float
    prior: float = 1.0
    prior_weight: float = 0.0
    _sums: dict[int, tuple[float, float]] = field(default_factory=dict)  # rows -> (weighted sum, weight)

    @property
    def seen(self) -> list[int]:
        return list(self._sums)

    def add(self, rows: int, value: float) -> None:
        total, weight = self._sums.get(rows, (0.0, 0.0))
        self._sums[rows] = (total * self.decay + value, weight * self.decay + 1.0)

    def relax(self, rows: int) -> None:
        """Decay without an observation at the nearest size seen, one step per batch round (a `rows`-th of a step per
        row's round), so that the mean drifts back to the prior as fast under load as alone."""
        if not self._sums:
            return
        near = rows if rows in self._sums else min(self._sums, key=lambda r: (abs(r - rows), r))
        total, weight = self._sums[near]
        step = self.decay ** (1.0 / max(1, rows))
        self._sums[near] = (total * step, weight * step)

    def at(self, rows: int) -> float:
        if not self._sums:
            return self.prior
        near = rows if rows in self._sums else min(self._sums, key=lambda r: (abs(r - rows), r))
        total, weight = self._sums[near]
        return (total + self.prior * self.prior_weight) / (weight + self.prior_weight)


@dataclass
class VerifyTimings:
    """A target worker's verify costs: its start-up profile, corrected online by the batches it runs. Each batch's
    measured seconds over the profile's prediction, per batch size, as a decayed mean: what the profile could not
    see (a draft worker sharing the cores, verification and serialisation beside the forward, a warmer machine)."""

    profile: VerifySurface
    decay: float = 0.9
    min_factor: float = 0.5
    max_factor: float = 3.0

    def __post_init__(self):
        self._factor = DecayedByRows(self.decay)  # measured over predicted, per batch size

    def observe(self, rows: int, tokens: int, seconds: float) -> None:
        """A verify batch of `rows` rows feeding `tokens` positions ran `seconds`."""
        if rows <= 0 or tokens <= 0 or seconds <= 0:
            return
        width = math.ceil(tokens / rows)
        self._factor.add(rows, min(self.max_factor, max(self.min_factor, seconds / self.profile.at(rows, width))))

    def factor(self, rows: int) -> float:
        """The correction at this batch size: its own when seen, else the nearest seen one's, else 1."""
        return self._factor.at(rows)

    def at(self, rows: int, width: int) -> float:
        return self.profile.at(rows, width) * self.factor(rows)

    def for_rows(self, rows: int, widest: int) -> VerifyCosts:
        return VerifyCosts(tuple(self.at(rows, w) for w in range(1, widest + 1)))

    def surface(self) -> VerifySurface:
        """The corrected surface, at the profile's measured row counts and the batch sizes seen since."""
        rows = sorted(set(self.profile.rows) | set(self._factor.seen))
        width = self.profile.max_width
        return VerifySurface(tuple(rows), tuple(tuple(self.at(r, w) for w in range(1, width + 1)) for r in rows))


@dataclass(frozen=True)
class PlannerCosts:
    """What k = 'auto' weighs: the target's verify cost (per width for one row, or measured over batch sizes too)
    and the drafters' costs (prompt lookup's: none)."""

    verify: VerifyCosts | VerifySurface | VerifyTimings
    head: DraftCost = DraftCost()
    draft: DraftCost = DraftCost()

    @property
    def surface(self) -> VerifySurface | VerifyTimings:
        return VerifySurface.single(self.verify) if isinstance(self.verify, VerifyCosts) else self.verify

    def profiled(self, rows: int, width: int) -> float:
        """A forward over `rows` rows of `width` new positions as the start-up profile measured it, without the online
        correction (which passes that also carried a prompt's chunk move, up to 3x)."""
        verify = self.verify.profile if isinstance(self.verify, VerifyTimings) else self.surface
        return verify.at(rows, width)

    @property
    def drafters(self) -> dict[str, DraftCost]:
        return {HEAD_CHAIN: self.head, MODEL_CHAIN: self.draft}

    def observe_batch(self, rows: int, tokens: int, seconds: float) -> None:
        """A verify batch the target worker reported: corrects the measured surface (fixed costs learn nothing)."""
        if isinstance(self.verify, VerifyTimings):
            self.verify.observe(rows, tokens, seconds)
