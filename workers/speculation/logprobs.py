"""Log-probabilities of the tokens a round commits, read off the verify forward that already ran (no extra forward).

Which distribution: the target model's own, log_softmax of its raw logits, before temperature, top-k and top-p (and
any penalty): vLLM's default `logprobs_mode` ("raw_logprobs") and what OpenAI's API reports. A committed token's
logprob is then the same whether a drafter proposed it and the target accepted it, or target-only decoding produced
it: either way it is the target's distribution after the same prefix (equal up to the floating-point rounding of a
wider forward; the tests hold them to 1e-4 in float32).

Per committed token: its own logprob and the `n` most likely tokens at its position with theirs, most likely first
(n = the request's `SamplingParams.logprobs`, 0..MAX_LOGPROBS). Only requests that ask pay anything. On the wire
(`VerifyResponse.logprobs`, `GenerateResponse.logprobs`): the protos' `Logprobs`, packed float32 / int32 columns
aligned with the message's tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from specserve.protos import specserve_pb2 as pb

if TYPE_CHECKING:
    import torch

MAX_LOGPROBS = 20  # OpenAI's top_logprobs bound


@dataclass(frozen=True)
class TokenLogprob:
    """One committed token's logprob and the top alternatives at its position, (token id, logprob), most likely
    first. The token itself is the one at the same index in the tokens it travels with."""

    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def token_logprobs(logits: torch.Tensor, tokens: Sequence[int], top: int) -> list[TokenLogprob]:
    """logits [m, V]: the target's logits at the positions the m committed `tokens` were chosen at -> their
    TokenLogprobs with the `top` most likely alternatives each. (The target's: torch is imported here, so the
    scheduler and the edges, which carry TokenLogprobs, never load it.)"""
    import torch

    logp = torch.log_softmax(logits.float(), dim=-1)  # [m, V]
    index = torch.tensor(list(tokens), dtype=torch.long, device=logp.device).unsqueeze(1)  # [m, 1]
    own = logp.gather(1, index).squeeze(1).tolist()  # [m]
    if not top:
        return [TokenLogprob(value) for value in own]
    values, ids = torch.topk(logp, min(top, logp.shape[-1]), dim=-1)  # [m, top]
    return [
        TokenLogprob(value, tuple(zip(row_ids, row_values, strict=True)))
        for value, row_ids, row_values in zip(own, ids.tolist(), values.tolist(), strict=True)
    ]


def to_proto(logprobs: Sequence[TokenLogprob]) -> pb.Logprobs:
    """The wire form: each token's logprob, then every token's top alternatives, row-major."""
    return pb.Logprobs(
        token_logprobs=[t.logprob for t in logprobs],
        top_token_ids=[token for t in logprobs for token, _ in t.top],
        top_logprobs=[value for t in logprobs for _, value in t.top],
    )


def from_proto(msg: pb.Logprobs) -> list[TokenLogprob]:
    """`to_proto`'s inverse; ValueError when the columns do not line up."""
    rows = len(msg.token_logprobs)
    tops = len(msg.top_token_ids)
    if len(msg.top_logprobs) != tops or (tops and (not rows or tops % rows)):
        raise ValueError(f"logprobs of {rows} tokens with {tops} top ids and {len(msg.top_logprobs)} top values")
    n = tops // rows if rows else 0
    ids, values = list(msg.top_token_ids), list(msg.top_logprobs)
    return [
        TokenLogprob(value, tuple(zip(ids[i * n : (i + 1) * n], values[i * n : (i + 1) * n], strict=True)))
        for i, value in enumerate(msg.token_logprobs)
    ]
