"""Per request, each round: what its chain drafters can offer (`ChainPlanner.options`) and how they have done
(`observe`). The goodput planner (goodput.py) then picks, for the whole batch, whose chain each request drafts and
how long; a request alone (the in-process engine) is a batch of one (`ChainPlanner.plan`).

Drafters: an EAGLE-3 head ("head"), prompt lookup ("ngram"), a draft model ("draft"); a method allows one or two
(eagle+ngram: the head's chain or the lookup's continuation). Acceptance is tracked per chain position for the
head and the draft model and per matched suffix length for prompt lookup (a 3-token match predicts its continuation
far better than a 1-token one), starting from priors (a head's measured one from its config).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from specserve.workers.config.settings import NgramConfig
from specserve.workers.speculation.methods import HEAD_CHAIN, LOOKUP_CHAIN, MODEL_CHAIN, SUFFIX_CHAIN, Method
from specserve.workers.speculation.ngram import ngram_match
from specserve.workers.speculation.planner.acceptance import (
    DRAFT_PRIOR,
    HEAD_PRIOR,
    NGRAM_PRIOR,
    SUFFIX_PRIOR,
    PositionAcceptance,
    expected_accepted,
)
from specserve.workers.speculation.planner.costs import PlannerCosts, VerifyCosts
from specserve.workers.speculation.planner.goodput import ChainPlan, Option, RoundForecast, RowChoice, plan_batch
from specserve.workers.speculation.planner.round_plan import RoundPlan
from specserve.workers.speculation.planner.tree import TreeYield, chain_tree
from specserve.workers.speculation.suffix import SuffixCache, SuffixLookup


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
        lookup_shared: Mapping[int, PositionAcceptance] | None = None,
    ):
        """suffix: the request's suffix drafting (method "suffix"), None for the other methods; head_shared: the
        model's head acceptance over every request, where this one starts and which its rounds update (instead of
        head_prior); lookup_shared: prompt lookup's likewise, by matched suffix length; `for_method` builds the
        planner a method's registry entry names."""
        self.use_head, self.use_ngram, self.use_draft = use_head, use_ngram, use_draft
        self.suffix = suffix
        self.by_suffix_match = {n: PositionAcceptance((a,)) for n, a in SUFFIX_PRIOR.items()}
        self.ngram = ngram or NgramConfig()
        self.costs = costs
        self.head_shared = head_shared
        self.head = PositionAcceptance(head_shared.known_rates() if head_shared is not None else tuple(head_prior))
        self.draft = PositionAcceptance(DRAFT_PRIOR)
        self.lookup_shared = lookup_shared
        self.by_match = {n: PositionAcceptance(lookup_shared[n].known_rates() if lookup_shared else (a,))
                         for n, a in NGRAM_PRIOR.items()}  # fmt: skip

    @classmethod
    def for_method(cls, entry: Method, suffix_cache: SuffixCache | None = None, **kw) -> ChainPlanner:
        """The planner of a chain method: the drafters its registry entry names (methods.py); kw: the rest."""
        sources = entry.chain_sources
        cache = SuffixCache() if suffix_cache is None else suffix_cache
        suffix = SuffixLookup(cache) if entry.suffix else None
        return cls(use_head=HEAD_CHAIN in sources, use_ngram=LOOKUP_CHAIN in sources,
                   use_draft=MODEL_CHAIN in sources, suffix=suffix, **kw)  # fmt: skip

    def _ngram_stats(self, match: int, record: Mapping[int, PositionAcceptance] | None = None) -> PositionAcceptance:
        record = self.by_match if record is None else record
        return record[min(match, max(record))]

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
             batched_drafts: bool = False) -> RoundPlan:  # fmt: skip
        """A request alone (a batch of one): with a fixed k, the chain expected to accept the most; with 'auto' (k
        None, needs costs), the chain and length with the most committed tokens per second, or none."""
        row = self.choice(tokens, k, budget, model)
        if not row.options or row.budget <= 0:
            return RoundPlan(row=row)
        if k is None and self.costs is None:
            raise ValueError("k='auto' needs measured costs")
        costs = self.costs or PlannerCosts(VerifyCosts((1.0,)))
        plan = plan_batch([row], costs.surface, costs.drafters, row.budget, batched_drafts)
        forecast = RoundForecast(plan.width > 0, 1, plan.seconds) if k is None else None
        return RoundPlan(plan.rows[0], row=row, forecast=forecast)

    def lookup_round(self, tokens: Sequence[int], limit: int, head: TreeYield | None,
                     cut: Callable[[Sequence[float]], int] | None = None) -> RoundPlan | None:  # fmt: skip
        """A tree method's round from its lookups (eagle-tree+ngram): the continuation expected to accept the most,
        as a chain-shaped tree drafted with the plan, where it is expected to accept more than the head's trees have
        lately (head: their yield; None: the head drafts no tree this round); None: the head's tree (or a plain
        step). `cut` (k='auto'): how much of the continuation pays for its verification, from its rates (None: all
        of it). A comparison with the head by committed tokens a second (each width's verify cost, the head's
        drafting counted) was tried and measured slower: it took the lookup in more rounds, each committing less
        (docs/planner.md)."""
        row = RowChoice(self.options(tokens, limit, model=False), None, limit)
        if not row.options:
            return None
        expected, best = max(((expected_accepted(o.rates, len(o.tokens)), o) for o in row.options), key=lambda p: p[0])
        if head is not None and expected <= head.mean:
            self.passed_over(row.options)
            return None
        k = len(best.tokens) if cut is None else min(len(best.tokens), cut(best.rates))
        if not k:
            self.passed_over(row.options)
            return None
        chain = ChainPlan.of(best, k)
        return RoundPlan(chain, nodes=chain.k, tree=chain_tree(chain.tokens), row=row)

    def passed_over(self, options: Sequence[Option], drafted: str | None = None) -> None:
        """A round that offered these options and drafted another's (`drafted`, or none): the model-wide records of
        the head and of prompt lookup at the match offered relax towards their priors (PositionAcceptance.relax), so
        that traffic a drafter once drafted badly for (a burst of summaries for the head, of chat for lookups) does
        not stop it drafting for every later request for good."""
        if self.head_shared is not None and drafted != HEAD_CHAIN and any(o.source == HEAD_CHAIN for o in options):
            self.head_shared.relax()
        if self.lookup_shared is not None and drafted != LOOKUP_CHAIN:
            for o in options:
                if o.source == LOOKUP_CHAIN:
                    self._ngram_stats(o.match, self.lookup_shared).relax()

    def observe(self, plan: ChainPlan, accepted: int) -> None:
        if plan.source == HEAD_CHAIN:
            self.head.observe(plan.k, accepted)
            if self.head_shared is not None:
                self.head_shared.observe(plan.k, accepted)
        elif plan.source == MODEL_CHAIN:
            self.draft.observe(plan.k, accepted)
        elif plan.source == LOOKUP_CHAIN:
            self._ngram_stats(plan.match).observe(plan.k, accepted)
            if self.lookup_shared is not None:
                self._ngram_stats(plan.match, self.lookup_shared).observe(plan.k, accepted)
        elif plan.source == SUFFIX_CHAIN:
            self._suffix_stats(plan.match).observe(plan.k, accepted)
