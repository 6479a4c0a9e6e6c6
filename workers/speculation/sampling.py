"""Logits -> probabilities (temperature, top-k, top-p) and noise-driven sampling. Pure functions, no I/O.

Randomness enters only as explicit noise tensors drawn on the CPU from per-request generators, so every function here is
deterministic given its inputs and a seeded request is reproducible no matter what else shares its batch.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specserve.workers.config.request import SamplingParams
from specserve.workers.speculation.codec import sparsify
from specserve.workers.speculation.logits_controls import controlled_logits, min_p_filter


def logits_to_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Turn logits into the distribution a request samples from.

    logits: [..., V] -> probs: [..., V] (float32, rows sum to 1). Greedy (temperature 0) is a one-hot of the argmax,
    so greedy and sampled requests flow through the same verification code. The request's penalties, logit_bias and
    min_tokens are applied before this, to the logits of each position (logits_controls.controlled_logits).
    """
    logits = logits.float()
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    logits = logits / params.temperature
    if params.min_p > 0.0:  # before top-k and top-p, as vLLM's sampler
        logits = min_p_filter(logits, params.min_p)
    if params.top_k > 0 and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]  # [..., 1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        probs = _top_p_filter(probs, params.top_p)
    return probs


def _top_p_filter(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose mass reaches top_p; renormalise. [..., V] -> [..., V]"""
    sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
    mass_before = sorted_probs.cumsum(-1) - sorted_probs  # mass strictly above each token
    sorted_probs = sorted_probs.masked_fill(mass_before >= top_p, 0.0)  # the top token always survives
    filtered = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
    return filtered / filtered.sum(-1, keepdim=True)


DRAFT_SALT, TARGET_SALT = 1, 2  # independent noise streams of one seed


def make_generator(seed: int | None, salt: int = 0, position: int = 0) -> torch.Generator:
    """A CPU generator for one round of one request (noise is drawn on the CPU, so seeds reproduce across devices).

    `salt` separates independent streams (draft vs target) of the same seed; `position` (the committed length when
    the round starts) makes each round's noise a function of where it is, not of how many calls came before, so a
    retried, re-routed or pre-drafted round draws the same noise in any process."""
    g = torch.Generator()
    if seed is None:
        g.seed()
    else:
        g.manual_seed((seed * 1_000_003 + salt * 7_919 + position * 104_729) % (2**63))
    return g


def exponential_noise(vocab: int, generators: Sequence[torch.Generator], device=None) -> torch.Tensor:
    """Exp(1) noise, one row per generator: [len(generators), vocab]. Used by `sample_with_noise`."""
    out = torch.empty(len(generators), vocab)
    for i, g in enumerate(generators):
        out[i].exponential_(generator=g)
    return out.to(device) if device is not None else out


def uniform_noise(cols: int, generators: Sequence[torch.Generator], device=None) -> torch.Tensor:
    """U[0, 1) noise, one row per generator: [len(generators), cols]. Used for acceptance tests."""
    out = torch.empty(len(generators), cols)
    for i, g in enumerate(generators):
        out[i].uniform_(generator=g)
    return out.to(device) if device is not None else out


def sample_with_noise(probs: torch.Tensor, exp_noise: torch.Tensor) -> torch.Tensor:
    """Sample one token per row: argmax(p / E) with E ~ Exp(1) is an exact draw from p.

    probs: [..., V], exp_noise: [..., V] -> tokens: [...] (int64)
    """
    return (probs / exp_noise).argmax(-1)


def sample(probs: torch.Tensor, generator: torch.Generator) -> int:
    """Draw one token from probs [V] with a request's generator."""
    noise = exponential_noise(probs.shape[-1], [generator], device=probs.device)
    return int(sample_with_noise(probs.reshape(1, -1), noise)[0])


def draw_token(
    logits: torch.Tensor, params: SamplingParams, position: int, max_support: int, before: Sequence[int] = ()
) -> tuple[int, torch.Tensor | None]:
    """logits: [V]. The drafted token at absolute `position`, and the draft probs it was drawn from (None: greedy):
    `sparsify` of the request's sampling distribution, so the target sees exactly what was sampled from.

    `before`: the tokens before `position` (committed, then drafted). Given, the request's logits controls (penalties,
    logit_bias, min_tokens) shape the draft as they will shape the target's distribution there: the drafter then
    proposes what the controlled target is likely to accept (under repetition_penalty 1.3 the head's uncontrolled
    chains kept 0.08 of their tokens, against 0.35 without the penalty). Exact either way: q is what was drawn from."""
    if before and params.has_logits_controls:
        logits = controlled_logits(logits.unsqueeze(0), params, before, [])[0]
    if params.greedy:
        return int(logits.argmax()), None
    q = sparsify(logits_to_probs(logits, params), max_support).cpu()  # [V]
    # Noise keyed by the drafted token's absolute position: a token drafted early (pipelined) or again (after a
    # restart) is drawn with the same noise, so seeded requests reproduce in every mode.
    generator = make_generator(params.seed, DRAFT_SALT, position)
    noise = exponential_noise(q.shape[-1], [generator])  # [1, V]
    return int(sample_with_noise(q.unsqueeze(0), noise)[0]), q
