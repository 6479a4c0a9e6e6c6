"""How many tokens to draft: pure functions (and small stateful classes for hysteresis and decayed estimates) over
measured numbers, unit-tested with synthetic inputs.

Leviathan's speedup S(k) = E(k) / (k c + 1), with E(k) = (1 - a^(k+1)) / (1 - a) tokens per round, assumes verifying
k + 1 tokens costs one target step: true while the target is memory-bound (idle). A saturated target is
compute-bound and verification costs grow with the tokens verified, so we model t_verify(k) = t_target (1 + u k) for
target utilisation u in [0, 1]: S(k, u) = E(k) / (k c + 1 + u k). The policy picks the k that maximises it, moves k
at most one step per update and only for a clear gain (hysteresis), and turns speculation off when even the best k
would not beat plain decoding: speculation never costs throughput under load.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from specserve.workers.config import MAX_K
from specserve.workers.speculation.adaptive_k import expected_tokens_per_round as expected_tokens
from specserve.workers.speculation.adaptive_k import fit_acceptance


def speedup(a: float, c: float, k: int, utilisation: float = 0.0) -> float:
    """S(k, u): throughput of speculation relative to target-only decoding (k = 0 gives 1)."""
    return expected_tokens(a, k) / (k * c + 1.0 + utilisation * k)


def best_k(a: float, c: float, utilisation: float = 0.0, max_k: int = MAX_K) -> tuple[int, float]:
    """(k, S) maximising S(k, u) over 0..max_k; k = 0 means "do not speculate"."""
    best = (0, 1.0)
    for k in range(1, max_k + 1):
        s = speedup(a, c, k, utilisation)
        if s > best[1]:
            best = (k, s)
    return best


@dataclass
class SpeculationPolicy:
    """k for one model's requests from measured acceptance a, cost ratio c and target utilisation u, with
    hysteresis: k moves by one step at a time towards the best k, only when that gains more than `margin`; off
    (k = 0) when speculation would lose by more than `margin`, back on when it wins by more than `margin`."""

    max_k: int = MAX_K
    margin: float = 0.05
    k: int = 4

    def update(self, a: float, c: float, utilisation: float) -> int:
        target_k, s_best = best_k(a, c, utilisation, self.max_k)
        s_now = speedup(a, c, self.k, utilisation) if self.k else 1.0
        if self.k == 0:
            if s_best > 1.0 + self.margin:  # back on at the smallest k that wins; later updates walk it up
                self.k = next(k for k in range(1, target_k + 1) if speedup(a, c, k, utilisation) > 1.0)
        elif s_now < 1.0 - self.margin and s_best <= 1.0 + self.margin:
            self.k = 0
        elif target_k != self.k and s_best > s_now * (1.0 + self.margin):
            self.k += 1 if target_k > self.k else -1
        return self.k


@dataclass
class AcceptanceHistory:
    """A model's recent speculation outcome (decayed sums), from which the per-position acceptance a is fitted.

    Acceptance is only observed while speculating, so an estimate the policy turned speculation off on would never
    be revised: while no round drafts, the evidence fades with time (half-life `fade_half_life_s`) towards a weak
    prior (`prior_rounds` pseudo-rounds of k = 1 at `prior_acceptance`), which turns speculation back on at a small
    k to measure it again; the same prior keeps one unlucky first round from turning it off at all (seen in the
    bench's sweep: a first round accepting 0 of 4 drafted tokens fitted a = 0, and speculation stayed off for good).
    Time, not rounds: many concurrent requests run many plain rounds per second."""

    decay: float = 0.98
    prior_rounds: float = 1.0
    prior_acceptance: float = 2.0 / 3.0
    fade_half_life_s: float = 10.0
    clock: Callable[[], float] = time.monotonic
    rounds: float = 0.0  # rounds that drafted
    drafted: float = 0.0
    committed: float = 0.0  # tokens those rounds committed (accepted + 1 each)
    last_drafted_at: float | None = None

    def observe(self, drafted: int, accepted: int) -> None:
        if drafted:
            w = self._weight() * self.decay
            self.rounds = self.rounds * w + 1
            self.drafted = self.drafted * w + drafted
            self.committed = self.committed * w + accepted + 1
            self.last_drafted_at = self.clock()

    def _weight(self) -> float:
        """How much of the evidence is left after the time since the last drafted round."""
        if self.last_drafted_at is None:
            return 1.0
        return 0.5 ** (max(0.0, self.clock() - self.last_drafted_at) / self.fade_half_life_s)

    def estimate(self) -> float | None:
        """Per-position acceptance a fitted to the recent tokens per round, the prior included (None before any
        round has drafted)."""
        if self.last_drafted_at is None:
            return None
        w = self._weight()
        rounds = self.rounds * w + self.prior_rounds
        committed = self.committed * w + self.prior_rounds * (1.0 + self.prior_acceptance)
        return fit_acceptance(committed / rounds, (self.drafted * w + self.prior_rounds) / rounds)


@dataclass
class VerifyCostModel:
    """The target's measured cost of a batched forward pass, seconds = t0 + t1 * tokens, fitted by decayed least
    squares to what target workers report per verify (compute_seconds and batch_tokens of the batch it ran in).

    With B requests per target, target-only decoding steps cost t0 + t1 B and verifying k drafted tokens per request
    adds t1 B k: so the policy's utilisation is u = t1 B / (t0 + t1 B), 0 for an idle memory-bound target (a step
    costs the same whatever it verifies) and towards 1 for a saturated compute-bound one."""

    decay: float = 0.99
    w: float = 0.0
    sx: float = 0.0
    sy: float = 0.0
    sxx: float = 0.0
    sxy: float = 0.0

    def observe(self, tokens: int, seconds: float) -> None:
        if tokens <= 0 or seconds <= 0:
            return
        d = self.decay
        self.w, self.sx, self.sy = self.w * d + 1, self.sx * d + tokens, self.sy * d + seconds
        self.sxx, self.sxy = self.sxx * d + tokens * tokens, self.sxy * d + tokens * seconds

    def fit(self) -> tuple[float, float] | None:
        """(t0, t1), or None until batches of different sizes have been seen."""
        det = self.w * self.sxx - self.sx * self.sx
        if self.w < 2 or det <= 1e-9 * max(1.0, self.w * self.sxx):
            return None
        t1 = max(0.0, (self.w * self.sxy - self.sx * self.sy) / det)
        t0 = max(0.0, (self.sy - t1 * self.sx) / self.w)
        return t0, t1

    def utilisation(self, requests_per_target: float) -> float | None:
        fit = self.fit()
        if fit is None or requests_per_target <= 0:
            return None
        t0, t1 = fit
        step = t0 + t1 * requests_per_target
        return 0.0 if step <= 0 else min(1.0, t1 * requests_per_target / step)


def target_utilisation(active_requests: int, healthy_targets: int, saturation_requests: int) -> float:
    """Fraction of the target pool's capacity in use: requests per target over the per-target saturation point."""
    if healthy_targets <= 0:
        return 1.0
    return min(1.0, active_requests / (healthy_targets * saturation_requests))
