"""What a worker call returns, the same type on both ends of its gRPC hop (torch-free): a draft worker returns a
ProposeResult per call and the scheduler's DraftClient (cluster/scheduling/worker_clients.py) hands the same back
from the ProposeResponse; a target worker returns a VerifyResult and TargetClient hands the same back from the
VerifyResponse. The scheduler keeps every round's drafted chain as a ProposeResult, also those no worker sent
(prompt lookup's continuation, the rest of a pre-draft)."""

from __future__ import annotations

from dataclasses import dataclass

from specserve.workers.speculation.draft_tree import DraftTree
from specserve.workers.speculation.logprobs import TokenLogprob


@dataclass(frozen=True)
class ProposeResult:
    """One call's proposal: a chain, or with `parents` a tree (DraftTree's fields; `tree()` gives it back)."""

    drafted: list[int]  # a chain's 0..k tokens or a tree's nodes, in depth order (none: a plain target step)
    draft_probs: bytes = b""  # encoded draft distributions (codec.encode_probs); empty: one-hot (greedy, lookup, trees)
    batch_seconds: float = 0.0  # of the whole batch the call ran in (set once the batch is done; 0: no worker drafted)
    queued_seconds: float = 0.0  # from the call's arrival at the worker's batcher to its batch's start
    parents: list[int] | None = None  # a tree: each node's parent (ROOT or an earlier node); a chain: None
    scores: list[float] | None = None  # a tree: each node's path log-probability under the head; a chain: None

    @classmethod
    def of_tree(cls, tree: DraftTree) -> ProposeResult:
        """A drafted tree as a call's proposal (no draft probs: a tree is verified as one-hot)."""
        return cls(list(tree.tokens), parents=list(tree.parents), scores=list(tree.scores))

    def tree(self) -> DraftTree:
        """A tree call's proposal as the tree it is (no nodes: the head had no features to draft from)."""
        return DraftTree(list(self.drafted), list(self.parents or []), list(self.scores or []))


@dataclass(frozen=True)
class VerifyResult:
    """One call's verification: the round commits the accepted drafted tokens (a tree: its path), then next_token."""

    accepted: int
    next_token: int  # recovered (accepted < len(drafted)) or bonus
    batch_seconds: float = 0.0  # of the whole batch the call ran in (set once the batch is done)
    batch_rows: int = 0  # requests in that batch
    batch_tokens: int = 0  # positions the batch's forward pass fed
    queued_seconds: float = 0.0  # from the call's arrival at the worker's batcher to its batch's start
    batch_forward_seconds: float = 0.0  # of batch_seconds, the forward pass's host time (a GPU: its launches)
    features: bytes = b""  # EAGLE-3: the committed positions' features (codec.encode_features), when the call asked
    path: list[int] | None = None  # a tree's accepted nodes, root-down; a chain: None ([] off the wire)
    logprobs: list[TokenLogprob] | None = None  # the accepted tokens' and next_token's, when params.logprobs asks
    prompt_logprobs: list[TokenLogprob] | None = None  # committed tokens 1..'s (the prompt's) with ranks, when asked
