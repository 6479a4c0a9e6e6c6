"""One target worker's batch width: the goodput planner's chain width for its requests, re-planned once per batch
round or when their number changes, with the worker's realized rounds against their plans; and whether a head's
features are worth their traffic there (`BatchWidth.features_paused`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from specserve.workers.speculation.planner.costs import ChunkBeside, PlannerCosts
from specserve.workers.speculation.planner.goodput import RealizedRounds, RoundForecast, RowChoice, plan_batch
from specserve.workers.speculation.planner.tree import RecentTrees, RoundOverhead

# A head's features under load: after this many re-plans in a row that drafted nothing, the worker's k='auto' chains
# stop asking for them (every verify reply carries them, and at 16 streams on the 2-core CPU that alone cost 4-5% of
# the throughput: results/2026-11-26-1523-smollm2-load/README.md), until the worker's requests fall below 3/4 of the
# fewest there were then, or after this many verify calls, when the planner looks again with the head's features back.
QUIET_AFTER_PLANS = 8


QUIET_CALLS = 4096


@dataclass
class BatchWidth:
    """The goodput planner's chain width for one target worker's requests, re-planned once per batch round (after
    as many plans as the worker has requests) or when their number changes; and whether a head's features are worth
    their traffic there (`features_paused`)."""

    width: int = 0
    rows: int = 0
    plans_left: int = 0
    plain_plans: int = 0  # re-plans in a row that drafted nothing
    plain_rows: int = 0  # the fewest requests among them
    quiet_below: int = 0  # features paused while the worker has at least this many requests (0: not paused)
    quiet_left: int = 0  # verify calls before the planner looks again with features
    realized: RealizedRounds = field(default_factory=RealizedRounds)  # the worker's rounds against their plans
    forecast: RoundForecast | None = None  # what the current plan's rounds are expected to take
    tree_overhead: RoundOverhead = field(default_factory=RoundOverhead)  # its tree rounds' time beyond the verify
    plain_overhead: RoundOverhead = field(default_factory=RoundOverhead)  # its tree requests' plain rounds' time
    head_trees: RecentTrees = field(default_factory=RecentTrees)  # its requests' head trees as verified
    beside: bool = False  # whether the plan counted a prompt's chunk in the pass

    def for_round(self, rows: Sequence[RowChoice], costs: PlannerCosts, max_width: int,
                  beside: ChunkBeside | None = None) -> int:  # fmt: skip
        """The width of this round of one of `rows` (the worker's requests), `beside` a prompt's chunk in its pass."""
        if self.rows != len(rows) or self.plans_left <= 0 or self.beside != (beside is not None):
            plan = plan_batch(rows, costs.surface, costs.drafters, max_width, batched_drafts=True,
                              realized=self.realized, beside=beside)  # fmt: skip
            self.width, self.rows, self.plans_left = plan.width, len(rows), len(rows)
            self.beside = beside is not None
            self.forecast = RoundForecast(plan.width > 0, len(rows), plan.seconds)
            self._track()
        self.plans_left -= 1
        return self.width

    def summary(self) -> dict:
        """For the scheduler's status: the plan at the worker's batch size, and what it weighed beside the costs."""
        return {"width": self.width, "requests": self.rows, "features_paused": bool(self.quiet_below),
                "slowdown_drafting": self.realized.factor(True, self.rows),
                "slowdown_plain": self.realized.factor(False, self.rows),
                "tree_overhead_ms": round(1e3 * self.tree_overhead.seconds, 3),
                "plain_overhead_ms": round(1e3 * self.plain_overhead.seconds, 3)}  # fmt: skip

    def features_paused(self, requests: int) -> bool:
        """For one verify call of a k='auto' chain, the worker having `requests` requests now. (While paused a
        head's chains have nothing to draft from and may never re-plan: the load is checked here.)"""
        if not self.quiet_below:
            return False
        self.quiet_left -= 1
        if requests < self.quiet_below or self.quiet_left <= 0:
            self.quiet_below, self.plain_plans = 0, 0  # the load fell, or time to look again
        return self.quiet_below > 0

    def _track(self) -> None:
        if self.width or self.quiet_below:
            self.plain_plans = 0
            return
        self.plain_rows = min(self.plain_rows, self.rows) if self.plain_plans else self.rows
        self.plain_plans += 1
        if self.plain_plans >= QUIET_AFTER_PLANS and self.plain_rows > 1:
            self.quiet_below, self.quiet_left = max(2, 3 * self.plain_rows // 4), QUIET_CALLS
