"""The node count of eagle-tree k='auto' (workers/speculation/planner/tree.py) and pruning a tree to its best nodes."""

import math

import pytest

from specserve.workers.runtime.tree_rows import ROOT
from specserve.workers.speculation.draft_tree import DraftTree
from specserve.workers.speculation.planner.acceptance import expected_accepted
from specserve.workers.speculation.planner.costs import VerifyCosts
from specserve.workers.speculation.planner.tree import (
    TreeCalibration,
    TreeRow,
    best_chain_length,
    best_node_count,
    expected_accepted_by_size,
)

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


def _batch_rate(rows: list[list[float]], counts: list[int], verify: VerifyCosts, fixed_s: float = 0.0) -> float:
    """Expected committed tokens a second of a batch whose rows keep `counts` nodes of trees with these scores."""
    by_size = [expected_accepted_by_size(s, 1.0) for s in rows]
    committed = sum(1.0 + (e[b - 1] if b else 0.0) for e, b in zip(by_size, counts, strict=True))
    return committed / (verify.mean_verify(sum(counts) / len(counts)) + fixed_s)


def test_the_rounds_time_beyond_the_forward_makes_more_nodes_pay():
    scores = [math.log(p) for p in (0.9, 0.7, 0.5, 0.4, 0.3, 0.25, 0.2, 0.15, 0.1)]
    steep = VerifyCosts(tuple(0.05 + 0.01 * w for w in range(17)))
    bare = best_node_count(scores, steep, 1.0)
    assert best_node_count(scores, steep, 1.0, fixed_s=0.05) > bare > 0


def test_a_batchs_trees_share_one_cap_chosen_for_the_packed_forward():
    """One cap for every tree row: the one with the most committed tokens a second for the batch, whose packed
    forward costs its mean width (each row pays for its own nodes), other rows at a set width included."""
    steep = VerifyCosts(tuple(0.05 + 0.01 * w for w in range(17)))  # a batch's forward by its rows' mean width
    confident = [math.log(0.95) * (i + 1) for i in range(16)]
    modest = [math.log(p) for p in (0.6, 0.3, 0.2, 0.1, 0.05)]
    rows = [confident, modest, modest, modest]
    others = [TreeRow(by_size=tuple(expected_accepted_by_size(s, 1.0))) for s in rows[1:]]
    cap = best_node_count(confident, steep, 1.0, others)
    rate = lambda c: _batch_rate(rows, [min(c, len(s)) for s in rows], steep)  # noqa: E731
    assert rate(cap) == pytest.approx(max(rate(c) for c in range(17)))
    # a row at a set width adds its positions and its tokens to the batch's
    chain = TreeRow(width=3, expected=1.5)
    cap = best_node_count(modest, steep, 1.0, [chain])
    with_chain = lambda c: (2.0 + expected_accepted_by_size(modest, 1.0)[c - 1] if c else 1.0) + 1.5  # noqa: E731
    best = max(range(6), key=lambda c: with_chain(c) / steep.mean_verify((c + 3) / 2))
    assert cap == best


def test_a_lookups_continuation_is_verified_only_as_far_as_it_pays_in_its_batch():
    """Alone on a flat cost all of a continuation is verified; beside plain rows in a pass that costs its mean width,
    only the length with the most committed tokens a second for the batch (none for one that never accepts)."""
    steep = VerifyCosts(tuple(0.05 + 0.01 * w for w in range(17)))
    modest, sure, hopeless = (0.4,) + (0.5,) * 5, (0.95,) * 6, (0.05,) * 6
    assert best_chain_length(modest, FLAT) == 6
    plain_rows = [TreeRow(width=0, expected=0.0)] * 3
    rate = lambda b: (4.0 + expected_accepted(modest, b)) / steep.mean_verify(b / 4)  # noqa: E731
    beside = best_chain_length(modest, steep, plain_rows)
    assert beside == max(range(7), key=rate) and 0 < beside < 6
    assert best_chain_length(sure, steep, plain_rows) == 6
    assert best_chain_length(hopeless, steep, plain_rows) == 0


def test_tree_rounds_weigh_their_measured_time_beyond_the_verify():
    from specserve.workers.speculation.planner.round_plan import RoundPlan
    from specserve.workers.speculation.planner.tree import RoundOverhead

    overhead = RoundOverhead()
    assert overhead.seconds == 0.0
    overhead.observe(0.02)
    assert overhead.seconds == pytest.approx(0.02)  # the first round is the estimate
    overhead.observe(0.04)
    assert 0.02 < overhead.seconds < 0.04
    from specserve.workers.speculation.round_drafting import TreeRounds

    class Head:  # TreeRounds only calls the drafter in propose_tree, which this does not reach
        pass

    rounds = TreeRounds(Head(), None, CPU)
    rounds.took(RoundPlan(nodes=16), 0.03, steady=False)  # the head's catch-up over the prompt: not a round's cost
    rounds.took(RoundPlan(), 0.03, steady=True)  # a plain step drafted nothing
    assert rounds.overhead.rounds == 0
    rounds.took(RoundPlan(nodes=16), 0.03, steady=True)
    assert rounds.overhead.seconds == pytest.approx(0.03)


