"""A round's plan (workers/speculation/planner/round_plan.py): its k, whether it came drafted (prompt lookup's,
suffix drafting's), the accepted tokens its source's rates expect and its predicted rate."""

import pytest

from specserve.workers.runtime.tree_rows import ROOT
from specserve.workers.speculation.draft_tree import DraftTree
from specserve.workers.speculation.planner.goodput import ChainPlan, Option, RoundForecast, RowChoice
from specserve.workers.speculation.planner.round_plan import PLAIN, RoundPlan

ROW = RowChoice((Option("ngram", (0.5, 0.5), (7, 8), 2), Option("head", (0.6, 0.4, 0.2))), None, 4)


def test_a_plain_step_drafts_nothing_and_expects_nothing():
    assert (PLAIN.k, PLAIN.drafted, PLAIN.expected, PLAIN.rate, PLAIN.forecast_s) == (0, False, 0.0, 0.0, 0.0)
    assert not RoundPlan(ChainPlan("none", 0), row=ROW).drafted


def test_a_chain_expects_what_its_sources_rates_say_and_a_lookup_comes_drafted():
    lookup = RoundPlan(ChainPlan("ngram", 2, (7, 8), 2), row=ROW, forecast=RoundForecast(True, 1, 0.05))
    assert lookup.k == 2 and lookup.drafted and lookup.expected == pytest.approx(0.5 + 0.25)
    assert lookup.rate == pytest.approx((1 + 0.75) / 0.05)
    head = RoundPlan(ChainPlan("head", 2), row=ROW)
    assert head.k == 2 and not head.drafted and head.expected == pytest.approx(0.6 + 0.24) and head.rate == 0.0


def test_a_tree_round_counts_its_nodes_and_a_lookup_tree_comes_drafted():
    tree = DraftTree([5, 6, 7], [ROOT, 0, 0], [-0.1, -0.5, -0.9])
    assert RoundPlan(nodes=3, tree=tree).k == 3 and RoundPlan(nodes=3, tree=tree).drafted
    assert RoundPlan(nodes=16).k == 16 and not RoundPlan(nodes=16).drafted  # a head's, drafted on its worker
