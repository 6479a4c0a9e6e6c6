"""A verify row under its request's grammar (grammar.py): the drafted chain cut at its first forbidden token, a tree
pruned of its forbidden nodes, and the mask of every verified position, before the target's forward pass."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from specserve.workers.config.request import SamplingParams
from specserve.workers.runtime.tree_rows import ROOT, TreeRow
from specserve.workers.speculation.grammar import Grammars


@dataclass(frozen=True)
class PrunedTree:
    tree: TreeRow  # the tree to verify: the kept nodes, renumbered
    kept: list[int]  # the original index of each of its nodes
    allowed: torch.Tensor  # [len(kept) + 1, V] bool: the grammar's mask at the root and after each kept node


def constrain_chain(grammars: Grammars, row: NamedTuple) -> tuple[NamedTuple, torch.Tensor | None]:
    """(row, allowed): a TargetVerifier's VerifyRow (target.py) whose drafted tokens stop at the grammar's first
    forbidden one (kept as the last, certainly rejected, token when the draft's probabilities are sampled against: the
    recovered token is then drawn from the residual, as rejection sampling requires), and the mask
    [len(drafted) + 1, V] of its verified positions; the row unchanged and None without a response_format."""
    drafted, probs, params = row.drafted, row.draft_probs, row.params
    grammar = _synced(grammars, row.request_id, row.tokens, params)
    if grammar is None:
        return row, None
    length, allowed = grammar.chain(list(drafted), keep_forbidden=probs is not None and not params.greedy)
    if length < len(drafted):
        row = row._replace(drafted=list(drafted)[:length], draft_probs=None if probs is None else probs[:length])
    return row, allowed


def constrain_tree(grammars: Grammars, tree: TreeRow, params: SamplingParams) -> PrunedTree | None:
    """The tree without the nodes the grammar forbids on their path (and their subtrees), with the mask of every
    position; None without a response_format."""
    grammar = _synced(grammars, tree.request_id, tree.sequence, params)
    if grammar is None:
        return None
    kept, allowed = grammar.tree(tree.tokens, tree.parents)
    index = {old: new for new, old in enumerate(kept)}
    parents = [ROOT if tree.parents[i] == ROOT else index[tree.parents[i]] for i in kept]
    pruned = TreeRow(tree.request_id, tree.sequence, [tree.tokens[i] for i in kept], parents, tree.prefix_at_most)
    return PrunedTree(pruned, kept, allowed[[0] + [i + 1 for i in kept]])


def _synced(grammars: Grammars, request_id: str, tokens: Sequence[int], params: SamplingParams):
    if params.response_format is None:
        return None
    grammar = grammars.for_request(request_id, params.response_format)
    grammar.sync(list(tokens)[params.prompt_len :])
    return grammar
