"""The interface every proposer implements (torch-free): `propose(request_id, tokens, k, params) -> Proposal`,
`propose_batch(rows)` (many requests' `DraftRow`s at once), `release(request_id)`; tree proposers add
`propose_tree` (an EAGLE-3 head also `propose_trees`, many requests' `TreeDraftRow`s at once). The in-process engine
and the distributed draft workers use every proposer alike. A proposer's KV cache, if it has one, rolls back lazily on
the next call, by token comparison, so it needs no word of what was accepted.

The proposers, one a file: `ngram.py` (prompt lookup, chains and trees), `draft_model.py` (a small causal LM),
`suffix.py` (suffix decoding), `eagle/` (an EAGLE-3 head, chains and trees); `methods.py` says which a method uses."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple, Protocol

from specserve.workers.config.request import SamplingParams
from specserve.workers.speculation.draft_tree import TreeShape

if TYPE_CHECKING:
    import torch


class DraftRow(NamedTuple):
    """One request's drafting in a batch: its committed tokens, how many to draft after them, how to sample."""

    request_id: str
    tokens: Sequence[int]  # the committed sequence
    k: int  # tokens to draft
    params: SamplingParams


class TreeDraftRow(NamedTuple):
    """One request's tree drafting in a batch: its committed tokens and the shape of the tree to draft after them."""

    request_id: str
    tokens: Sequence[int]  # the committed sequence
    shape: TreeShape  # the tree's levels, candidates per level and nodes kept


@dataclass
class Proposal:
    tokens: list[int]  # drafted tokens, 0..k of them
    # [len(tokens), V] draft probs: the distribution each drafted token was drawn from (truncated, float16-exact,
    # see workers/speculation/codec.py); None = deterministic (one-hot) proposals.
    probs: torch.Tensor | None


class Drafter(Protocol):
    def propose(self, request_id: str, tokens: Sequence[int], k: int, params: SamplingParams) -> Proposal: ...

    def propose_batch(self, rows: Sequence[DraftRow]) -> list[Proposal]: ...

    def release(self, request_id: str) -> None: ...
