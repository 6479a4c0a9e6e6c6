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

A prompt's logprobs (vLLM's `prompt_logprobs`, completions' `echo` with `logprobs`) are the same values for the
prompt's tokens 1..P-1, read off the forward that prefills the prompt (the target keeps the logits of every position
for that call: `VerifyRequest.prompt_logprobs`), each with its rank, as vLLM reports them.
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
    rank: int = 0  # the token's rank at its position (1: the likeliest), where computed (a prompt's); 0: not


SLICE_ROWS = 256  # positions turned into logprobs at a time: a prompt's [P, V] log_softmax is never whole at once


def token_logprobs(logits: torch.Tensor, tokens: Sequence[int], top: int, ranks: bool = False) -> list[TokenLogprob]:
    """logits [m, V]: the target's logits at the positions the m committed `tokens` were chosen at -> their
    TokenLogprobs with the `top` most likely alternatives each, and with `ranks` each token's rank (1 + the tokens
    likelier than it). (The target's: torch is imported here, so the scheduler and the edges, which carry
    TokenLogprobs, never load it.)"""
    out: list[TokenLogprob] = []
    for start in range(0, len(tokens), SLICE_ROWS):
        end = start + SLICE_ROWS
        out += _slice_logprobs(logits[start:end], tokens[start:end], top, ranks)
    return out


def _slice_logprobs(logits: torch.Tensor, tokens: Sequence[int], top: int, ranks: bool) -> list[TokenLogprob]:
    import torch

    logp = torch.log_softmax(logits.float(), dim=-1)  # [m, V]
    index = torch.tensor(list(tokens), dtype=torch.long, device=logp.device).unsqueeze(1)  # [m, 1]
    own_t = logp.gather(1, index)  # [m, 1]
    own = own_t.squeeze(1).tolist()  # [m]
    rank = (logp > own_t).sum(dim=1).add(1).tolist() if ranks else [0] * len(own)  # [m]
    if not top:
        return [TokenLogprob(value, (), r) for value, r in zip(own, rank, strict=True)]
    values, ids = torch.topk(logp, min(top, logp.shape[-1]), dim=-1)  # [m, top]
    return [
        TokenLogprob(value, tuple(zip(row_ids, row_values, strict=True)), r)
        for value, row_ids, row_values, r in zip(own, ids.tolist(), values.tolist(), rank, strict=True)
    ]


def to_proto(logprobs: Sequence[TokenLogprob]) -> pb.Logprobs:
    """The wire form: each token's logprob, then every token's top alternatives, row-major."""
    return pb.Logprobs(
        token_logprobs=[t.logprob for t in logprobs],
        top_token_ids=[token for t in logprobs for token, _ in t.top],
        top_logprobs=[value for t in logprobs for _, value in t.top],
        ranks=[t.rank for t in logprobs] if logprobs and logprobs[0].rank else [],
    )


def from_proto(msg: pb.Logprobs) -> list[TokenLogprob]:
    """`to_proto`'s inverse; ValueError when the columns do not line up."""
    rows = len(msg.token_logprobs)
    tops = len(msg.top_token_ids)
    if len(msg.top_logprobs) != tops or (tops and (not rows or tops % rows)) or len(msg.ranks) not in (0, rows):
        raise ValueError(f"logprobs of {rows} tokens with {tops} top ids, {len(msg.top_logprobs)} top values and "
                         f"{len(msg.ranks)} ranks")  # fmt: skip
    n = tops // rows if rows else 0
    ids, values, ranks = list(msg.top_token_ids), list(msg.top_logprobs), list(msg.ranks) or [0] * rows
    return [
        TokenLogprob(value, tuple(zip(ids[i * n : (i + 1) * n], values[i * n : (i + 1) * n], strict=True)), ranks[i])
        for i, value in enumerate(msg.token_logprobs)
    ]
