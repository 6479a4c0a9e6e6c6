"""The model-wide prompt lookup record (planner/acceptance.py: model_lookup_acceptance): what one request's lookups
accepted is where the next request's start, so that short requests on traffic where lookups miss stop taking the
head's rounds with them; and the rounds that pass lookups over relax the record back towards its prior."""

from specserve.workers.speculation.planner.acceptance import NGRAM_PRIOR, model_lookup_acceptance
from specserve.workers.speculation.planner.chain import ChainPlanner
from specserve.workers.speculation.planner.goodput import ChainPlan
from specserve.workers.speculation.planner.tree import TreeYield

TOKENS = [5, 6, 7, 8, 9, 10, 11, 5, 6, 7]  # "5 6 7" again: its continuation "8 9 10 11" to look up


def _request(shared) -> ChainPlanner:
    return ChainPlanner(use_ngram=True, lookup_shared=shared)


def test_a_lookup_record_learns_across_requests_then_relaxes_back_when_passed_over():
    shared = model_lookup_acceptance()
    first = _request(shared)
    offered = first.choice(TOKENS, None, 4).options[0]
    assert offered.source == "ngram" and offered.match == 3 and offered.tokens == (8, 9, 10, 11)
    head = TreeYield(mean=0.8)  # what the head's trees commit lately, against which a lookup competes
    assert first.lookup_round(TOKENS, 4, head) is not None  # the prior expects ~1.1 accepted tokens: it pays
    for _ in range(60):  # short requests whose lookups all missed
        _request(shared).observe(ChainPlan("ngram", 4, offered.tokens, offered.match), 0)
    later = _request(shared)
    assert later.choice(TOKENS, None, 4).options[0].rates[0] < offered.rates[0] / 2
    assert first.choice(TOKENS, None, 4).options[0].rates == offered.rates  # a running request keeps its own
    rounds = 0
    while _request(shared).lookup_round(TOKENS, 4, head) is None:  # each a round the head's tree took instead
        rounds += 1
        assert rounds < 5000, "the record never came back"
    assert rounds > 100  # it forgets slowly: a model-wide record, not one request's
    shorter = _request(shared)  # a 1-token match keeps its own record
    assert shorter.choice([1, 2, 3, 2], None, 4).options[0].match == 1
    assert shared[1].known_rates() == model_lookup_acceptance()[1].known_rates()


def test_without_a_shared_record_each_request_starts_from_the_prior():
    alone = ChainPlanner(use_ngram=True)
    for _ in range(60):
        alone.observe(ChainPlan("ngram", 4, (8, 9, 10, 11), 3), 0)
    assert ChainPlanner(use_ngram=True).choice(TOKENS, None, 4).options[0].rates[0] == NGRAM_PRIOR[3]
