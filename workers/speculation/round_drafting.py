"""What the in-process engine drafts each round, per request: a chain, whose and how long the goodput planner
says (`ChainRounds`: an EAGLE-3 head, prompt lookup, a draft model, or the head or the lookup), or a draft tree, the
head's or prompt lookup's (`TreeRounds`)."""

from __future__ import annotations

from specserve.workers.config.request import SamplingParams
from specserve.workers.speculation.draft_tree import DraftTree, TreeShape
from specserve.workers.speculation.drafter import Drafter, Proposal
from specserve.workers.speculation.eagle.drafter import EagleDrafter
from specserve.workers.speculation.ngram import NgramDrafter
from specserve.workers.speculation.planner.chain import LOOKUP_SOURCES, ChainPlanner
from specserve.workers.speculation.planner.costs import VerifyCosts
from specserve.workers.speculation.planner.goodput import ChainPlan
from specserve.workers.speculation.planner.tree import TreePruning
from specserve.workers.speculation.request import RequestState


class ChainRounds:
    """Each round the planner's chain: prompt lookup's continuation (no model), or `model`'s (the head or a draft
    model) drafted here; none when nothing pays (k = 'auto') or nothing matches. `model` gets nothing on a round it
    does not draft: the engine keeps a head's features current every round, and a draft model's cache catches up by
    token comparison on its next call."""

    def __init__(self, model: Drafter | None, planner: ChainPlanner, k: int | None, max_k: int):
        self.drafter = model
        self.planner = planner
        self.k, self.max_k = k, max_k  # k None: 'auto'
        self._plan: ChainPlan | None = None

    def propose(self, state: RequestState, params: SamplingParams) -> Proposal | None:
        plan = self.planner.plan(state.tokens, self.k, state.draft_budget(self.k or self.max_k))
        self._plan = plan
        if plan.source in LOOKUP_SOURCES:  # prompt lookup's or suffix drafting's continuation: no model
            return Proposal(tokens=list(plan.tokens), probs=None)
        if plan.k:
            return self.drafter.propose(state.request_id, state.tokens, plan.k, params)
        return None

    def observe(self, drafted: int, accepted: int) -> None:
        if self._plan is not None and drafted:
            self.planner.observe(ChainPlan(self._plan.source, drafted, self._plan.tokens, self._plan.match), accepted)


class TreeRounds:
    """A tree each round, the head's (EAGLE-2's dynamic tree) or prompt lookup's (every recent match's continuation):
    up to `shape.budget` nodes; with `verify` costs (k = 'auto'), the best nodes of it that pay for their
    verification (planner/tree.py), none when none does. No tree for a round that can commit one token only."""

    def __init__(self, drafter: EagleDrafter | NgramDrafter, shape: TreeShape, verify: VerifyCosts | None = None):
        self.drafter = drafter
        self.shape = shape
        costly = not isinstance(drafter, NgramDrafter)
        self.pruning = TreePruning(verify, costly=costly) if verify is not None else None

    def propose_tree(self, state: RequestState) -> DraftTree | None:
        if not state.draft_budget(1) or self.pruning is not None and not self.pruning.wants_tree():
            return None
        tree = self.drafter.propose_tree(state.request_id, state.tokens, self.shape)
        if tree is None or self.pruning is None:
            return tree
        return self.pruning.prune(tree)

    def observe(self, accepted: int) -> None:
        """The verified tree's accepted nodes."""
        if self.pruning is not None:
            self.pruning.observe(accepted)
