"""Random draft trees for tree verification tests: in (tokens, parents) form, one branch following a given truth."""

import random

from specserve.workers.runtime.tree_rows import ROOT


def random_tree(truth: list[int], vocab: int, rng: random.Random) -> tuple[list[int], list[int]]:
    """A tree of 1-3 branches off the root (and one off the first branch's first node), in random sibling order; one
    branch is the first `d` tokens of `truth` then a random token."""
    right = truth[: rng.randint(0, min(4, len(truth)))] + [rng.randrange(vocab)]
    branches = [right] + [[rng.randrange(vocab) for _ in range(rng.randint(1, 3))] for _ in range(rng.randint(0, 2))]
    rng.shuffle(branches)
    tokens, parents = [], []
    for branch in branches:
        parent = ROOT
        for token in branch:
            tokens.append(token)
            parents.append(parent)
            parent = len(tokens) - 1
    tokens.append(rng.randrange(vocab))  # a sibling of the first branch's second node
    parents.append(0)
    return tokens, parents
