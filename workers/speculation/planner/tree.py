"""How many of a drafted tree's nodes to verify (eagle-tree with k = 'auto'), from the head's own confidence.

EAGLE-2's observation: a head's probability of a path predicts whether the target accepts it. So the expected
accepted length of the tree made of the b best nodes is about c * sum of exp(score) over them (score: the path's
log-probability; c: the request's calibration, accepted / predicted over its verified rounds, from a cautious
prior), and a round verifies the b with the most committed tokens per second at the target's verify cost measured per
width, or none (a plain step) when no b pays. The head's drafting is already spent when b is chosen: it does not
enter the choice. Pure functions and small per-request state (`TreePruning`), shared by the in-process engine and the
distributed scheduler.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from specserve.workers.runtime.tree_rows import ROOT
from specserve.workers.speculation.draft_tree import DraftTree
from specserve.workers.speculation.planner.costs import VerifyCosts

MAX_TREE_NODES = 16  # the tree drafted for k='auto', pruned each round


MAX_PLAIN_ROUNDS = 16  # the longest run of plain steps between trees that pay for no node


@dataclass
class TreeCalibration:
    """accepted / predicted over a request's verified trees, starting from a prior worth a round or two."""

    predicted: float = 2.0
    accepted: float = 1.0  # the prior takes the head's probabilities at half their word

    @property
    def factor(self) -> float:
        return self.accepted / self.predicted

    def observe(self, predicted: float, accepted: int) -> None:
        self.predicted += predicted
        self.accepted += accepted


def expected_accepted_by_size(scores: Sequence[float], factor: float) -> list[float]:
    """scores: the nodes' path log-probabilities, best first -> per b = 1.., the expected accepted nodes of the b
    best (never more than b)."""
    out, total = [], 0.0
    for b, score in enumerate(scores, start=1):
        total += factor * math.exp(score)
        out.append(min(total, float(b)))
    return out


def best_node_count(scores: Sequence[float], verify: VerifyCosts, factor: float) -> int:
    """The b (0: none) whose round commits the most tokens per second: (1 + E(b)) / t_verify[b + 1]."""
    best, best_rate = 0, 1.0 / verify.verify(0)
    for b, expected in enumerate(expected_accepted_by_size(scores[: verify.max_k], factor), start=1):
        rate = (1.0 + expected) / verify.verify(b)
        if rate > best_rate:
            best, best_rate = b, rate
    return best


@dataclass
class TreePruning:
    """One request's k='auto' trees: each drafted tree cut to the nodes that pay (`prune`), and the verified outcome
    back into its calibration (`observe`)."""

    verify: VerifyCosts
    calibration: TreeCalibration = field(default_factory=TreeCalibration)
    predicted: float = 0.0  # expected accepted nodes of the tree being verified
    plain_rounds: int = 0  # plain steps to take before drafting the next tree
    backoff: int = 0  # plain steps after the last tree that paid for no node (doubles while trees keep failing)
    costly: bool = True  # drafting a tree costs model work (a head's); prompt lookup's trees cost nothing

    def wants_tree(self) -> bool:
        """Whether to draft a tree this round: not for a few rounds after trees that paid for no node (drafting one
        costs the head's levels for nothing), so that a load where no tree pays runs plain steps."""
        if self.plain_rounds > 0:
            self.plain_rounds -= 1
            return False
        return True

    def prune(self, tree: DraftTree) -> DraftTree | None:
        """The tree's best nodes that pay for their verification, or None (a plain step) when none does."""
        scores = sorted(tree.scores, reverse=True)
        count = best_node_count(scores, self.verify, self.calibration.factor)
        self.predicted = sum(math.exp(s) for s in scores[:count])
        # Backing off saves a head's levels; a lookup tree costs nothing to draft, and the next match may pay.
        self.backoff = 0 if count or not self.costly else min(MAX_PLAIN_ROUNDS, max(1, 2 * self.backoff))
        self.plain_rounds = self.backoff
        return tree.best(count) if count else None

    def observe(self, accepted: int) -> None:
        """The verified tree's accepted nodes."""
        self.calibration.observe(self.predicted, accepted)


@dataclass
class TreeYield:
    """Accepted nodes a round of a request's head trees, a decayed mean from a prior (a tree pruned to nothing counts
    0: its round committed one token): what the next head tree is expected to commit, against which a lookup's
    continuation competes (method eagle-tree+ngram)."""

    mean: float = 1.0
    decay: float = 0.8

    def observe(self, accepted: int) -> None:
        self.mean = self.decay * self.mean + (1.0 - self.decay) * accepted


def chain_tree(tokens: Sequence[int]) -> DraftTree:
    """A chain as a tree: each token the child of the one before (verified by the tree path, a prefix accepted)."""
    return DraftTree(list(tokens), [ROOT, *range(len(tokens) - 1)], [0.0] * len(tokens))
