"""A request's chain planner (workers/speculation/planner/chain.py): which drafter's chain and how long, over
synthetic acceptance and costs; and the k oracle the engine tests check against."""

import pytest

from specserve.workers.speculation.planner.acceptance import NGRAM_PRIOR
from specserve.workers.speculation.planner.chain import ChainPlanner
from specserve.workers.speculation.planner.costs import DraftCost, PlannerCosts, VerifyCosts
from specserve.workers.speculation.planner.goodput import ChainPlan
from specserve.workers.speculation.planner.tree import TreeYield
from tests.helpers.chain_oracle import best_k, round_rate

# Measured on 2 cores for SmolLM2-135M (ms by width 1..9): widths 2-3 cost more than 5.
CPU_COSTS = VerifyCosts(tuple(t / 1e3 for t in (59, 100, 112, 87, 83, 84, 85, 86, 91)))


def test_best_k_weighs_the_measured_cost_of_each_width():
    rates = [0.55] * 8
    # Under flat costs the policy would stop where the next draft adds little; on this CPU width 5 is cheaper than 2-3.
    k = best_k(rates, CPU_COSTS, DraftCost(step_s=0.005), max_k=8)
    assert k == 4
    assert round_rate(rates, 4, CPU_COSTS, DraftCost(step_s=0.005)) > round_rate(rates, 2, CPU_COSTS, DraftCost(0.005))
    flat = VerifyCosts((0.06,) + (0.06,) * 8)
    assert best_k([0.9] * 8, flat, DraftCost(), max_k=8) == 8  # free drafts, flat verify: draft as far as allowed
    assert best_k([0.05] * 8, CPU_COSTS, DraftCost(step_s=0.005), max_k=8) == 0  # a poor drafter: do not draft
    # Made to draft, it drafts 3: verifying 4 positions (87 ms) is cheaper than verifying 2 (100 ms).
    assert best_k([0.05] * 8, CPU_COSTS, DraftCost(step_s=0.005), max_k=8, min_k=1) == 3
    assert best_k([0.9] * 8, flat, DraftCost(), max_k=3) == 3  # the round's budget caps it


def test_the_planner_takes_a_long_ngram_match_and_the_head_otherwise():
    planner = ChainPlanner(use_head=True, use_ngram=True)
    repeated = [5, 6, 7, 8, 9, 5, 6, 7]  # "5 6 7" matched: "8 9 5" follows
    plan = planner.plan(repeated, k=3, budget=10)
    assert plan.chain == ChainPlan("ngram", 3, (8, 9, 5), match=3) and plan.drafted  # the lookup's tokens in it
    assert planner.plan([5, 6, 7, 8, 9, 1, 2, 9], k=3, budget=10).chain.source == "head"  # a 1-token match loses
    assert planner.plan(repeated, k=3, budget=2).chain.k == 2
    assert planner.plan(repeated, k=3, budget=0).chain.source == "none"
    # The request's own rounds move the choice: 3-token matches that keep failing lose to the head.
    for _ in range(12):
        planner.observe(ChainPlan("ngram", 3, (8, 9, 5), match=3), accepted=0)
    assert planner.plan(repeated, k=3, budget=10).chain.source == "head"
    assert ChainPlanner(use_head=False, use_ngram=True).plan([1, 2, 3], k=3, budget=5).chain.source == "none"
    assert NGRAM_PRIOR[3] > NGRAM_PRIOR[1]


def test_auto_k_picks_per_candidate_and_needs_costs():
    costs = PlannerCosts(CPU_COSTS, DraftCost(step_s=0.005, fixed_s=0.003))
    planner = ChainPlanner(use_head=True, use_ngram=False, head_prior=(0.6, 0.55), costs=costs)
    plan = planner.plan(list(range(20)), k=None, budget=8)
    assert plan.chain.source == "head" and not plan.drafted
    assert plan.k == best_k([0.6] + [0.55] * 7, CPU_COSTS, costs.head, 8, min_k=1)
    poor = ChainPlanner(use_head=True, use_ngram=True, head_prior=(0.1,), costs=costs)
    assert poor.plan(list(range(20)), k=None, budget=8).chain.source == "none"  # a plain step beats a poor head's chain
    assert poor.plan([5, 6, 7, 8, 9, 5, 6, 7], k=None, budget=8).chain.source == "ngram"  # a 3-token match still pays
    assert poor.plan(list(range(20)), k=3, budget=8).chain.source == "head"  # a fixed k always drafts
    with pytest.raises(ValueError, match="costs"):
        ChainPlanner(use_head=True, use_ngram=False).plan([1, 2], k=None, budget=4)


def test_a_lookup_round_beside_head_trees_weighs_accepted_nodes_at_a_fixed_k():
    planner = ChainPlanner(use_ngram=True)
    repeated = [5, 6, 7, 8, 9, 5, 6, 7]  # a 3-token match: 8 9 5 follows, expected ~0.55 + 0.3 + 0.17 accepted
    lookup = planner.lookup_round(repeated, 3, TreeYield(mean=0.5))
    assert lookup.chain == ChainPlan("ngram", 3, (8, 9, 5), match=3) and lookup.tree.tokens == [8, 9, 5]
    assert lookup.tree.parents[1:] == [0, 1] and lookup.drafted  # a chain-shaped tree, drafted with the plan
    assert planner.lookup_round(repeated, 3, TreeYield(mean=2.0)) is None  # the head's trees accept more
    assert planner.lookup_round(repeated, 3, None) is not None  # no head tree this round: the lookup, whatever it is
    assert planner.lookup_round([1, 2, 3, 4], 3, None) is None  # no match, nothing to verify
    assert planner.lookup_round(repeated, 3, None, cut=lambda rates: 2).chain.tokens == (8, 9)  # what pays of it
    assert planner.lookup_round(repeated, 3, None, cut=lambda rates: 0) is None  # none of it pays: a plain step


def test_the_head_trees_yield_counts_a_tree_pruned_to_nothing_as_none_accepted():
    head = TreeYield()
    for _ in range(30):
        head.observe(3)
    assert head.mean == pytest.approx(3.0, abs=0.01)
    for _ in range(30):
        head.observe(0)  # trees that pay for no node: a lookup's continuation wins the next rounds
    assert head.mean < 0.01
