"""Draft-model drafting (method "draft"): a small causal LM proposes k tokens for a request, with the distributions
they were drawn from, behind the Drafter interface (drafter.py). Its KV cache rolls back lazily on the next call, by
token comparison, so it needs no word of what was accepted.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specserve.workers.config.request import SamplingParams
from specserve.workers.runtime.runner import ForwardRow, ModelRunner
from specserve.workers.speculation.drafter import DraftRow, Proposal
from specserve.workers.speculation.sampling import draw_token


class ModelDrafter:
    """A small causal LM drafting autoregressively from its own KV cache, sampled like the target.

    Sampled requests draw from `sparsify(q)`: the draft distribution's high-mass support in float16, exactly what a
    draft worker ships to the target over the wire, so in-process and distributed runs draft the same tokens."""

    def __init__(self, runner: ModelRunner, max_support: int = 256):
        self.runner = runner
        self.max_support = max_support

    def propose(self, request_id: str, tokens: Sequence[int], k: int, params: SamplingParams) -> Proposal:
        return self.propose_batch([DraftRow(request_id, tokens, k, params)])[0]

    def propose_batch(self, rows: Sequence[DraftRow]) -> list[Proposal]:
        """Draft for many requests at once: one forward pass per drafting step over every row still drafting (rows
        leave as they reach their own k). Each row's tokens are those it would draft alone. A row of k = 0 joins the
        first pass only, to cache its tokens (a long prompt's chunk, fed ahead of its first draft)."""
        seqs = [list(row.tokens) for row in rows]
        drafted: list[list[int]] = [[] for _ in rows]
        probs: list[list[torch.Tensor]] = [[] for _ in rows]  # per row: one [V] row per drafted token
        fed = [b for b, row in enumerate(rows) if row.k == 0]
        while True:
            active = [b for b, row in enumerate(rows) if len(drafted[b]) < row.k]
            if not active and not fed:
                break
            passed = sorted(active + fed)
            logits = self.runner.logits_for_batch([ForwardRow(rows[b].request_id, seqs[b], 1) for b in passed])
            fed = []
            for b, row_logits in zip(passed, logits, strict=True):
                if b not in active:
                    continue
                params = rows[b].params
                token, q = draw_token(row_logits[0], params, len(seqs[b]), self.max_support, seqs[b])
                if q is not None:
                    probs[b].append(q)
                drafted[b].append(token)
                seqs[b].append(token)
        return [Proposal(tokens=d, probs=torch.stack(p) if p else None) for d, p in zip(drafted, probs, strict=True)]

    def release(self, request_id: str) -> None:
        self.runner.release(request_id)
