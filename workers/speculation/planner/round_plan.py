"""One request's next round, as planned (`RoundPlan`): whose draft and how much, what it was chosen from and what the
plan expects of it. The scheduler's `plan_round` returns it and `apply_round` consumes it (the pipeline only carries
the calls it implies); the in-process engine plans and applies the same value (round_drafting.py). Torch-free."""

from __future__ import annotations

from dataclasses import dataclass

from specserve.workers.speculation.draft_tree import DraftTree
from specserve.workers.speculation.methods import LOOKUP_CHAIN, SUFFIX_CHAIN
from specserve.workers.speculation.planner.acceptance import expected_accepted
from specserve.workers.speculation.planner.goodput import NO_DRAFT, ChainPlan, RoundForecast, RowChoice

LOOKUP_SOURCES = (LOOKUP_CHAIN, SUFFIX_CHAIN)  # drafters whose plan carries its tokens: no model to call


@dataclass(frozen=True)
class RoundPlan:
    """A round of one request. A chain round drafts `chain` (its source's k tokens: prompt lookup's and suffix
    drafting's carried in it, a model's drafted on its worker); a tree round drafts up to `nodes` nodes (prompt
    lookup's `tree` drafted with the plan, a head's on its worker and pruned once drafted). Neither: a plain step."""

    chain: ChainPlan = NO_DRAFT
    nodes: int = 0  # a tree round: the most nodes to draft (0: a plain step)
    tree: DraftTree | None = None  # prompt lookup's tree, drafted with the plan (no model to call)
    row: RowChoice | None = None  # what the chain was chosen from: its options, its fixed k, its budget
    forecast: RoundForecast | None = None  # k='auto' chains: the round as its worker's batch plan expects it

    @property
    def k(self) -> int:
        """Tokens to draft: the chain's, or the most nodes of a tree (0: a plain step)."""
        return self.nodes or self.chain.k

    @property
    def drafted(self) -> bool:
        """Drafted with the plan (prompt lookup, suffix drafting): no draft call to make."""
        return self.tree is not None or self.chain.k > 0 and self.chain.source in LOOKUP_SOURCES

    @property
    def expected(self) -> float:
        """The chain's expected accepted tokens, by the acceptance its source's option was chosen with (0 for a tree,
        whose pruning predicts once drafted, and for a plain step)."""
        if not self.chain.k or self.row is None:
            return 0.0
        option = next((o for o in self.row.options if o.source == self.chain.source), None)
        return expected_accepted(option.rates, min(self.chain.k, len(option.rates))) if option else 0.0

    @property
    def forecast_s(self) -> float:
        return self.forecast.seconds if self.forecast is not None else 0.0

    @property
    def rate(self) -> float:
        """Predicted committed tokens per second of the round's time (0 where no forecast was made)."""
        return (1.0 + self.expected) / self.forecast.seconds if self.forecast and self.forecast.seconds > 0 else 0.0


PLAIN = RoundPlan()  # a plain step: nothing drafted
