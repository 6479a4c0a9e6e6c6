"""Verification of drafted tokens against the target: pure tensor functions, no I/O.

Vocabulary used everywhere in specserve (code, protos, stats, docs):

- **drafted**: the k tokens the drafter proposed for a round.
- **accepted**: the leading drafted tokens the target keeps (0..k of them). Greedy: each equals the target's argmax.
  Sampling: drafted token x at position i survives with probability min(1, p_i(x) / q_i(x)).
- **recovered** token: when drafted token i+1 is rejected, the token committed in its place, drawn from
  norm(max(0, p_i - q_i)) (greedy: the target's argmax at that position).
- **bonus** token: when all k drafted tokens are accepted, the extra token drawn from the target's distribution
  p_k at the position after them, which the same verification forward pass computed for free.

Every round therefore commits `accepted + 1` tokens: the accepted ones, then one recovered or bonus token.
Together they are distributed exactly as target-only sampling (Leviathan et al. 2023; Chen et al. 2023).

Shapes: B = rows (requests), k = drafted tokens per row, V = vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specserve.workers.speculation.sampling import sample_with_noise


@dataclass(frozen=True)
class VerifyOutput:
    accepted: torch.Tensor  # [B] int64 in 0..k
    next_token: torch.Tensor  # [B] int64: the recovered token (accepted < k) or the bonus token (== k)


def _first_rejection(accept: torch.Tensor) -> torch.Tensor:
    """accept: [B, k] bool -> number of leading True per row: [B] int64."""
    if accept.shape[1] == 0:
        return torch.zeros(accept.shape[0], dtype=torch.long, device=accept.device)
    return accept.long().cumprod(dim=1).sum(dim=1)


def greedy_verify(drafted: torch.Tensor, target_argmax: torch.Tensor) -> VerifyOutput:
    """Greedy verification: accept the longest prefix of the draft that matches the target's argmax.

    drafted: [B, k] int64, the drafted tokens
    target_argmax: [B, k + 1] int64; target_argmax[:, i] is the target's choice after drafted token i (i = 0: after
        the last committed token)
    The next token is target_argmax at the first mismatch (recovered) or at position k (bonus).
    """
    k = drafted.shape[1]
    accepted = _first_rejection(drafted == target_argmax[:, :k])  # [B]
    next_token = target_argmax.gather(1, accepted.unsqueeze(1)).squeeze(1)  # [B]
    return VerifyOutput(accepted=accepted, next_token=next_token)


def rejection_verify(
    drafted: torch.Tensor,
    draft_probs: torch.Tensor,
    target_probs: torch.Tensor,
    uniform: torch.Tensor,
    exp_noise: torch.Tensor,
) -> VerifyOutput:
    """Speculative (rejection) sampling.

    drafted:      [B, k] int64, drawn from draft_probs
    draft_probs:  [B, k, V] q_i, the distribution each drafted token was drawn from (one-hot for deterministic
        drafters such as n-gram lookup)
    target_probs: [B, k + 1, V] p_i, the target's distribution at each drafted position plus the bonus position
    uniform:      [B, k] U[0, 1) noise for the acceptance tests
    exp_noise:    [B, V] Exp(1) noise for drawing the one recovered or bonus token
    """
    B, k = drafted.shape
    idx = drafted.unsqueeze(-1)  # [B, k, 1]
    p_x = target_probs[:, :k].gather(-1, idx).squeeze(-1)  # [B, k]
    q_x = draft_probs.gather(-1, idx).squeeze(-1)  # [B, k]
    # u < p/q  <=>  u * q < p; avoids dividing by q == 0 (a token the draft could not have drawn is rejected).
    accept = (uniform * q_x < p_x) & (q_x > 0)  # [B, k]
    accepted = _first_rejection(accept)  # [B]

    # Distribution of the next token: the residual at the first rejected position, or p_k when all were accepted.
    rows = torch.arange(B, device=drafted.device)
    p_next = target_probs[rows, accepted]  # [B, V]
    q_next = torch.zeros_like(p_next)
    rejected = accepted < k  # [B]
    if k > 0 and bool(rejected.any()):
        q_next[rejected] = draft_probs[rows[rejected], accepted[rejected]]
    residual = (p_next - q_next).clamp_min(0.0)  # [B, V]; equals p_next for bonus rows
    mass = residual.sum(-1, keepdim=True)  # [B, 1]
    # mass == 0 only when p == q exactly (then rejection had probability 0); fall back to p so rounding cannot stall.
    residual = torch.where(mass > 0, residual / mass.clamp_min(1e-30), p_next)
    next_token = sample_with_noise(residual, exp_noise)  # [B]
    return VerifyOutput(accepted=accepted, next_token=next_token)
