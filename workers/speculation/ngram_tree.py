"""Prompt lookup as a tree (method "ngram-tree"): every recent earlier occurrence of the sequence's suffix n-grams
proposes what followed it, and the continuations are merged into a trie, so where the text went on in different ways
each way is verified at once (a chain follows only the most recent occurrence of the longest match).

A node's score is the log of the share of the matches' weight that passes through it, each match weighing its n
(longer matches are better evidence): a path's score never rises along it, so the `budget` best nodes keep their
parents (DraftTree.best), and k='auto' prunes by it as it does a head's path probabilities. Candidates are
deterministic: sampled requests verify them by recursive rejection sampling, losslessly. Pure Python, no model.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from specserve.workers.runtime.tree_rows import ROOT
from specserve.workers.speculation.draft_tree import DraftTree

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
