"""Drafters: propose k tokens for a request, with the distributions they were drawn from.

Every drafter has the same interface, so the in-process engine and the distributed draft workers use them alike:
`propose(request_id, tokens, k, params) -> Proposal`, `propose_batch(rows)` (many requests at once),
`release(request_id)`. A drafter's KV cache rolls back lazily on the next call, by token comparison, so it needs no
word of what was accepted.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from specserve.workers.config import NgramConfig, SamplingParams
from specserve.workers.runtime.runner import ModelRunner
from specserve.workers.speculation.codec import sparsify
from specserve.workers.speculation.draft_tree import DraftTree, TreeShape
from specserve.workers.speculation.ngram_tree import ngram_matches, ngram_tree
from specserve.workers.speculation.sampling import (
    DRAFT_SALT,
    exponential_noise,
    logits_to_probs,
    make_generator,
    sample_with_noise,
)


@dataclass
class Proposal:
    tokens: list[int]  # drafted tokens, 0..k of them
    # [len(tokens), V] draft probs: the distribution each drafted token was drawn from (truncated, float16-exact,
    # see workers/speculation/codec.py); None = deterministic (one-hot) proposals.
    probs: torch.Tensor | None


class Drafter(Protocol):
    def propose(self, request_id: str, tokens: Sequence[int], k: int, params: SamplingParams) -> Proposal: ...

    def propose_batch(self, rows: Sequence[tuple[str, Sequence[int], int, SamplingParams]]) -> list[Proposal]: ...

    def release(self, request_id: str) -> None: ...


class ModelDrafter:
    """A small causal LM drafting autoregressively from its own KV cache, sampled like the target.

    Sampled requests draw from `sparsify(q)`: the draft distribution's high-mass support in float16, exactly what a
    draft worker ships to the target over the wire, so in-process and distributed runs draft the same tokens."""

    def __init__(self, runner: ModelRunner, max_support: int = 256):
        self.runner = runner
        self.max_support = max_support

    def propose(self, request_id: str, tokens: Sequence[int], k: int, params: SamplingParams) -> Proposal:
        return self.propose_batch([(request_id, tokens, k, params)])[0]

    def propose_batch(self, rows: Sequence[tuple[str, Sequence[int], int, SamplingParams]]) -> list[Proposal]:
        """Draft for many requests at once: one forward pass per drafting step over every row still drafting (rows
        leave as they reach their own k). Each row's tokens are those it would draft alone."""
        seqs = [list(tokens) for _, tokens, _, _ in rows]
        drafted: list[list[int]] = [[] for _ in rows]
        probs: list[list[torch.Tensor]] = [[] for _ in rows]  # per row: one [V] row per drafted token
        while True:
            active = [b for b, (_, _, k, _) in enumerate(rows) if len(drafted[b]) < k]
            if not active:
                break
            logits = self.runner.logits_for_batch([(rows[b][0], seqs[b], 1) for b in active])
            for b, row_logits in zip(active, logits, strict=True):
                params = rows[b][3]
                token, q = draw_token(row_logits[0], params, len(seqs[b]), self.max_support)
                if q is not None:
                    probs[b].append(q)
                drafted[b].append(token)
                seqs[b].append(token)
        return [Proposal(tokens=d, probs=torch.stack(p) if p else None) for d, p in zip(drafted, probs, strict=True)]

    def release(self, request_id: str) -> None:
        self.runner.release(request_id)


def draw_token(
    logits: torch.Tensor, params: SamplingParams, position: int, max_support: int
) -> tuple[int, torch.Tensor | None]:
    """logits: [V]. The drafted token at absolute `position`, and the draft probs it was drawn from (None: greedy):
    `sparsify` of the request's sampling distribution, so the target sees exactly what was sampled from."""
    if params.greedy:
        return int(logits.argmax()), None
    q = sparsify(logits_to_probs(logits, params), max_support).cpu()  # [V]
    # Noise keyed by the drafted token's absolute position: a token drafted early (pipelined) or again (after a
    # restart) is drawn with the same noise, so seeded requests reproduce in every mode.
    generator = make_generator(params.seed, DRAFT_SALT, position)
    noise = exponential_noise(q.shape[-1], [generator])  # [1, V]
    return int(sample_with_noise(q.unsqueeze(0), noise)[0]), q


class NgramDrafter:
    """Prompt-lookup drafting: find the latest earlier occurrence of the sequence's last n tokens (longest n first)
    and propose the tokens that followed it. Deterministic, so its draft distributions are one-hot."""

    def __init__(self, config: NgramConfig | None = None):
        self.config = config or NgramConfig()

    def propose(self, request_id: str, tokens: Sequence[int], k: int, params: SamplingParams) -> Proposal:
        return Proposal(tokens=ngram_lookup(tokens, k, self.config.max_ngram, self.config.min_ngram), probs=None)

    def propose_batch(self, rows: Sequence[tuple[str, Sequence[int], int, SamplingParams]]) -> list[Proposal]:
        return [self.propose(*row) for row in rows]  # no model: nothing to batch

    def propose_tree(self, request_id: str, tokens: Sequence[int], shape: TreeShape) -> DraftTree | None:
        """The continuations of every recent match as a tree (ngram_tree.py); None when nothing matches."""
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
