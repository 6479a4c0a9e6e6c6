"""What the scheduler's worker clients hand back, one typed reply per hop (torch-free): a draft worker's chain
(`DraftReply`; a tree comes back as a `DraftTree`) and a target worker's verification (`VerifyReply`). The calls that
go out are the scheduler's `Call`s (scheduler.py)."""

from __future__ import annotations

from typing import NamedTuple

from specserve.workers.speculation.logprobs import TokenLogprob


class DraftReply(NamedTuple):
    """A round's drafted chain: from a draft worker, prompt lookup or the rest of a pre-draft."""

    drafted: list[int]  # 0..k tokens (none: the round is a plain target step)
    draft_probs: bytes = b""  # their draft distributions (codec.encode_probs); empty: one-hot (greedy, lookup)


class VerifyReply(NamedTuple):
    accepted: int
    next_token: int  # recovered or bonus
    batch_rows: int  # requests in the target batch this call ran in
    batch_tokens: int  # positions that batch fed
    batch_seconds: float
    features: bytes = b""  # EAGLE-3: the committed positions' features, when the call asked (encoded)
    path: tuple[int, ...] = ()  # a tree's accepted nodes, root-down
    logprobs: tuple[TokenLogprob, ...] | None = None  # the accepted tokens' and next_token's, when params ask
