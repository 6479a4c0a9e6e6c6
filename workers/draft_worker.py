"""A draft worker: proposes tokens for many requests, keeping each request's draft KV cache between rounds."""

from __future__ import annotations

import time
from collections.abc import Sequence

from specserve.workers.codec import encode_probs
from specserve.workers.config import SamplingParams
from specserve.workers.drafters import Drafter
from specserve.workers.kv_cache import KVCacheStore
from specserve.workers.worker_state import CommittedTokens, check_token_ids, with_eviction


class DraftWorker:
    def __init__(self, drafter: Drafter, vocab_size: int, model_name: str, store: KVCacheStore | None = None):
        self.drafter = drafter
        self.vocab_size = vocab_size
        self.model_name = model_name
        self.store = store  # the drafter's KV store, for capacity reports (None for n-gram drafting)
        self.committed = CommittedTokens()

    def propose(
        self, request_id: str, committed_len: int, new_tokens: Sequence[int], k: int, params: SamplingParams
    ) -> tuple[list[int], bytes, float]:
        """(drafted tokens, encoded draft weights, compute seconds). Raises RequestNotFoundError (re-send)."""
        t0 = time.perf_counter()
        check_token_ids("new_tokens", new_tokens, self.vocab_size)
        tokens = self.committed.advance(request_id, committed_len, new_tokens)
        proposal = with_eviction(
            self.committed,
            request_id,
            lambda: self.drafter.propose(request_id, tokens, k, params),
            self.release,
        )
        return proposal.tokens, encode_probs(proposal.probs), time.perf_counter() - t0

    def release(self, request_id: str) -> bool:
        self.drafter.release(request_id)
        return self.committed.release(request_id)

    def health(self) -> dict:
        return {
            "healthy": True,
            "requests": len(self.committed),
            "kv_used_tokens": self.store.used_tokens if self.store is not None else 0,
            "kv_capacity_tokens": self.store.capacity_tokens if self.store is not None else 0,
            "model": self.model_name,
        }