def test_beside_a_prompts_chunk_a_node_pays_only_where_it_commits_more_than_the_chunks_positions_it_displaces():
    """A chunk's positions count as the pass's tokens (ChunkBeside): the cap is the one with the most tokens a second
    of chunk and trees together, never more nodes than without the chunk, and fewer beside a chunk whose positions
    are cheap (shallow in its prompt) than beside one whose positions are dear (deep)."""
    from specserve.workers.speculation.planner.costs import ChunkBeside

    steep = VerifyCosts(tuple(0.05 + 0.003 * w for w in range(17)))  # 3 ms a drafted position, as a CPU batch's
    scores = [math.log(p) for p in (0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.25, 0.2, 0.15, 0.1, 0.08)]
    alone = best_node_count(scores, steep, 1.0)
    shallow, deep = ChunkBeside(64, 64 * 0.003), ChunkBeside(64, 64 * 0.006)
    beside_shallow = best_node_count(scores, steep, 1.0, beside=shallow)
    beside_deep = best_node_count(scores, steep, 1.0, beside=deep)
    assert 0 < beside_shallow < beside_deep < alone
    by_size = expected_accepted_by_size(scores, 1.0)
    rate = lambda b, c: (1 + (by_size[b - 1] if b else 0) + c.positions) / (steep.verify(b) + c.seconds)  # noqa: E731
    for chunk, cap in ((shallow, beside_shallow), (deep, beside_deep)):
        assert rate(cap, chunk) == pytest.approx(max(rate(b, chunk) for b in range(len(scores) + 1)))


def test_a_tree_that_loses_to_a_prompts_chunk_does_not_back_the_head_off():
    """Beside a chunk a head's tree may pay for no node this round; the prefill ends soon and the trees pay again
    then, so the head drafts the next round (backing off is for trees that pay for nothing on their own)."""
    from specserve.workers.speculation.planner.costs import ChunkBeside
    from specserve.workers.speculation.planner.tree import TreePruning

    modest = DraftTree([10, 11], [ROOT, 0], [math.log(0.3), math.log(0.1)])
    head = TreePruning(VerifyCosts(tuple(0.05 + 0.003 * w for w in range(17))))
    assert head.prune(modest) is not None  # alone its first node pays
    assert head.prune(modest, beside=ChunkBeside(128, 128 * 0.002)) is None  # beside a cheap chunk, none does
    assert head.backoff == 0 and head.wants_tree()


def test_before_drafting_beside_a_chunk_a_tree_is_judged_as_its_latest_would_be_pruned():
    """`pays_beside` asks, before the head drafts, what `prune` would answer for a tree like the latest one beside
    the same chunk (no node kept, no drafting), and whether that round beats a plain one with its drafting counted.
    Nothing drafted yet: nothing to judge by, so it drafts."""
    from specserve.workers.speculation.planner.costs import ChunkBeside
    from specserve.workers.speculation.planner.tree import TreePruning

    steep = VerifyCosts(tuple(0.05 + 0.003 * w for w in range(17)))
    modest = DraftTree([10, 11], [ROOT, 0], [math.log(0.3), math.log(0.1)])
    cheap, dear = ChunkBeside(128, 128 * 0.002), ChunkBeside(16, 16 * 0.05)
    head = TreePruning(steep)
    assert head.pays_beside((), 0.0, cheap)  # no tree yet
    head.prune(modest)
    answers = {}
    for chunk in (cheap, dear):
        answers[chunk] = head.pays_beside((), 0.0, chunk)
        assert answers[chunk] == (TreePruning(steep).prune(modest, beside=chunk) is not None)
    assert answers == {cheap: False, dear: True}
    # A tree that keeps a node but whose round, its drafting counted, commits less a second than a plain round's
    # beside the chunk is not drafted either: the drafting is not spent yet.
    assert head.pays_beside((), 0.0, dear, plain_s=0.0)
    assert not head.pays_beside((), 0.2, dear, plain_s=0.0)
    assert TreePruning(steep).prune(modest, fixed_s=0.2, beside=dear) is not None  # spent, it would be verified
    lookup = TreePruning(steep, costly=False)  # a lookup's trees cost nothing to draft: they are not remembered
    lookup.prune(modest)
    assert not lookup.recent.scores


