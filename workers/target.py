"""The target side of a round: one forward pass over the drafted tokens, then verification."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specserve.workers.codec import normalise
from specserve.workers.config import SamplingParams
from specserve.workers.runner import ModelRunner
from specserve.workers.sampling import exponential_noise, logits_to_probs, uniform_noise
from specserve.workers.verification import greedy_verify, rejection_verify


class TargetVerifier:
    """Verifies proposals for requests whose caches live in `runner`."""

    def __init__(self, runner: ModelRunner):
        self.runner = runner

    @property
    def vocab_size(self) -> int:
        return self.runner.vocab_size

    def verify(
        self,
        request_id: str,
        tokens: Sequence[int],
        drafted: Sequence[int],
        draft_probs: torch.Tensor | None,
        params: SamplingParams,
        generator: torch.Generator,
    ) -> tuple[int, int]:
        """Verify `drafted` as the continuation of committed `tokens`. Returns (num_accepted, next_token).

        draft_probs: [len(drafted), V] weights of the distributions the drafted tokens were drawn from (normalised
        here), or None for one-hot
        (deterministic drafters, and greedy requests, where only the tokens matter).
        With nothing drafted this is plain target-only decoding: the next token is the bonus token from p.
        """
        k = len(drafted)
        logits = self.runner.logits_for(request_id, list(tokens) + list(drafted), k + 1)  # [k+1, V]
        draft_row = torch.tensor([list(drafted)], dtype=torch.long, device=logits.device)  # [1, k]
        if params.greedy:
            out = greedy_verify(draft_row, logits.argmax(-1).unsqueeze(0))
        else:
            V = logits.shape[-1]
            p = logits_to_probs(logits, params).unsqueeze(0)  # [1, k+1, V]
            if draft_probs is None:
                q = torch.nn.functional.one_hot(draft_row, V).float()  # [1, k, V]
            else:
                q = normalise(draft_probs.to(p.device, torch.float32)).unsqueeze(0)  # [1, k, V]
            uniform = uniform_noise(k, [generator], device=p.device)  # [1, k]
            noise = exponential_noise(V, [generator], device=p.device)  # [1, V]
            out = rejection_verify(draft_row, q, p, uniform, noise)
        return int(out.num_accepted[0]), int(out.next_token[0])

    def release(self, request_id: str) -> bool:
        return self.runner.release(request_id)
