"""The model-wide head record (planner/acceptance.py: model_head_acceptance) recovers: traffic the head drafted
badly for stops k='auto' drafting with it, and the plain rounds that follow relax the record back towards its prior
until a request drafts with the head again and measures it anew."""

from specserve.workers.speculation.planner.acceptance import model_head_acceptance
from specserve.workers.speculation.planner.chain import ChainPlanner
from specserve.workers.speculation.planner.costs import DraftCost, PlannerCosts, VerifyCosts
from specserve.workers.speculation.planner.goodput import ChainPlan

# A CPU-like target (ms by width 1..9) and a head at about a tenth of a step.
COSTS = PlannerCosts(VerifyCosts(tuple(t / 1e3 for t in (59, 62, 64, 66, 68, 70, 72, 74, 76))),
                     head=DraftCost(step_s=0.005, fixed_s=0.002))  # fmt: skip
TOKENS = list(range(40))  # nothing to look up: the head or nothing


def _request(shared) -> ChainPlanner:
    return ChainPlanner(use_head=True, costs=COSTS, head_shared=shared)


def test_a_head_record_that_stopped_drafting_relaxes_back_until_the_head_drafts_again():
    shared = model_head_acceptance((0.6, 0.5, 0.45))
    assert _request(shared).plan(TOKENS, None, 8).chain.source == "head"
    for _ in range(200):  # a burst the head drafted badly for: every draft rejected at once
        _request(shared).observe(ChainPlan("head", 3), 0)
    stopped = _request(shared)
    assert stopped.plan(TOKENS, None, 8).chain.source == "none"
    options = stopped.choice(TOKENS, None, 8).options
    rounds = 0
    while _request(shared).plan(TOKENS, None, 8).chain.source == "none":
        stopped.passed_over(options)  # a round that could have drafted with the head and did not
        rounds += 1
        assert rounds < 5000, "the record never came back"
    assert rounds > 100  # it forgets slowly: a model-wide record, not one request's
    lookup_only = ChainPlanner(use_ngram=True, costs=COSTS, head_shared=shared)
    before = shared.known_rates()
    lookup_only.passed_over(lookup_only.choice([5, 6, 7, 5, 6], None, 8).options)  # no head among them
    assert shared.known_rates() == before
