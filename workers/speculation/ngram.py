"""Prompt lookup (methods "ngram" and "ngram-tree"; torch-free, no model): the sequence's suffix n-grams are looked
up in its earlier text, and what followed a match is proposed.

A chain follows the most recent occurrence of the longest match (`ngram_match`). A tree takes every recent earlier
occurrence's continuation and merges them into a trie, so where the text went on in different ways each way is
verified at once (`ngram_tree`). A node's score is the log of the share of the matches' weight that passes through it,
each match weighing its n (longer matches are better evidence): a path's score never rises along it, so the `budget`
best nodes keep their parents (DraftTree.best), and k='auto' prunes by it as it does a head's path probabilities.
Candidates are deterministic (one-hot): sampled requests verify them by rejection sampling, losslessly.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from specserve.workers.config.request import SamplingParams
from specserve.workers.config.settings import NgramConfig
from specserve.workers.runtime.tree_rows import ROOT
from specserve.workers.speculation.draft_tree import DraftTree, TreeShape
from specserve.workers.speculation.drafter import DraftRow, Proposal

MAX_MATCHES = 16  # earlier occurrences merged per round, most recent first: bounds the lookup's cost


def ngram_matches(tokens: Sequence[int], max_ngram: int, min_ngram: int,
                  max_matches: int = MAX_MATCHES) -> list[tuple[int, int]]:  # fmt: skip
    """(start of the continuation, n) of the most recent earlier occurrences of the suffix n-grams, longest n first;
    each continuation start once (under its longest n)."""
    seq, length = list(tokens), len(tokens)
    found: list[tuple[int, int]] = []
    starts: set[int] = set()
    for n in range(min(max_ngram, length - 1), min_ngram - 1, -1):
        suffix = seq[length - n :]
        for start in range(length - n - 1, -1, -1):
            follow = start + n
            if follow not in starts and seq[start:follow] == suffix:
                starts.add(follow)
                found.append((follow, n))
                if len(found) == max_matches:
                    return found
    return found


def ngram_tree(tokens: Sequence[int], budget: int, depth: int, max_ngram: int, min_ngram: int) -> DraftTree | None:
    """The trie of the matches' continuations (up to `depth` tokens each), cut to its `budget` best nodes; None when
    nothing matches."""
    seq = list(tokens)
    nodes: dict[tuple[int, int], int] = {}  # (parent, token) -> node
    tree_tokens: list[int] = []
    parents: list[int] = []
    weights: list[float] = []
    total = 0.0
    for start, n in ngram_matches(seq, max_ngram, min_ngram):
        node, total = ROOT, total + n
        for token in seq[start : start + depth]:
            child = nodes.get((node, token))
            if child is None:
                child = nodes[(node, token)] = len(tree_tokens)
                tree_tokens.append(token)
                parents.append(node)
                weights.append(0.0)
            weights[child] += n
            node = child
    if not tree_tokens:
        return None
    tree = DraftTree(tree_tokens, parents, [math.log(w / total) for w in weights])
    return tree.best(budget) if len(tree_tokens) > budget else tree


class NgramDrafter:
    """Prompt-lookup drafting: find the latest earlier occurrence of the sequence's last n tokens (longest n first)
    and propose the tokens that followed it. Deterministic, so its draft distributions are one-hot."""

    def __init__(self, config: NgramConfig | None = None):
        self.config = config or NgramConfig()

    def propose(self, request_id: str, tokens: Sequence[int], k: int, params: SamplingParams) -> Proposal:
        return Proposal(tokens=ngram_lookup(tokens, k, self.config.max_ngram, self.config.min_ngram), probs=None)

    def propose_batch(self, rows: Sequence[DraftRow]) -> list[Proposal]:
        return [self.propose(*row) for row in rows]  # no model: nothing to batch

    def propose_tree(self, request_id: str, tokens: Sequence[int], shape: TreeShape) -> DraftTree | None:
        """The continuations of every recent match as a tree (`ngram_tree`); None when nothing matches."""
        return ngram_tree(tokens, shape.budget, shape.depth, self.config.max_ngram, self.config.min_ngram)

    def release(self, request_id: str) -> None:
        pass


def ngram_lookup(tokens: Sequence[int], k: int, max_ngram: int, min_ngram: int) -> list[int]:
    """Up to k tokens that followed the most recent earlier match of the longest matching suffix n-gram."""
    return ngram_match(tokens, k, max_ngram, min_ngram)[1]


def ngram_match(tokens: Sequence[int], k: int, max_ngram: int, min_ngram: int) -> tuple[int, list[int]]:
    """(n, continuation): the longest suffix n-gram with an earlier occurrence that has a continuation, and up to k
    tokens that followed its most recent one; (0, []) when none matches."""
    found = ngram_matches(tokens, max_ngram, min_ngram, max_matches=1) if k > 0 else []
    if not found:
        return 0, []
    start, n = found[0]
    return n, list(tokens[start : start + k])
