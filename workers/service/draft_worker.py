"""A draft worker: proposes tokens for many requests, keeping each request's draft KV cache between rounds."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from specserve.workers.config import SamplingParams
from specserve.workers.runtime.kv_cache import KVCacheStore
from specserve.workers.runtime.worker_state import CommittedTokens, check_token_ids, run_calls
from specserve.workers.speculation.codec import encode_probs
from specserve.workers.speculation.drafters import Drafter


@dataclass
class ProposeCall:
    """One request's drafting, as the KV state protocol delivers it."""

    request_id: str
    committed_len: int
    new_tokens: list[int]
    k: int
    params: SamplingParams


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
        """(drafted tokens, encoded draft probs, compute seconds). Raises RequestNotFoundError (re-send)."""
        result = self.propose_batch([ProposeCall(request_id, committed_len, list(new_tokens), k, params)])[0]
        if isinstance(result, Exception):
            raise result
        return result

    def propose_batch(self, calls: Sequence[ProposeCall]) -> list[tuple[list[int], bytes, float] | Exception]:
        """Draft for many requests at once (one draft forward pass per step); each call gets its own result or its
        own error. Request ids must be distinct."""
        t0 = time.perf_counter()

        def prepare(call: ProposeCall):
            check_token_ids("new_tokens", call.new_tokens, self.vocab_size)
            tokens = self.committed.advance(call.request_id, call.committed_len, call.new_tokens)
            return call.request_id, tokens, call.k, call.params

        results, _ = run_calls(self.committed, calls, prepare, self.drafter.propose_batch, self.release)
        seconds = time.perf_counter() - t0
        return [r if isinstance(r, Exception) else (r.tokens, encode_probs(r.probs), seconds) for r in results]

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
