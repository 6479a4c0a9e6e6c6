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


def check_parents(tokens: Sequence[int], parents: Sequence[int]) -> None:
    """ValueError unless there is one parent per token, each the root or an earlier node."""
    if len(tokens) != len(parents):
        raise ValueError(f"{len(tokens)} tokens for {len(parents)} parents")
    for i, parent in enumerate(parents):
        if not ROOT <= parent < i:
            raise ValueError(f"node {i}'s parent {parent} is not the root or an earlier node")


@dataclass(frozen=True)
class TreeRow:
    """One request's committed tokens and drafted tree: node i holds tokens[i], a child of parents[i] (ROOT or an
    earlier node, so index order is a topological order)."""

    request_id: str
    sequence: Sequence[int]  # the committed tokens
    tokens: Sequence[int]  # [N] drafted
    parents: Sequence[int]  # [N]
    prefix_at_most: int | None = None  # a request new to the cache: the most positions taken from a cached prefix

    def check(self) -> None:
        """ValueError unless the tree is well formed and there is a committed token to hang it on."""
        if not self.sequence:
            raise ValueError(f"{self.request_id!r}: a tree needs a committed token before it")
        try:
            check_parents(self.tokens, self.parents)
        except ValueError as e:
            raise ValueError(f"{self.request_id!r}: {e}") from None

    def depths(self) -> list[int]:
        """Per node, its depth (0 for a child of the root): its rotary position is the root's + 1 + depth."""
        return node_depths(self.parents)

    def lineages(self) -> list[list[int]]:
        """Per node, the nodes it attends to: its ancestors and itself."""
        lineages: list[list[int]] = []
        for i, parent in enumerate(self.parents):
            lineages.append(([] if parent == ROOT else lineages[parent]) + [i])
        return lineages
