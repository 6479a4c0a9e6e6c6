"""A drafted token tree as one request's row of a target forward (ModelRunner.forward_tree)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

ROOT = -1  # the parent of the nodes that follow the last committed token


def node_depths(parents: Sequence[int]) -> list[int]:
    """Per node of a tree given by its parents (ROOT or an earlier node), its depth: 0 for a child of the root."""
    depths: list[int] = []
    for parent in parents:
        depths.append(0 if parent == ROOT else depths[parent] + 1)
    return depths


@dataclass(frozen=True)
class TreeRow:
    """One request's committed tokens and drafted tree: node i holds tokens[i], a child of parents[i] (ROOT or an
    earlier node, so index order is a topological order)."""

    request_id: str
    sequence: Sequence[int]  # the committed tokens
    tokens: Sequence[int]  # [N] drafted
    parents: Sequence[int]  # [N]

    def check(self) -> None:
        """ValueError unless the tree is well formed and there is a committed token to hang it on."""
        if not self.sequence:
            raise ValueError(f"{self.request_id!r}: a tree needs a committed token before it")
        if len(self.tokens) != len(self.parents):
            raise ValueError(f"{self.request_id!r}: {len(self.tokens)} tokens for {len(self.parents)} parents")
        for i, parent in enumerate(self.parents):
            if not ROOT <= parent < i:
                raise ValueError(f"{self.request_id!r}: node {i}'s parent {parent} is not the root or an earlier node")

    def depths(self) -> list[int]:
        """Per node, its depth (0 for a child of the root): its rotary position is the root's + 1 + depth."""
        return node_depths(self.parents)

    def lineages(self) -> list[list[int]]:
        """Per node, the nodes it attends to: its ancestors and itself."""
        lineages: list[list[int]] = []
        for i, parent in enumerate(self.parents):
            lineages.append(([] if parent == ROOT else lineages[parent]) + [i])
        return lineages
