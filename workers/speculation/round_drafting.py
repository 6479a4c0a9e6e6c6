"""What the in-process engine drafts each round, per request: a chain, whose and how long the goodput planner
says (`ChainRounds`: an EAGLE-3 head, prompt lookup, a draft model, or the head or the lookup), or a draft tree, the
head's or prompt lookup's (`TreeRounds`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from functools import partial

from specserve.workers.config.request import SamplingParams
from specserve.workers.speculation.draft_tree import DraftTree, TreeShape
from specserve.workers.speculation.drafter import Drafter, Proposal
from specserve.workers.speculation.eagle.drafter import EagleDrafter
from specserve.workers.speculation.ngram import NgramDrafter
from specserve.workers.speculation.planner.chain import ChainPlanner
from specserve.workers.speculation.planner.costs import VerifyCosts
from specserve.workers.speculation.planner.round_plan import PLAIN, RoundPlan
from specserve.workers.speculation.planner.tree import RoundOverhead, TreePruning, TreeYield, best_chain_length
from specserve.workers.speculation.request import RequestState


class ChainRounds:
    """Each round the planner's chain (`plan`): prompt lookup's continuation (no model), or `model`'s (the head or a
    draft model) drafted here (`propose`); none when nothing pays (k = 'auto') or nothing matches. `model` gets
    nothing on a round it does not draft: the engine keeps a head's features current every round, and a draft
    model's cache catches up by token comparison on its next call."""

    def __init__(self, model: Drafter | None, planner: ChainPlanner, k: int | None, max_k: int):
        self.drafter = model
        self.planner = planner
        self.k, self.max_k = k, max_k  # k None: 'auto'

    def plan(self, state: RequestState) -> RoundPlan:
        return self.planner.plan(state.tokens, self.k, state.draft_budget(self.k or self.max_k))

    def propose(self, state: RequestState, plan: RoundPlan, params: SamplingParams) -> Proposal | None:
        if plan.drafted:  # prompt lookup's or suffix drafting's continuation: no model
            return Proposal(tokens=list(plan.chain.tokens), probs=None)
        if plan.k:
            return self.drafter.propose(state.request_id, state.tokens, plan.k, params)
        return None

    def observe(self, plan: RoundPlan, drafted: int, accepted: int) -> None:
        if drafted:
            self.planner.observe(dataclasses.replace(plan.chain, k=drafted), accepted)


class TreeRounds:
    """A tree each round, the head's (EAGLE-2's dynamic tree) or prompt lookup's (every recent match's continuation):
    up to `shape.budget` nodes; with `verify` costs (k = 'auto'), the best nodes of it that pay for their
    verification (planner/tree.py), none when none does. No tree for a round that can commit one token only."""

    def __init__(self, drafter: EagleDrafter | NgramDrafter, shape: TreeShape, verify: VerifyCosts | None = None,
                 lookups: ChainPlanner | None = None, max_chain: int = 0):  # fmt: skip
        """lookups: a head's tree method's lookups (eagle-tree+ngram), whose continuation of up to max_chain tokens a
        round verifies instead of the head's tree where it is expected to accept more (ChainPlanner.lookup_round)."""
        self.drafter = drafter
        self.shape = shape
        costly = not isinstance(drafter, NgramDrafter)
        self.pruning = TreePruning(verify, costly=costly) if verify is not None else None
        self.lookups, self.max_chain = lookups, max_chain
        self.tree_yield = TreeYield()
        self.overhead = RoundOverhead()  # a tree round's time beyond its verify forward, which pruning weighs
        self.plain_overhead = RoundOverhead()  # a plain round's, against which pruning weighs drafting trees at all

    def plan(self, state: RequestState) -> RoundPlan:
        """The round's nodes (none: a plain step); prompt lookup's tree drafted with the plan, as the scheduler does;
        with lookups, their continuation where it is expected to accept more than the head's tree."""
        if not state.draft_budget(1):
            return PLAIN
        head = self.pruning is None or self.pruning.wants_tree()
        if self.lookups is not None:
            limit = state.draft_budget(self.max_chain)
            lookup = self.lookups.lookup_round(state.tokens, limit, self.tree_yield if head else None, self._cut())
            if lookup is not None:
                return lookup
        if not head:
            return PLAIN
        if not isinstance(self.drafter, NgramDrafter):
            return RoundPlan(nodes=self.shape.budget)
        tree = self._pruned(self.drafter.propose_tree(state.request_id, state.tokens, self.shape))
        return RoundPlan(nodes=len(tree.tokens), tree=tree) if tree is not None else PLAIN

    def propose_tree(self, state: RequestState, plan: RoundPlan) -> DraftTree | None:
        """The plan's tree: drafted with it, or the head's, drafted now and pruned (None: a plain step)."""
        if plan.drafted or not plan.nodes:
            return plan.tree
        return self._pruned(self.drafter.propose_tree(state.request_id, state.tokens, self.shape))

    def _cut(self) -> Callable[[Sequence[float]], int] | None:
        """How much of a lookup's continuation pays alone (k='auto'; None: a fixed k, all of it)."""
        if self.pruning is None:
            return None
        return partial(best_chain_length, verify=self.pruning.verify, fixed_s=self.plain_overhead.seconds)

    def _pruned(self, tree: DraftTree | None) -> DraftTree | None:
        if tree is None or self.pruning is None:
            return tree
        return self.pruning.prune(tree, fixed_s=self.overhead.seconds, plain_s=self.plain_overhead.seconds)

    def took(self, plan: RoundPlan, beyond_s: float, steady: bool) -> None:
        """A round's seconds beyond its verify (drafting, feeding the head, the engine's own), for the head's trees'
        pruning: a tree round's and a plain round's apart; `steady`: not the request's first drafting round (the
        head's catch-up over the prompt)."""
        if plan.nodes and not plan.drafted and steady:
            self.overhead.observe(beyond_s)
        elif not plan.nodes and not plan.chain.k and steady:
            self.plain_overhead.observe(beyond_s)

    def observe(self, plan: RoundPlan, tree: DraftTree | None, accepted: int) -> None:
        """The round's outcome to what planned it: a lookup's chain, or the head's tree (pruned to nothing: None) and
        its pruning. A plain step planned as one teaches nothing."""
        if plan.chain.k:
            self.lookups.observe(plan.chain, accepted)
            return
        if not plan.nodes:
            return
        self.tree_yield.observe(accepted)
        if self.pruning is not None and tree is not None:
            self.pruning.observe(accepted)
