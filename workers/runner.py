"""A model bound to a KV-cache store: forward passes that reuse and roll back each request's cache."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specserve.workers.config import KVCacheConfig
from specserve.workers.kv_cache import KVCacheStore
from specserve.workers.loading import LoadedModel


class ModelRunner:
    """Runs one model for many requests, each with its own KV cache.

    The single primitive is `logits_for(request_id, sequence, n)`: the model's logits at the last n positions of
    `sequence`, computing only the positions the request's cache does not already hold. Rejected draft tokens left in
    a cache are detected by token comparison and rolled back before anything is fed on top of them.
    """

    def __init__(self, loaded: LoadedModel, kv_config: KVCacheConfig, vocab_size: int | None = None):
        self.loaded = loaded
        self.model = loaded.model
        self.device = loaded.device
        self.vocab_size = vocab_size or loaded.vocab_size  # logits are cut/padded to this width
        self.store = KVCacheStore(kv_config, bytes_per_token=loaded.kv_bytes_per_token)
        self.forward_calls = 0
        self.forward_positions = 0

    @torch.inference_mode()
    def logits_for(self, request_id: str, sequence: Sequence[int], n: int) -> torch.Tensor:
        """Logits predicting the token after each of the last n positions of `sequence`: [n, vocab_size] float32."""
        if not 1 <= n <= len(sequence):
            raise ValueError(f"need 1 <= n <= len(sequence), got n={n}, len={len(sequence)}")
        entry = self.store.sync(request_id, sequence, keep_at_most=len(sequence) - n)
        start = entry.length
        new = list(sequence[start:])
        self.store.reserve(request_id, len(new))
        input_ids = torch.tensor([new], dtype=torch.long, device=self.device)  # [1, T]
        positions = torch.arange(start, start + len(new), device=self.device).unsqueeze(0)  # [1, T]
        out = self.model(
            input_ids=input_ids,
            position_ids=positions,
            past_key_values=entry.cache,
            use_cache=True,
            logits_to_keep=n,
        )
        self.store.commit(request_id, new)
        self.forward_calls += 1
        self.forward_positions += len(new)
        return self._fit_vocab(out.logits[0, -n:].float())  # [n, V]

    def _fit_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """[n, V_model] -> [n, vocab_size]: drop padded rows, or pad with -inf (never sampled)."""
        v = logits.shape[-1]
        if v == self.vocab_size:
            return logits
        if v > self.vocab_size:
            return logits[:, : self.vocab_size]
        pad = logits.new_full((logits.shape[0], self.vocab_size - v), float("-inf"))
        return torch.cat([logits, pad], dim=-1)

    def release(self, request_id: str) -> bool:
        return self.store.release(request_id)
