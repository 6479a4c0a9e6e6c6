"""The node count of eagle-tree k='auto' (workers/speculation/planner/tree.py) and pruning a tree to its best nodes."""

import math

import pytest

from specserve.workers.runtime.tree_rows import ROOT
from specserve.workers.speculation.draft_tree import DraftTree
from specserve.workers.speculation.planner.costs import VerifyCosts
from specserve.workers.speculation.planner.tree import TreeCalibration, best_node_count, expected_accepted_by_size

FLAT = VerifyCosts((0.1,) * 17)  # every width costs a step: more nodes never cost more
CPU = VerifyCosts(
    (0.059, 0.1, 0.112, 0.087, 0.083, 0.085, 0.085, 0.085, 0.085, 0.09, 0.09, 0.1, 0.1, 0.1, 0.11, 0.11, 0.117)
)  # fmt: skip  the measured widths 1..17 of SmolLM2 on 2 cores, filled in between


def test_expected_accepted_by_size_sums_the_calibrated_path_probabilities_and_never_exceeds_the_nodes():
    scores = [math.log(p) for p in (0.9, 0.8, 0.5, 0.1)]
    assert expected_accepted_by_size(scores, 1.0) == pytest.approx([0.9, 1.7, 2.2, 2.3])
    assert expected_accepted_by_size(scores, 0.5) == pytest.approx([0.45, 0.85, 1.1, 1.15])
    assert expected_accepted_by_size([0.0, 0.0], 3.0) == [1.0, 2.0]


def test_the_node_count_weighs_expected_tokens_against_the_verify_cost_per_width():
    confident = [math.log(p) for p in [0.9] * 4 + [0.5] * 12]
    assert best_node_count(confident, FLAT, 1.0) == 16  # free widths: verify everything that may be accepted
    assert best_node_count([math.log(0.01)] * 16, CPU, 1.0) == 0  # nothing likely: a plain step is faster
    # on the CPU's widths, 2-3 positions cost more than 4-9: a few likely nodes are verified with more behind them
    assert best_node_count([math.log(0.6)] + [math.log(0.2)] * 15, CPU, 1.0) >= 3
    assert best_node_count(confident, VerifyCosts((0.1, 0.1)), 1.0) == 1  # no more than the widths measured


def test_calibration_moves_from_its_prior_to_what_the_target_accepted():
    calibration = TreeCalibration()
    assert calibration.factor == 0.5
    for _ in range(50):
        calibration.observe(predicted=2.0, accepted=2)
    assert calibration.factor == pytest.approx(1.0, abs=0.02)


def test_pruning_a_tree_keeps_its_best_nodes_with_their_parents_in_depth_order():
    # root -> 0 (-0.1) -> 2 (-0.3) -> 4 (-2.0); root -> 1 (-0.5) -> 3 (-0.6); 0 -> 5 (-0.2)
    tree = DraftTree([10, 11, 12, 13, 14, 15], [ROOT, ROOT, 0, 1, 2, 0], [-0.1, -0.5, -0.3, -0.6, -2.0, -0.2])
    best = tree.best(4)
    assert best.tokens == [10, 11, 12, 15] and best.parents == [ROOT, ROOT, 0, 0]
    assert best.scores == [-0.1, -0.5, -0.3, -0.2] and best.depth == 2
    assert tree.best(0).tokens == [] and tree.best(6).tokens == tree.tokens and tree.depth == 3


def test_a_head_backs_off_after_trees_that_pay_for_nothing_and_free_lookup_trees_never_do():
    from specserve.workers.speculation.planner.tree import TreePruning

    hopeless = DraftTree([10, 11], [ROOT, 0], [math.log(0.01), math.log(0.001)])
    head, lookup = TreePruning(CPU), TreePruning(CPU, costly=False)
    for pruning in (head, lookup):
        assert pruning.wants_tree() and pruning.prune(hopeless) is None  # a plain step this round
    assert not head.wants_tree()  # the head's levels are not spent again at once
    assert lookup.wants_tree()  # the next match may pay, and drafting it costs nothing
    for _ in range(3):
        head.prune(hopeless)
    assert head.backoff == 8 and lookup.backoff == 0