def test_a_head_whose_trees_lose_to_plain_steps_backs_off_for_as_long_as_keeps_a_probe_cheap():
    """The drafting is spent once a tree is drafted, so its best nodes are still verified; but a tree round that
    commits less a second than plain rounds would backs the head off, for as many plain rounds as keep the next
    probe's loss within PROBE_SHARE of their time (the H200's eager bf16 head: 13 ms a token beside a 4 ms step)."""
    from specserve.workers.speculation.planner.tree import (
        MAX_LOSING_ROUNDS,
        MAX_PLAIN_ROUNDS,
        PROBE_SHARE,
        TreePruning,
    )

    gpu = VerifyCosts((0.004,) * 17)  # a graphed step: flat in width
    good = DraftTree([10, 11, 12], [ROOT, 0, 1], [math.log(0.9), math.log(0.8), math.log(0.7)])
    slow = TreePruning(gpu)
    slow.calibration = TreeCalibration(predicted=1.0, accepted=1.0)  # the head's probabilities at their word
    kept = slow.prune(good, fixed_s=0.040, plain_s=0.001)  # 3 levels of 13 ms against a 1 ms plain overhead
    assert kept is not None and kept.tokens == good.tokens  # verified: its drafting is already paid
    tokens = 1 + 0.9 + 0.8 + 0.7  # what this round commits, expected
    plain_round = 0.004 + 0.001
    loss = (0.004 + 0.040) - tokens * plain_round  # its seconds less what plain rounds take for as many tokens
    assert slow.backoff == math.ceil(loss / (PROBE_SHARE * plain_round)) > MAX_PLAIN_ROUNDS
    assert not any(slow.wants_tree() for _ in range(slow.backoff)) and slow.wants_tree()  # then a probe
    slow.prune(good, fixed_s=0.040, plain_s=0.001)  # the probe lost again: twice as long, at most the cap
    assert slow.backoff == min(MAX_LOSING_ROUNDS, 2 * math.ceil(loss / (PROBE_SHARE * plain_round)))
    # A cheap head's tree pays, and nothing is compared where no plain round was measured (plain_s None)
    cheap = TreePruning(gpu, calibration=TreeCalibration(predicted=1.0, accepted=1.0))
    assert cheap.prune(good, fixed_s=0.002, plain_s=0.001) is not None and cheap.backoff == 0
    unknown = TreePruning(gpu, calibration=TreeCalibration(predicted=1.0, accepted=1.0))
    assert unknown.prune(good, fixed_s=0.040, plain_s=None) is not None and unknown.backoff == 0
    # prompt lookup's trees cost nothing to draft: never backed off
    lookup = TreePruning(gpu, costly=False, calibration=TreeCalibration(predicted=1.0, accepted=1.0))
    lookup.prune(good, fixed_s=0.040, plain_s=0.001)
    assert lookup.backoff == 0 and lookup.wants_tree()


def test_tree_rounds_measure_their_plain_rounds_apart():
    from specserve.workers.speculation.planner.round_plan import RoundPlan
    from specserve.workers.speculation.round_drafting import TreeRounds

    class Head:  # TreeRounds only calls the drafter in propose_tree, which this does not reach
        pass

    rounds = TreeRounds(Head(), None, CPU)
    rounds.took(RoundPlan(), 0.002, steady=False)  # the prompt's round
    assert rounds.plain_overhead.rounds == 0
    rounds.took(RoundPlan(), 0.002, steady=True)
    rounds.took(RoundPlan(nodes=16), 0.03, steady=True)
    assert rounds.plain_overhead.seconds == pytest.approx(0.002) and rounds.overhead.seconds == pytest.approx(0.03)


def test_drafting_a_tree_is_judged_with_the_batchs_backed_off_rows_drafting_too():
    """Whether the head's trees pay is the batch's question: beside rows that back off, a tree round pays the
    drafting for one row's tokens; with every row drafting (those backed off as their recent trees were), for all
    of theirs. A plain row beside another's tree waits for its drafting all the same."""
    from specserve.workers.speculation.planner.tree import RecentTrees, TreePruning

    tree = DraftTree([10, 11, 12, 13], [ROOT, 0, 1, 2], [math.log(0.5)] * 4)
    backed_off = [TreeRow()] * 3  # plain rows now
    drafting = [TreeRow(width=4.0, expected=1.0)] * 3  # as their recent trees were verified

    def judged(others_drafting):
        head = TreePruning(FLAT, recent=RecentTrees(accepted=1.0, width=4.0))
        head.prune(tree, backed_off, fixed_s=0.05, plain_s=0.0, others_drafting=others_drafting)
        return head.backoff

    # one row's 2 tokens and three plain ones in 0.15 s lose to four plain rows' 4 tokens in 0.1 s
    assert judged(None) > 0
    # every row's 2 tokens in 0.15 s win
    assert judged(drafting) == 0
