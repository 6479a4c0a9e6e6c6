"""A verify call's result, the same type on both ends of the gRPC hop (torch-free): the target worker returns one per
call and the scheduler's TargetClient (cluster/scheduling/worker_clients.py) hands the same back from the
VerifyResponse."""

from __future__ import annotations

from dataclasses import dataclass

from specserve.workers.speculation.logprobs import TokenLogprob


@dataclass(frozen=True)
class VerifyResult:
    """One call's verification: the round commits the accepted drafted tokens (a tree: its path), then next_token."""

    accepted: int
    next_token: int  # recovered (accepted < len(drafted)) or bonus
    batch_seconds: float = 0.0  # of the whole batch the call ran in (set once the batch is done)
    batch_rows: int = 0  # requests in that batch
    batch_tokens: int = 0  # positions the batch's forward pass fed
    features: bytes = b""  # EAGLE-3: the committed positions' features (codec.encode_features), when the call asked
    path: list[int] | None = None  # a tree's accepted nodes, root-down; a chain: None ([] off the wire)
    logprobs: list[TokenLogprob] | None = None  # the accepted tokens' and next_token's, when params.logprobs asks
