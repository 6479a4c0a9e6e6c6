"""A target worker: verifies drafted tokens for many requests, keeping each request's target KV cache."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specserve.workers.config import SamplingParams
from specserve.workers.runtime.worker_state import CommittedTokens, check_token_ids, run_calls
from specserve.workers.speculation.sampling import TARGET_SALT, make_generator
from specserve.workers.speculation.target import TargetVerifier


@dataclass
class VerifyResult:
    accepted: int
    next_token: int  # recovered (accepted < len(drafted)) or bonus
    compute_seconds: float  # of the whole batch the call ran in
    batch_rows: int
    batch_tokens: int  # positions the batch's forward pass fed


@dataclass
class VerifyCall:
    """One request's verification, as the KV state protocol delivers it."""

    request_id: str
    committed_len: int
    new_tokens: list[int]
    drafted: list[int]
    draft_probs: torch.Tensor | None  # [len(drafted), V] as decoded from the wire, None = one-hot
    params: SamplingParams


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
        draft_probs: torch.Tensor | None,
        params: SamplingParams,
    ) -> tuple[int, int, float]:
        """(accepted, next_token, compute seconds). Raises RequestNotFoundError (re-send the committed sequence)."""
        call = VerifyCall(request_id, committed_len, list(new_tokens), list(drafted), draft_probs, params)
        result = self.verify_batch([call])[0]
        if isinstance(result, Exception):
            raise result
        return result.accepted, result.next_token, result.compute_seconds

    def verify_batch(self, calls: Sequence[VerifyCall]) -> list[VerifyResult | Exception]:
        """Verify many requests in one target forward pass. Each call gets its own result or its own error (bad
        input, lost request, no KV room), never another row's. Request ids must be distinct."""
        t0 = time.perf_counter()
        fed = self.verifier.runner.forward_positions

        def prepare(call: VerifyCall):
            check_token_ids("new_tokens", call.new_tokens, self.vocab_size)
            check_token_ids("drafted", call.drafted, self.vocab_size)
            tokens = self.committed.advance(call.request_id, call.committed_len, call.new_tokens)
            generator = make_generator(call.params.seed, TARGET_SALT, len(tokens))
            return call.request_id, tokens, call.drafted, call.draft_probs, call.params, generator

        results, rows = run_calls(self.committed, calls, prepare, self.verifier.verify_batch, self.release)
        seconds, tokens = time.perf_counter() - t0, self.verifier.runner.forward_positions - fed
        return [r if isinstance(r, Exception) else VerifyResult(*r, seconds, rows, tokens) for r in results]

    def release(self, request_id: str) -> bool:
        self.verifier.release(request_id)
        return self.committed.release(request_id)

    def health(self) -> dict:
        store = self.verifier.runner.store
        failed = getattr(self.verifier.runner, "failed", None)  # a tensor-parallel replica that lost a rank
        return {
            "healthy": failed is None,
            "requests": len(self.committed),
            "kv_used_tokens": store.used_tokens,
            "kv_capacity_tokens": store.capacity_tokens,
            "model": self.model_name,
        }
