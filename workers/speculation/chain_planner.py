"""Per request, each round: whose chain to draft (the EAGLE-3 head's or the n-gram prompt lookup's) and how long.

With a fixed k the chain with the larger expected accepted length wins (n-gram ties win: it costs nothing). With
k = 'auto' each candidate's best k is chosen by the committed tokens per second of its rounds (chain_policy.py), and
the faster candidate wins, or no chain at all (a plain target step) when neither is expected to pay for itself: a
head that accepts little is not drafted with (its rates then stay where its measured prior puts them). Acceptance
is tracked per chain position for the head and per matched suffix length for the n-gram (a 3-token match predicts
its continuation far better than a 1-token one), starting from priors.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from specserve.workers.config import NgramConfig
from specserve.workers.speculation.chain_policy import (
    DraftCost,
    PositionAcceptance,
    VerifyCosts,
    best_k,
    expected_accepted,
    round_rate,
)
from specserve.workers.speculation.drafters import ngram_match

# Prior acceptance given the previous position accepted. The head's: a trained SmolLM2 head on held-out chat (its
# config may carry measured ones); the n-gram's by matched suffix length 1, 2, 3+ (held-out chat, k = 4).
HEAD_PRIOR = (0.45, 0.4, 0.4, 0.4)
NGRAM_PRIOR = {1: 0.2, 2: 0.4, 3: 0.55}
Source = Literal["head", "ngram", "none"]


@dataclass(frozen=True)
class ChainPlan:
    source: Source
    k: int  # tokens to draft (the n-gram's: len(tokens))
    tokens: tuple[int, ...] = ()  # the n-gram continuation (source "ngram")
    match: int = 0  # the n-gram's matched suffix length


@dataclass(frozen=True)
class PlannerCosts:
    """What k = 'auto' weighs: the target's verify cost per width and the head's drafting cost."""

    verify: VerifyCosts
    head: DraftCost


class ChainPlanner:
    """One request's choice of chain each round. `use_head` / `use_ngram`: the candidates the method allows."""

    def __init__(
        self,
        use_head: bool,
        use_ngram: bool,
        ngram: NgramConfig | None = None,
        head_prior: Sequence[float] = HEAD_PRIOR,
        costs: PlannerCosts | None = None,
    ):
        self.use_head, self.use_ngram = use_head, use_ngram
        self.ngram = ngram or NgramConfig()
        self.costs = costs
        self.head = PositionAcceptance(tuple(head_prior))
        self.by_match = {n: PositionAcceptance((a,)) for n, a in NGRAM_PRIOR.items()}

    def _ngram_stats(self, match: int) -> PositionAcceptance:
        return self.by_match[min(match, max(self.by_match))]

    def plan(self, tokens: Sequence[int], k: int | None, budget: int, head: bool = True) -> ChainPlan:
        """k: tokens to draft, or None for 'auto' (needs costs); budget: the most this round may draft; head: whether
        the head can draft this round (a head on a draft worker waits for the target's features of the last round)."""
        limit = min(budget, k) if k is not None else budget
        if limit <= 0:
            return ChainPlan("none", 0)
        candidates: list[tuple[float, ChainPlan]] = []
        if self.use_ngram:
            match, follow = ngram_match(tokens, limit, self.ngram.max_ngram, self.ngram.min_ngram)
            if follow:
                candidates.append(self._score(self._ngram_stats(match), DraftCost(), len(follow), k is None,
                                              lambda n: ChainPlan("ngram", n, tuple(follow[:n]), match)))  # fmt: skip
        if self.use_head and head:
            head_cost = self.costs.head if self.costs is not None else DraftCost()
            candidates.append(self._score(self.head, head_cost, limit, k is None, lambda n: ChainPlan("head", n)))
        if k is None and self.costs is not None:  # 'auto': a plain step when no chain is expected to pay for itself
            candidates.append((1.0 / self.costs.verify.verify(0), ChainPlan("none", 0)))
        if not candidates:
            return ChainPlan("none", 0)
        return max(candidates, key=lambda c: (c[0], c[1].source == "ngram"))[1]

    def _score(self, stats: PositionAcceptance, cost: DraftCost, limit: int, auto: bool, make) -> tuple:
        """(score, plan) of one candidate: with a fixed k, its expected accepted tokens; with 'auto', the committed
        tokens per second at its best k (at least 1: the method asked for drafting). make(k) -> the plan."""
        rates = stats.rates(limit)
        if not auto:
            return expected_accepted(rates, limit), make(limit)
        if self.costs is None:
            raise ValueError("k='auto' needs measured costs")
        n = best_k(rates, self.costs.verify, cost, limit, min_k=1)
        return round_rate(rates, n, self.costs.verify, cost), make(n)

    def observe(self, plan: ChainPlan, accepted: int) -> None:
        if plan.source == "head":
            self.head.observe(plan.k, accepted)
        elif plan.source == "ngram":
            self._ngram_stats(plan.match).observe(plan.k, accepted)
