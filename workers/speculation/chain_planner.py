"""Per request, each round: what its chain drafters can offer (`ChainPlanner.options`) and how they have done
(`observe`). The goodput planner (goodput.py) then picks, for the whole batch, whose chain each request drafts and
how long; a request alone (the in-process engine) is a batch of one (`ChainPlanner.plan`).

Drafters: an EAGLE-3 head ("head"), prompt lookup ("ngram"), a draft model ("draft"); a method allows one or two
(eagle+ngram: the head's chain or the lookup's continuation). Acceptance is tracked per chain position for the
head and the draft model and per matched suffix length for prompt lookup (a 3-token match predicts its continuation
far better than a 1-token one), starting from priors (a head's measured one from its config).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from specserve.workers.config.settings import NgramConfig
from specserve.workers.speculation.chain_policy import DraftCost, PositionAcceptance, VerifyCosts
from specserve.workers.speculation.goodput import (
    NO_DRAFT,
    ChainPlan,
    Option,
    RealizedRounds,
    RoundForecast,
    RowChoice,
    VerifySurface,
    VerifyTimings,
    plan_batch,
)
from specserve.workers.speculation.methods import HEAD_CHAIN, LOOKUP_CHAIN, MODEL_CHAIN, SUFFIX_CHAIN, Method
from specserve.workers.speculation.ngram import ngram_match
from specserve.workers.speculation.suffix import SuffixCache, SuffixLookup

# Prior acceptance given the previous position accepted. The head's: a trained SmolLM2 head on held-out chat (its
# config may carry measured ones); the n-gram's by matched suffix length 1, 2, 3+ (held-out chat, k = 4); a draft
# model's: a small model of the target's family.
HEAD_PRIOR = (0.45, 0.4, 0.4, 0.4)
NGRAM_PRIOR = {1: 0.2, 2: 0.4, 3: 0.55}
DRAFT_PRIOR = (0.6,)
# Suffix drafting's, by matched suffix length 2-3, 4-7, 8-15, 16+: a long match repeats (an earlier answer, a quoted
# passage) and keeps repeating.
SUFFIX_PRIOR = {2: 0.35, 4: 0.5, 8: 0.65, 16: 0.8}
LOOKUP_SOURCES = (LOOKUP_CHAIN, SUFFIX_CHAIN)  # drafters whose plan carries its tokens: no model to call


@dataclass(frozen=True)
class PlannerCosts:
    """What k = 'auto' weighs: the target's verify cost (per width for one row, or measured over batch sizes too)
    and the drafters' costs (prompt lookup's: none)."""

    verify: VerifyCosts | VerifySurface | VerifyTimings
    head: DraftCost = DraftCost()
    draft: DraftCost = DraftCost()

    @property
    def surface(self) -> VerifySurface | VerifyTimings:
        return VerifySurface.single(self.verify) if isinstance(self.verify, VerifyCosts) else self.verify

    @property
    def drafters(self) -> dict[str, DraftCost]:
        return {HEAD_CHAIN: self.head, MODEL_CHAIN: self.draft}

    def observe_batch(self, rows: int, tokens: int, seconds: float) -> None:
        """A verify batch the target worker reported: corrects the measured surface (fixed costs learn nothing)."""
        if isinstance(self.verify, VerifyTimings):
            self.verify.observe(rows, tokens, seconds)


def model_head_acceptance(recorded: Sequence[float] | None = None) -> PositionAcceptance:
    """A head's acceptance by position over a model's recent rounds, every request's (about the last thousand): where
    each new request's planning starts, from the head's recorded acceptance (its config's) or the generic prior. A
    head's record was measured on its training data, not on what a deployment serves, and a request of a few rounds
    never learns its own (8 served streams of held-out chat, answers of 8-24 tokens: 0.31 accepted a drafted token,
    where the record said 0.37 at k = 3)."""
    return PositionAcceptance(tuple(recorded or HEAD_PRIOR), prior_weight=16.0, decay=0.999)


class ChainPlanner:
    """One request's chain drafters and their measured acceptance."""

    def __init__(
        self,
        use_head: bool = False,
        use_ngram: bool = False,
        ngram: NgramConfig | None = None,
        head_prior: Sequence[float] = HEAD_PRIOR,
        costs: PlannerCosts | None = None,
        use_draft: bool = False,
        suffix: SuffixLookup | None = None,
        head_shared: PositionAcceptance | None = None,
    ):
        """suffix: the request's suffix drafting (method "suffix"), None for the other methods; head_shared: the
        model's head acceptance over every request, where this one starts and which its rounds update (instead of
        head_prior); `for_method` builds the planner a method's registry entry names."""
        self.use_head, self.use_ngram, self.use_draft = use_head, use_ngram, use_draft
        self.suffix = suffix
        self.by_suffix_match = {n: PositionAcceptance((a,)) for n, a in SUFFIX_PRIOR.items()}
        self.ngram = ngram or NgramConfig()
        self.costs = costs
        self.head_shared = head_shared
        self.head = PositionAcceptance(head_shared.known_rates() if head_shared is not None else tuple(head_prior))
        self.draft = PositionAcceptance(DRAFT_PRIOR)
        self.by_match = {n: PositionAcceptance((a,)) for n, a in NGRAM_PRIOR.items()}

    @classmethod
    def for_method(cls, entry: Method, suffix_cache: SuffixCache | None = None, **kw) -> ChainPlanner:
        """The planner of a chain method: the drafters its registry entry names (methods.py); kw: the rest."""
        sources = entry.chain_sources
        cache = SuffixCache() if suffix_cache is None else suffix_cache
        suffix = SuffixLookup(cache) if entry.suffix else None
        return cls(use_head=HEAD_CHAIN in sources, use_ngram=LOOKUP_CHAIN in sources,
                   use_draft=MODEL_CHAIN in sources, suffix=suffix, **kw)  # fmt: skip

    def _ngram_stats(self, match: int) -> PositionAcceptance:
        return self.by_match[min(match, max(self.by_match))]

    def _suffix_stats(self, match: int) -> PositionAcceptance:
        return self.by_suffix_match[max(n for n in self.by_suffix_match if n <= max(match, 2))]

    def options(self, tokens: Sequence[int], limit: int, model: bool = True) -> tuple[Option, ...]:
        """What each allowed drafter can draft this round, at most `limit` tokens. model: whether the head or draft
        model can draft (one on a draft worker needs the worker, and a head the target's features of the last
        round)."""
        if limit <= 0:
            return ()
        out = []
        if self.use_ngram:
            match, follow = ngram_match(tokens, limit, self.ngram.max_ngram, self.ngram.min_ngram)
            if follow:
                rates = tuple(self._ngram_stats(match).rates(len(follow)))
                out.append(Option(LOOKUP_CHAIN, rates, tuple(follow), match))
        if self.suffix is not None:
            draft = self.suffix.draft(tokens, limit)
            if draft.tokens:
                rates = tuple(self._suffix_stats(draft.match).rates(len(draft.tokens)))
                out.append(Option(SUFFIX_CHAIN, rates, draft.tokens, draft.match))
        if self.use_head and model:
            out.append(Option(HEAD_CHAIN, tuple(self.head.rates(limit))))
        if self.use_draft and model:
            out.append(Option(MODEL_CHAIN, tuple(self.draft.rates(limit))))
        return tuple(out)

    def choice(self, tokens: Sequence[int], k: int | None, budget: int, model: bool = True) -> RowChoice:
        """This round's row for the goodput planner. k: a fixed k, or None for 'auto'; budget: the most it may draft."""
        limit = min(budget, k) if k is not None else budget
        return RowChoice(self.options(tokens, limit, model), k, limit)

    def plan(self, tokens: Sequence[int], k: int | None, budget: int, model: bool = True,
             batched_drafts: bool = False) -> ChainPlan:  # fmt: skip
        """A request alone (a batch of one): with a fixed k, the chain expected to accept the most; with 'auto' (k
        None, needs costs), the chain and length with the most committed tokens per second, or none."""
        row = self.choice(tokens, k, budget, model)
        if not row.options or row.budget <= 0:
            return NO_DRAFT
        if k is None and self.costs is None:
            raise ValueError("k='auto' needs measured costs")
        costs = self.costs or PlannerCosts(VerifyCosts((1.0,)))
        return plan_batch([row], costs.surface, costs.drafters, row.budget, batched_drafts).rows[0]

    def passed_over(self, options: Sequence[Option]) -> None:
        """A round that offered these options and drafted none of the head's: the model-wide head record relaxes
        towards its prior (PositionAcceptance.relax), so that traffic the head once drafted badly for (a burst of
        summaries) does not stop it drafting for every later request for good."""
        if self.head_shared is not None and any(o.source == HEAD_CHAIN for o in options):
            self.head_shared.relax()

    def observe(self, plan: ChainPlan, accepted: int) -> None:
        if plan.source == HEAD_CHAIN:
            self.head.observe(plan.k, accepted)
            if self.head_shared is not None:
                self.head_shared.observe(plan.k, accepted)
        elif plan.source == MODEL_CHAIN:
            self.draft.observe(plan.k, accepted)
        elif plan.source == LOOKUP_CHAIN:
            self._ngram_stats(plan.match).observe(plan.k, accepted)
        elif plan.source == SUFFIX_CHAIN:
            self._suffix_stats(plan.match).observe(plan.k, accepted)


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

    def for_round(self, rows: Sequence[RowChoice], costs: PlannerCosts, max_width: int) -> int:
        if self.rows != len(rows) or self.plans_left <= 0:
            plan = plan_batch(rows, costs.surface, costs.drafters, max_width, batched_drafts=True,
                              realized=self.realized)  # fmt: skip
            self.width, self.rows, self.plans_left = plan.width, len(rows), len(rows)
            self.forecast = RoundForecast(plan.width > 0, len(rows), plan.seconds)
            self._track()
        self.plans_left -= 1
        return self.width

    def summary(self) -> dict:
        """For the scheduler's status: the plan at the worker's batch size, and what it weighed beside the costs."""
        return {"width": self.width, "requests": self.rows, "features_paused": bool(self.quiet_below),
                "slowdown_drafting": self.realized.factor(True, self.rows),
                "slowdown_plain": self.realized.factor(False, self.rows)}  # fmt: skip

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
