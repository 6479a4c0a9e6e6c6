"""How many tokens a chain drafter should draft, and which drafter's chain to take, from acceptance measured per
position and the target's verify cost measured per width. Pure functions and small per-request state.

Leviathan's S(k) assumes one acceptance rate for every position and a verify that costs one target step at any
width. Neither holds for a draft head on a CPU: a head accepts ~0.45 at position 1 and much less after, and on 2
cores verifying 2-3 positions costs more than verifying 5. So the rate of a chain of k is

    R(k) = (1 + E(k)) / (t_fixed + k t_step + t_verify[k + 1]),   E(k) = sum_{i<k} prod_{j<=i} a_j,

with a_j the acceptance at position j given that position j-1 was accepted, t_fixed + k t_step the drafter's cost of
k drafts, and k = 0 (no drafting) at 1 / t_verify[1]. The policy drafts the k with the largest R.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

MAX_AUTO_K = 8  # the longest chain k='auto' drafts: a head's acceptance at position 9+ is too small to pay for it


def expected_accepted(rates: Sequence[float], k: int) -> float:
    """E(k): the expected accepted tokens of a chain of k drafts. rates[j]: acceptance at position j given j-1."""
    total, reach = 0.0, 1.0
    for a in rates[:k]:
        reach *= a
        total += reach
    return total


@dataclass(frozen=True)
class VerifyCosts:
    """verify_s[w - 1]: seconds of one target forward over w new positions (w = drafted + 1), measured."""

    verify_s: tuple[float, ...]

    @property
    def max_k(self) -> int:
        return len(self.verify_s) - 1

    def verify(self, k: int) -> float:
        return self.verify_s[min(k, self.max_k)]


@dataclass(frozen=True)
class DraftCost:
    """A drafter's seconds for k drafts: fixed_s + k step_s (n-gram lookup: zero)."""

    step_s: float = 0.0
    fixed_s: float = 0.0

    def of(self, k: int) -> float:
        return self.fixed_s + k * self.step_s if k else 0.0


@dataclass
class PositionAcceptance:
    """Acceptance per chain position for one drafter: counts over its rounds on top of a prior (rates worth
    `prior_weight` rounds each), so the first rounds follow the prior. One request's counts are kept whole; a
    model's, over every request's rounds, decay (`decay` < 1: older rounds count less)."""

    prior: tuple[float, ...]
    prior_weight: float = 4.0
    decay: float = 1.0
    reached: list[float] = field(default_factory=list)
    accepted: list[float] = field(default_factory=list)

    def observe(self, drafted: int, accepted: int) -> None:
        """A round drafted `drafted` tokens and the target accepted the first `accepted`: positions 0..accepted-1
        were accepted, position `accepted` (if drafted) reached and rejected."""
        reached = min(drafted, accepted + 1)
        if self.decay != 1.0:
            self.reached = [n * self.decay for n in self.reached]
            self.accepted = [n * self.decay for n in self.accepted]
        while len(self.reached) < reached:
            self.reached.append(0)
            self.accepted.append(0)
        for j in range(reached):
            self.reached[j] += 1
            self.accepted[j] += 1 if j < accepted else 0

    def relax(self) -> None:
        """A round that could have drafted with this drafter and did not: decayed counts forget a little, so the rates
        drift back to the prior. A record low enough to stop drafting would otherwise never be measured again."""
        if self.decay != 1.0:
            self.reached = [n * self.decay for n in self.reached]
            self.accepted = [n * self.decay for n in self.accepted]

    def rates(self, k: int) -> list[float]:
        out = []
        for j in range(k):
            a0 = self.prior[min(j, len(self.prior) - 1)]
            n, hits = (self.reached[j], self.accepted[j]) if j < len(self.reached) else (0, 0)
            out.append((hits + a0 * self.prior_weight) / (n + self.prior_weight))
        return out

    def known_rates(self) -> tuple[float, ...]:
        """The rates at every position the prior or the rounds reached."""
        return tuple(self.rates(max(len(self.prior), len(self.reached))))
