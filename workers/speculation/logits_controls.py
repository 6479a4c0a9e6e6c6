"""Per-request logits controls, applied to the target's logits at every verified position: pure tensor functions, no
I/O. presence / frequency / repetition penalties, logit_bias and min_tokens (min_p is applied with temperature, in
sampling.logits_to_probs).

Each verified position sees the prefix that determines it: the committed tokens, then the drafted tokens on its path
(a chain's position j: drafted[:j]; a tree's node: its ancestors). So a penalty at drafted position j counts the tokens
drafted before j, exactly as target-only decoding would count them once they were committed, and the controlled
distribution at every position equals target-only decoding's with the same controls: speculation stays lossless.

Semantics are vLLM's (vllm/model_executor/layers/utils.py `apply_penalties`, the v1 sampler's order):
- logit_bias and min_tokens first (vLLM's non-argmax-invariant logits processors): bias added to its tokens; while
  fewer than min_tokens tokens are generated, the tokens that end the request are masked (-inf).
- then the penalties: repetition_penalty over the prompt's and the generated tokens (vLLM and transformers'
  RepetitionPenaltyLogitsProcessor: positive logits divided, negative ones multiplied); presence and frequency
  penalties over the generated tokens only (OpenAI's definition: logit - count * frequency - (count > 0) * presence).

Shapes: P = verified positions of one row (a chain's k + 1, a tree's N + 1), N = drafted tokens (nodes), V = vocabulary.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specserve.workers.config.request import SamplingParams


@dataclass(frozen=True)
class History:
    """What the controls count at each of a row's verified positions."""

    in_context: torch.Tensor  # [P, V] bool: the token occurs in the prompt or the generated tokens so far
    generated_counts: torch.Tensor  # [P, V] float32: occurrences among the generated tokens so far
    generated_len: torch.Tensor  # [P] int64: tokens generated before the position's token


def chain_ancestry(k: int, device=None) -> torch.Tensor:
    """[k + 1, k] bool: position p (after p drafted tokens) follows drafted token n when n < p."""
    positions = torch.arange(k + 1, device=device).unsqueeze(1)  # [k + 1, 1]
    return torch.arange(k, device=device).unsqueeze(0) < positions  # [k + 1, k]


def tree_ancestry(parents: Sequence[int], device=None) -> torch.Tensor:
    """[N + 1, N] bool for a tree (parents[i] < i, -1 the root): row 0 is the root's position (no node before it), row
    i + 1 the position after node i (node i and its ancestors before it)."""
    n = len(parents)
    rows = torch.zeros(n + 1, n, dtype=torch.bool, device=device)
    for i, parent in enumerate(parents):
        rows[i + 1] = rows[parent + 1]  # the parent's ancestors (the root's row is empty)
        rows[i + 1, i] = True
    return rows


def history(
    committed: Sequence[int], prompt_len: int, drafted: torch.Tensor, ancestry: torch.Tensor, vocab: int
) -> History:
    """The history at each verified position of one row.

    committed: the request's committed tokens (prompt, then generated); prompt_len: how many are the prompt's
    drafted: [N] int64; ancestry: [P, N] bool (chain_ancestry / tree_ancestry): the drafted tokens before position p
    """
    device = ancestry.device
    tokens = torch.as_tensor(list(committed), dtype=torch.long, device=device)  # [L]
    prompt_len = min(prompt_len, tokens.numel())
    base = torch.bincount(tokens[prompt_len:], minlength=vocab)[:vocab].float()  # [V]: generated tokens' counts
    prompt = torch.zeros(vocab, dtype=torch.bool, device=device)
    prompt[tokens[:prompt_len]] = True  # [V]
    positions = ancestry.shape[0]
    drafted_counts = torch.zeros(positions, vocab, device=device)  # [P, V]
    if drafted.numel():
        index = drafted.to(device).unsqueeze(0).expand(positions, -1)  # [P, N]
        drafted_counts.scatter_add_(1, index, ancestry.float())
    counts = base.unsqueeze(0) + drafted_counts  # [P, V]
    generated_len = (tokens.numel() - prompt_len) + ancestry.long().sum(1)  # [P]
    return History(prompt.unsqueeze(0) | (counts > 0), counts, generated_len)


def apply_controls(logits: torch.Tensor, params: SamplingParams, past: History) -> torch.Tensor:
    """logits: [P, V] -> [P, V] float32 with logit_bias, min_tokens and the penalties applied (vLLM's order)."""
    logits = logits.float().clone()
    vocab = logits.shape[-1]
    if params.logit_bias:
        ids = torch.tensor(list(params.logit_bias), dtype=torch.long, device=logits.device)  # [B]
        bias = torch.tensor(list(params.logit_bias.values()), dtype=torch.float32, device=logits.device)  # [B]
        keep = ids < vocab  # a model whose logits are narrower than its tokenizer's vocabulary
        logits[:, ids[keep]] += bias[keep]
    if params.min_tokens and params.end_token_ids:
        early = past.generated_len < params.min_tokens  # [P]
        ends = torch.tensor([t for t in params.end_token_ids if t < vocab], dtype=torch.long, device=logits.device)
        mask = torch.zeros_like(logits, dtype=torch.bool)  # [P, V]
        mask[:, ends] = True
        logits = logits.masked_fill(mask & early.unsqueeze(1), float("-inf"))
    if params.repetition_penalty != 1.0:
        penalty = torch.where(past.in_context, params.repetition_penalty, 1.0)  # [P, V]
        logits = torch.where(logits > 0, logits / penalty, logits * penalty)
    # OpenAI's presence and frequency penalties count the generated tokens only (so does vLLM).
    if params.frequency_penalty:
        logits = logits - params.frequency_penalty * past.generated_counts
    if params.presence_penalty:
        logits = logits - params.presence_penalty * (past.generated_counts > 0).float()
    return logits


def controlled_logits(
    logits: torch.Tensor, params: SamplingParams, committed: Sequence[int], drafted: Sequence[int],
    parents: Sequence[int] | None = None,
) -> torch.Tensor:  # fmt: skip
    """One row's logits [P, V] with the request's controls applied at every position (unchanged without any): a chain
    of drafted tokens (P = len(drafted) + 1), or a tree with `parents` (P = len(parents) + 1)."""
    if not params.has_logits_controls:
        return logits
    device = logits.device
    ancestry = chain_ancestry(len(drafted), device) if parents is None else tree_ancestry(parents, device)
    tokens = torch.tensor(list(drafted), dtype=torch.long, device=device)  # [N]
    past = history(committed, params.prompt_len, tokens, ancestry, logits.shape[-1])
    return apply_controls(logits, params, past)


def min_p_filter(logits: torch.Tensor, min_p: float) -> torch.Tensor:
    """[..., V] -> [..., V]: tokens whose probability is below min_p times the likeliest's set to -inf (vLLM's and
    transformers' min-p; the likeliest token always survives)."""
    probs = torch.softmax(logits, dim=-1)
    threshold = probs.amax(-1, keepdim=True) * min_p  # [..., 1]
    return logits.masked_fill(probs < threshold, float("-inf"))
