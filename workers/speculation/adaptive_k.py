"""Speculation math shared by the benchmark and the adaptive-k policy: Leviathan et al.'s expected speedup, and a
per-request chooser of k from the acceptance it has measured so far. Pure functions and a small state object."""

from __future__ import annotations

from dataclasses import dataclass

from specserve.workers.config import MAX_K


def expected_tokens_per_round(a: float, k: float) -> float:
    """E[tokens committed per round] when each drafted token is accepted with probability a: (1 - a^(k+1)) / (1 - a)."""
    if a >= 1.0:
        return k + 1.0
    return (1.0 - a ** (k + 1)) / (1.0 - a)


def leviathan_speedup(a: float, k: float, c: float) -> float:
    """S(k) = (1 - a^(k+1)) / ((1 - a)(k c + 1)): expected speedup with cost ratio c = t_draft / t_target."""
    return expected_tokens_per_round(a, k) / (k * c + 1.0)


def fit_acceptance(tokens_per_round: float, k: float) -> float:
    """The per-position acceptance a whose expected tokens per round at this k equal the measured figure."""
    if k <= 0 or tokens_per_round <= 1.0:
        return 0.0
    if tokens_per_round >= k + 1:
        return 1.0
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if expected_tokens_per_round(mid, k) < tokens_per_round:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


@dataclass
class AdaptiveK:
    """Chooses k per round from the request's measured acceptance, maximising S(k).

    Acceptance is estimated by counting acceptance events against rejection events (a round that keeps fewer tokens
    than it drafted ends in exactly one rejection), which is the maximum-likelihood estimate for the geometric model
    behind S(k). k moves only when the predicted gain exceeds `hysteresis`, so it does not flap between neighbours.
    """

    cost_ratio: float = 0.1  # c = t_draft / t_target
    k: int = 4
    k_min: int = 1
    k_max: int = MAX_K
    prior_accepts: float = 2.0  # a weak prior of a = 2/3, so the first rounds do not swing k
    prior_rejects: float = 1.0
    hysteresis: float = 0.03
    accepts: float = 0.0
    rejects: float = 0.0

    @property
    def acceptance(self) -> float:
        a = self.accepts + self.prior_accepts
        return a / (a + self.rejects + self.prior_rejects)

    def observe(self, drafted: int, accepted: int) -> int:
        """Record a round; returns k for the next one."""
        self.accepts += accepted
        self.rejects += 1 if accepted < drafted else 0
        a = min(self.acceptance, 0.999)
        best = max(range(self.k_min, self.k_max + 1), key=lambda k: leviathan_speedup(a, k, self.cost_ratio))
        if leviathan_speedup(a, best, self.cost_ratio) > (1 + self.hysteresis) * leviathan_speedup(
            a, self.k, self.cost_ratio
        ):
            self.k = best
        return self.k
