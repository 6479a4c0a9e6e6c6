"""Acceptance by chain position, measured from a drafter's rounds on top of a prior (`PositionAcceptance`), and what
a chain of k is expected to accept from it (`expected_accepted`). Leviathan's S(k) assumes one rate for every
position; a head accepts ~0.45 at position 1 and much less after, so each position has its own. Priors: a head's
(its config's measured one where it has one), prompt lookup's by matched suffix length, a draft model's, suffix
drafting's. Pure values, torch-free.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

# Prior acceptance given the previous position accepted. The head's: a trained SmolLM2 head on held-out chat (its
# config may carry measured ones); the n-gram's by matched suffix length 1, 2, 3+ (held-out chat, k = 4); a draft
# model's: a small model of the target's family.
HEAD_PRIOR = (0.45, 0.4, 0.4, 0.4)


NGRAM_PRIOR = {1: 0.2, 2: 0.4, 3: 0.55}


DRAFT_PRIOR = (0.6,)


# Suffix drafting's, by matched suffix length 2-3, 4-7, 8-15, 16+: a long match repeats (an earlier answer, a quoted
# passage) and keeps repeating.
SUFFIX_PRIOR = {2: 0.35, 4: 0.5, 8: 0.65, 16: 0.8}


def expected_accepted(rates: Sequence[float], k: int) -> float:
    """E(k): the expected accepted tokens of a chain of k drafts. rates[j]: acceptance at position j given j-1."""
    total, reach = 0.0, 1.0
    for a in rates[:k]:
        reach *= a
        total += reach
    return total


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


def model_head_acceptance(recorded: Sequence[float] | None = None) -> PositionAcceptance:
    """A head's acceptance by position over a model's recent rounds, every request's (about the last thousand): where
    each new request's planning starts, from the head's recorded acceptance (its config's) or the generic prior. A
    head's record was measured on its training data, not on what a deployment serves, and a request of a few rounds
    never learns its own (8 served streams of held-out chat, answers of 8-24 tokens: 0.31 accepted a drafted token,
    where the record said 0.37 at k = 3)."""
    return PositionAcceptance(tuple(recorded or HEAD_PRIOR), prior_weight=16.0, decay=0.999)


def model_lookup_acceptance(priors: Mapping[int, float] = NGRAM_PRIOR) -> dict[int, PositionAcceptance]:
    """Prompt lookup's acceptance by matched suffix length (then by position) over a model's recent rounds, every
    request's: where each new request's lookups start, as the head's do (`model_head_acceptance`). A request's own
    record starts at the prior and a short one never learns it: on held-out chat at 4 served streams the lookup's
    4-6 token continuations accepted 0.34-0.40 tokens where the prior (0.55 a position after a 3-token match)
    expected ~1.1, more than the head's trees had lately, so they took the head's rounds
    (results/2026-12-06-0400-smollm2-worker-trees)."""
    return {n: PositionAcceptance((a,), prior_weight=16.0, decay=0.999) for n, a in priors.items()}
