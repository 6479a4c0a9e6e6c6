"""A target worker: verifies drafted tokens for many requests, keeping each request's target KV cache."""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from specserve.workers.config import SamplingParams
from specserve.workers.sampling import TARGET_SALT, make_generator
from specserve.workers.target import TargetVerifier
from specserve.workers.worker_state import CommittedTokens, check_token_ids, with_eviction


class TargetWorker:
    def __init__(self, verifier: TargetVerifier, model_name: str):
        self.verifier = verifier
        self.model_name = model_name
        self.committed = CommittedTokens()

    @property
    def vocab_size(self) -> int:
        return self.verifier.vocab_size

    def verify(
        self,
        request_id: str,
        committed_len: int,
        new_tokens: Sequence[int],
        drafted: Sequence[int],
        draft_weights: torch.Tensor | None,
        params: SamplingParams,
    ) -> tuple[int, int, float]:
        """(accepted, next_token, compute seconds). Raises RequestNotFoundError (re-send the committed sequence)."""
        t0 = time.perf_counter()
        check_token_ids("new_tokens", new_tokens, self.vocab_size)
        check_token_ids("drafted", drafted, self.vocab_size)
        tokens = self.committed.advance(request_id, committed_len, new_tokens)
        generator = make_generator(params.seed, TARGET_SALT, len(tokens))
        accepted, next_token = with_eviction(
            self.committed,
            request_id,
            lambda: self.verifier.verify(request_id, tokens, list(drafted), draft_weights, params, generator),
            self.release,
        )
        return accepted, next_token, time.perf_counter() - t0

    def prefill(self, request_id: str, tokens: Sequence[int]) -> int:
        """Cache all but the last token of a committed sequence (the first verify feeds the last one)."""
        check_token_ids("tokens", tokens, self.vocab_size)
        seq = self.committed.advance(request_id, len(tokens), tokens)
        if len(seq) > 1:
            with_eviction(
                self.committed,
                request_id,
                lambda: self.verifier.runner.logits_for(request_id, seq[:-1], 1),
                self.release,
            )
        return self.verifier.runner.store.get(request_id).length if len(seq) > 1 else 0

    def release(self, request_id: str) -> bool:
        self.verifier.release(request_id)
        return self.committed.release(request_id)

    def health(self) -> dict:
        store = self.verifier.runner.store
        return {
            "healthy": True,
            "requests": len(self.committed),
            "kv_used_tokens": store.used_tokens,
            "kv_capacity_tokens": store.capacity_tokens,
            "model": self.model_name,
        }
