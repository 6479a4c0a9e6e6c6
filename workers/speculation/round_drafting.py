"""What the in-process engine drafts each round, per request: one drafter with a fixed or adaptive k
(`DrafterRounds`), the chain planner over an EAGLE-3 head and n-gram lookup (`ChainRounds`), or a draft tree, the
head's or prompt lookup's (`TreeRounds`)."""

from __future__ import annotations

from specserve.workers.config import SamplingParams, SpecParams
from specserve.workers.speculation.adaptive_k import AdaptiveK
from specserve.workers.speculation.chain_planner import ChainPlan, ChainPlanner
from specserve.workers.speculation.chain_policy import VerifyCosts
from specserve.workers.speculation.draft_tree import DraftTree, TreeShape
from specserve.workers.speculation.drafters import Drafter, NgramDrafter, Proposal
from specserve.workers.speculation.eagle_drafter import EagleDrafter
from specserve.workers.speculation.request import RequestState
from specserve.workers.speculation.tree_policy import TreePruning


class DrafterRounds:
    """One drafter; k fixed, or AdaptiveK's (Leviathan's S(k) with an assumed cost ratio) for 'auto'."""

    def __init__(self, drafter: Drafter, spec: SpecParams, cost_ratio: float):
        self.drafter = drafter
        self.adaptive = AdaptiveK(cost_ratio=cost_ratio) if spec.k == "auto" else None
        self.k = self.adaptive.k if self.adaptive else spec.k

    def propose(self, state: RequestState, params: SamplingParams) -> Proposal | None:
        k = state.draft_budget(self.k)
        return self.drafter.propose(state.request_id, state.tokens, k, params) if k else None

    def observe(self, drafted: int, accepted: int) -> None:
        if self.adaptive is not None and drafted:
            self.k = self.adaptive.observe(drafted, accepted)


class ChainRounds:
    """The head's chain or the n-gram continuation, whichever the planner expects to pay more, each round."""

    def __init__(self, eagle: EagleDrafter, planner: ChainPlanner, k: int | None, max_k: int):
        self.drafter = eagle  # gets the target's features after every verify, whichever chain was drafted
        self.planner = planner
        self.k, self.max_k = k, max_k  # k None: 'auto'
        self._plan: ChainPlan | None = None

    def propose(self, state: RequestState, params: SamplingParams) -> Proposal | None:
        plan = self.planner.plan(state.tokens, self.k, state.draft_budget(self.k or self.max_k))
        self._plan = plan
        if plan.source == "ngram":
            return Proposal(tokens=list(plan.tokens), probs=None)
        if plan.source == "head":
            return self.drafter.propose(state.request_id, state.tokens, plan.k, params)
        return None

    def observe(self, drafted: int, accepted: int) -> None:
        if self._plan is not None and drafted:
            self.planner.observe(ChainPlan(self._plan.source, drafted, self._plan.tokens, self._plan.match), accepted)


class TreeRounds:
    """A tree each round, the head's (EAGLE-2's dynamic tree) or prompt lookup's (every recent match's continuation):
    up to `shape.budget` nodes; with `verify` costs (k = 'auto'), the best nodes of it that pay for their
    verification (tree_policy.py), none when none does. No tree for a round that can commit one token only."""

    def __init__(self, drafter: EagleDrafter | NgramDrafter, shape: TreeShape, verify: VerifyCosts | None = None):
        self.drafter = drafter
        self.shape = shape
        self.pruning = TreePruning(verify) if verify is not None else None

    def propose_tree(self, state: RequestState) -> DraftTree | None:
        if not state.draft_budget(1):
            return None
        tree = self.drafter.propose_tree(state.request_id, state.tokens, self.shape)
        if tree is None or self.pruning is None:
            return tree
        return self.pruning.prune(tree)

    def observe(self, accepted: int) -> None:
        """The verified tree's accepted nodes."""
        if self.pruning is not None:
            self.pruning.observe(accepted)
