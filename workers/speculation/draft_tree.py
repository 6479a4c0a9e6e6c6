"""A drafted token tree as it travels (draft worker -> scheduler -> target worker) and the shape a drafter gives it.
Plain Python: the scheduler and the gRPC clients handle trees without torch."""

from __future__ import annotations

from dataclasses import dataclass

from specserve.workers.runtime.tree_rows import ROOT, node_depths

# A level of the head costs ~7% of a target step on a CPU (SmolLM2-135M): expanding frontier paths less likely than
# this rarely wins a token (the packaged head: 20.6 -> 22.7 tokens/s at 8 nodes, from 5 levels of 6 to 2-3).
MIN_PATH_PROB = 0.2


@dataclass(frozen=True)
class TreeShape:
    """depth: levels of candidates (the longest path); topk: children scored per expanded node and nodes expanded
    per level; budget: nodes kept (what the target verifies, plus the root's token)."""

    depth: int
    topk: int
    budget: int
    min_path_prob: float = 0.0  # expand no level whose best frontier path is less likely than this

    @classmethod
    def for_budget(cls, budget: int) -> TreeShape:
        """A tree of up to `budget` nodes: a chain up to 2, then 2 and from 8 nodes 4 candidates per level, 6 levels
        at most (EAGLE-2's defaults are 4-8 per level, 5-6 levels), none beyond paths of MIN_PATH_PROB."""
        topk = 1 if budget <= 2 else 2 if budget < 8 else 4
        return cls(depth=min(budget, 6), topk=topk, budget=budget, min_path_prob=MIN_PATH_PROB)


@dataclass
class DraftTree:
    tokens: list[int]  # target ids, in depth order
    parents: list[int]  # ROOT or the index of an earlier node
    scores: list[float]  # the head's log-probability of the path ending at each node

    def best(self, count: int) -> DraftTree:
        """The tree of its `count` best nodes (their parents among them: a path's score never rises along it)."""
        order = sorted(range(len(self.tokens)), key=lambda i: (-self.scores[i], i))[:count]
        kept = sorted(order)  # index order is depth order, parents first
        index = {node: i for i, node in enumerate(kept)}
        parents = [ROOT if self.parents[node] == ROOT else index[self.parents[node]] for node in kept]
        return DraftTree([self.tokens[node] for node in kept], parents, [self.scores[node] for node in kept])

    @property
    def depth(self) -> int:
        """Nodes on the longest root-to-node path."""
        return 1 + max(node_depths(self.parents), default=-1)
