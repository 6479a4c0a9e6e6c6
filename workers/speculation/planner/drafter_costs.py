"""Timing a drafter where it runs, for the goodput planner (chain_policy.DraftCost): an EAGLE-3 head's fixed cost per
propose call (bringing the head's cache up to date, the first step) plus a cost per further chained step; a draft
model's cached step per drafted token. The in-process engine and the draft worker both measure with `drafter_cost`."""

from __future__ import annotations

import time
import uuid

import torch

from specserve.workers.config.request import SamplingParams
from specserve.workers.runtime.cost_probe import probe_context, probe_tokens, verify_seconds
from specserve.workers.speculation.draft_model import ModelDrafter
from specserve.workers.speculation.drafter import Drafter
from specserve.workers.speculation.eagle.drafter import EagleDrafter
from specserve.workers.speculation.planner.costs import DraftCost


def drafter_cost(drafter: Drafter, k: int) -> DraftCost | None:
    """A head's or a draft model's cost of up to k drafts after a chat-sized context; None for prompt lookup (free)."""
    if isinstance(drafter, EagleDrafter):
        return head_cost(drafter, probe_context(drafter.head.config.max_position_embeddings, k + 1), k)
    if isinstance(drafter, ModelDrafter):
        context = probe_context(drafter.runner.loaded.max_positions, k + 1)
        return DraftCost(step_s=verify_seconds(drafter.runner, context, 1)[0])
    return None


def head_cost(eagle: EagleDrafter, context: int, k: int, reps: int = 3) -> DraftCost:
    """Fit t(k) = fixed + k step from the fastest of `reps` proposals of 1 and of k tokens after `context` tokens
    (each after one new committed position, as in decoding)."""
    params = SamplingParams(max_new_tokens=1, temperature=0.0)
    request_id = f"cost-probe-{uuid.uuid4().hex}"
    tokens = probe_tokens(context + reps * 2 + 2, eagle.head.config.vocab_size)
    features = torch.zeros(len(tokens), 3 * eagle.head.config.target_hidden_size)
    seconds: dict[int, list[float]] = {1: [], k: []}
    try:
        eagle.add_features(request_id, 0, features[:context])
        eagle.propose(request_id, tokens[: context + 1], 1, params)
        for i in range(reps * 2):
            end = context + i + 1
            eagle.add_features(request_id, end - 1, features[end - 1 : end])
            n = 1 if i % 2 else k
            t0 = time.perf_counter()
            eagle.propose(request_id, tokens[: end + 1], n, params)
            seconds[n].append(time.perf_counter() - t0)
    finally:
        eagle.release(request_id)
    one, many = min(seconds[1]), min(seconds[k])
    step = max(0.0, (many - one) / (k - 1)) if k > 1 else 0.0
    return DraftCost(step_s=step, fixed_s=max(0.0, one - step))
