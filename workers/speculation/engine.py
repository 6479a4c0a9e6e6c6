"""The in-process speculative engine: draft-then-verify rounds through the same interfaces the distributed workers
use (a Drafter, a TargetVerifier, RequestState), all in one process. Also the reference `--no-spec` path."""

from __future__ import annotations

import os
import uuid
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specserve.workers.config import KVCacheConfig, NgramConfig, SamplingParams, SpecParams
from specserve.workers.errors import InvalidRequestError
from specserve.workers.runtime.loading import LoadedModel, check_compatible
from specserve.workers.runtime.runner import ModelRunner
from specserve.workers.runtime.worker_state import check_token_ids
from specserve.workers.speculation.adaptive_k import AdaptiveK
from specserve.workers.speculation.drafters import Drafter, ModelDrafter, NgramDrafter, Proposal
from specserve.workers.speculation.eagle3 import Eagle3Head
from specserve.workers.speculation.eagle_drafter import EagleDrafter, load_eagle_drafter
from specserve.workers.speculation.request import FinishReason, RequestState, RequestStats
from specserve.workers.speculation.sampling import TARGET_SALT, make_generator
from specserve.workers.speculation.target import TargetVerifier


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]  # generated tokens only
    finish_reason: FinishReason
    stats: RequestStats

    def to_dict(self) -> dict:
        return {
            "text": self.text,
            "token_ids": self.token_ids,
            "finish_reason": self.finish_reason,
            "stats": self.stats.to_dict(),
        }


def encode_prompt(tokenizer, prompt: str | Sequence[int]) -> list[int]:
    if isinstance(prompt, str):
        if not prompt:
            raise InvalidRequestError("prompt", "must not be empty")
        ids = list(tokenizer(prompt)["input_ids"])
    else:
        ids = [int(t) for t in prompt]
    if not ids:
        raise InvalidRequestError("prompt", "encodes to no tokens")
    return ids


def check_request(prompt_ids: list[int], params: SamplingParams, vocab_size: int, max_positions: int | None) -> None:
    check_token_ids("prompt", prompt_ids, vocab_size)
    if max_positions is not None and len(prompt_ids) + params.max_new_tokens > max_positions:
        room = max_positions - len(prompt_ids)
        raise InvalidRequestError(
            "max_new_tokens",
            f"{params.max_new_tokens} new tokens after a {len(prompt_ids)}-token prompt exceed the model's context "
            f"of {max_positions} positions" + (f" (at most {room})" if room > 0 else " (the prompt alone fills it)"),
        )


class SpecEngine:
    """Generates with speculative decoding in one process."""

    def __init__(
        self,
        target: LoadedModel,
        draft: LoadedModel | None = None,
        kv_config: KVCacheConfig | None = None,
        ngram_config: NgramConfig | None = None,
        cost_ratio: float = 0.1,
        eagle_head: str | os.PathLike | Eagle3Head | None = None,
    ):
        """cost_ratio: the assumed c = t_draft / t_target used by k='auto'. A fixed number, not a live timing, so
        that a seeded request with k='auto' reproduces exactly. eagle_head: an EAGLE-3 head (directory or loaded)
        for method 'eagle'; the target's forward passes then also capture the features the head reads."""
        kv_config = kv_config or KVCacheConfig()
        self.target = target
        self.verifier = TargetVerifier(ModelRunner(target, kv_config))
        self.drafters: dict[str, Drafter] = {"ngram": NgramDrafter(ngram_config)}
        self.cost_ratio = cost_ratio
        if draft is not None:
            check_compatible(target, draft)
            self.drafters["draft"] = ModelDrafter(ModelRunner(draft, kv_config, vocab_size=self.verifier.vocab_size))
        if eagle_head is not None:
            eagle = load_eagle_drafter(target, eagle_head)
            self.verifier.runner.capture_features(eagle.feature_layers)
            self.drafters["eagle"] = eagle

    @property
    def tokenizer(self):
        return self.target.tokenizer

    def _drafter(self, spec: SpecParams) -> Drafter | None:
        if spec.method == "none":
            return None
        if spec.method not in self.drafters:
            needs = "an EAGLE-3 head (eagle_head)" if spec.method == "eagle" else "a draft model"
            raise InvalidRequestError("method", f"{spec.method!r} drafting needs {needs}, and none is loaded")
        return self.drafters[spec.method]

    def _verify(
        self,
        state: RequestState,
        drafter: Drafter | None,
        proposal: Proposal | None,
        params: SamplingParams,
        generator: torch.Generator,
    ) -> tuple[int, int]:
        """Verify this round's proposal (None: target-only); an EagleDrafter gets the target's new features."""
        drafted, probs = (proposal.tokens, proposal.probs) if proposal else ([], None)
        row = (state.request_id, state.tokens, drafted, probs, params, generator)
        if not isinstance(drafter, EagleDrafter):
            return self.verifier.verify(*row)
        verdict = self.verifier.verify_with_features([row])[0]
        drafter.add_features(state.request_id, verdict.feature_start, verdict.features)
        return verdict.num_accepted, verdict.next_token

    def generate(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams,
        spec: SpecParams,
        request_id: str | None = None,
    ) -> GenerationResult:
        drafter = self._drafter(spec)
        prompt_ids = encode_prompt(self.tokenizer, prompt)
        check_request(prompt_ids, params, self.verifier.vocab_size, self.target.max_positions)
        state = RequestState(
            request_id=request_id or uuid.uuid4().hex,
            tokens=list(prompt_ids),
            prompt_len=len(prompt_ids),
            max_new_tokens=params.max_new_tokens,
            eos_token_ids=frozenset(self.target.eos_token_ids) if params.stop_at_eos else frozenset(),
        )
        adaptive = AdaptiveK(cost_ratio=self.cost_ratio) if spec.k == "auto" else None
        k_next = adaptive.k if adaptive else spec.k
        try:
            while not state.finished:
                k = state.draft_budget(k_next) if drafter is not None else 0
                position = len(state.tokens)
                proposal = drafter.propose(state.request_id, state.tokens, k, params) if k else None
                drafted = proposal.tokens if proposal else []
                generator = make_generator(params.seed, TARGET_SALT, position)
                num_accepted, next_token = self._verify(state, drafter, proposal, params, generator)
                if adaptive is not None and drafted:
                    k_next = adaptive.observe(len(drafted), num_accepted)
                state.commit_round(drafted, num_accepted, next_token)
        finally:
            self.verifier.release(state.request_id)
            if drafter is not None:
                drafter.release(state.request_id)
        return GenerationResult(
            text=self.tokenizer.decode(state.generated, skip_special_tokens=True),
            token_ids=state.generated,
            finish_reason=state.finish_reason,
            stats=state.stats,
        )
