"""Draft trees in the disaggregated path (method "eagle-tree"): the head's draft worker builds each round's tree and
sends it in the propose reply (tokens, parents, path scores); the target worker verifies it in one forward and answers
with the accepted path. Greedy requests are identical to target-only beside chain requests in the same batches, with
k fixed and 'auto', through forgetful and dead draft workers; sampling draws from the target's distribution; the
scheduler prunes 'auto' trees by the measured verify costs and to the load cap; the serving path takes the method."""

import asyncio

import pytest
import torch

from specserve.cluster.scheduling.scheduler import Scheduler
from specserve.workers.config.request import SamplingParams, SpecParams
from specserve.workers.runtime.tree_rows import ROOT
from specserve.workers.service.results import ProposeResult, VerifyResult
from specserve.workers.speculation.codec import feature_block
from specserve.workers.speculation.draft_tree import DraftTree
from specserve.workers.speculation.planner.batch import BatchWidth
from specserve.workers.speculation.planner.costs import DraftCost, PlannerCosts, VerifyCosts
from specserve.workers.speculation.planner.tree import MAX_TREE_NODES
from tests.helpers.eagle_disaggregated import (
    BYTE_PROMPTS,
    app_with,
    assert_all_released,
    build_pairs,
    greedy,
    prompts_of,
    run_the_serving_path,
    sample_disaggregated,
    until,
)
from tests.helpers.greedy_oracle import own_greedy_loop
from tests.helpers.marks import slow_unless
from tests.helpers.pipelines import generate_all
from tests.helpers.sampling_oracle import NEW, assert_target_distribution
from tests.helpers.workers import LocalWorkers


@pytest.fixture(scope="module")
def pairs(tmp_path_factory, device) -> dict:
    return build_pairs(tmp_path_factory.mktemp("tree_pairs"), device)


def run(target, head_dir: str, requests, faults=None, reconnect_to=None) -> tuple[list, object]:
    async def main():
        async with LocalWorkers(target, [], n_targets=2, eagle_head=head_dir, eagle_drafts=2) as w:
            trees = []
            for worker in w.drafts.values():  # every tree call a draft worker answered: (nodes asked, nodes drafted)
                batch = worker.propose_batch
                worker.propose_batch = lambda calls, batch=batch: _record(trees, calls, batch(calls))
            during = (lambda pipeline: faults(w, pipeline)) if faults else None
            results, pipeline = await generate_all(w, requests, during=during)
            live = [worker for name, worker in w.built.items() if name not in pipeline.scheduler.unhealthy]
            assert all(len(worker.worker.committed) == 0 for worker in live)  # every request released
            if not faults:
                assert_all_released(w)
            return results, pipeline, trees

    return asyncio.run(main())


def _record(trees: list, calls, results):
    trees += [
        (c.k, len(r.drafted)) for c, r in zip(calls, results, strict=True) if c.tree and isinstance(r, ProposeResult)
    ]
    return results


@pytest.mark.parametrize("pair_name", slow_unless(["byte", "tiny_vocab"], ["tiny_vocab"]))  # byte: in CI
def test_concurrent_greedy_tree_requests_are_identical_to_target_only(pairs, pair_name):
    """Trees of 2, 4 and 8 nodes and 'auto' (16 drafted, pruned by the workers' measured costs), beside head chains
    and target-only requests in the same draft and target batches."""
    target, head_dir = pairs[pair_name]
    prompts = prompts_of(target, pair_name)
    requests = [(ids, *greedy(12 + 4 * i, "eagle-tree", k)) for i, ids in enumerate(prompts) for k in (2, 4, 8, "auto")]
    requests += [(ids, *greedy(16, method)) for ids in prompts[:2] for method in ("eagle", "none")]
    requests += [(ids, *greedy(20, "ngram-tree", k)) for ids in prompts for k in (4, "auto")]

    results, pipeline, trees = run(target, head_dir, requests)
    for (ids, params, _), result in zip(requests, results, strict=True):
        assert result.state.generated == own_greedy_loop(target.model, ids, params.max_new_tokens, set())
    assert sum(r.state.stats.drafted for r in results if r.spec.method == "ngram-tree") > 0  # no draft call
    fixed = [r for r in results if r.spec.method == "eagle-tree" and r.spec.k != "auto"]
    assert all(r.state.stats.drafted > 0 for r in fixed)
    for r in fixed:  # every round after the prefill drafted a tree of k nodes (the last one may be cut short)
        assert r.state.stats.drafted <= r.spec.k * (r.state.stats.rounds - 1)
    assert {asked for asked, _ in trees} == {2, 4, 8, MAX_TREE_NODES}
    assert all(0 < drafted <= asked for asked, drafted in trees)  # less where the head's paths grow unlikely
    accepted = sum(r.state.stats.accepted for r in fixed)
    assert accepted > 0 or pair_name == "byte"
    assert pipeline.scheduler.planner_costs is not None  # 'auto' asked the workers for their costs
    assert len(pipeline.scheduler.planner_costs.verify.profile.seconds[0]) == MAX_TREE_NODES + 1  # one row


def test_forgetful_and_dead_draft_workers_change_no_output(pairs):
    """The head's draft workers forget every request (NOT_FOUND: re-sent with the undelivered features), then one
    dies: its requests go on with the other, outputs identical."""
    target, head_dir = pairs["byte"]
    requests = [(ids, *greedy(40, "eagle-tree", 4)) for ids in prompts_of(target, "byte")]

    async def faults(w, pipeline):
        for _ in range(2):
            await until(lambda: pipeline.scheduler.feature_traffic.proposes >= 4, timeout_s=20)
            for name in ("draft-0", "draft-1"):
                for rid in w.drafts[name].committed.least_recent():
                    await pipeline.drafts[name].release(rid)
            await asyncio.sleep(0.02)
        await w.stop("draft-0")

    results, pipeline, _ = run(target, head_dir, requests, faults=faults)
    for (ids, params, _), result in zip(requests, results, strict=True):
        assert result.state.generated == own_greedy_loop(target.model, ids, params.max_new_tokens, set())
    assert sum(r.resent for r in results) > 0 and "draft-0" in pipeline.scheduler.unhealthy


@pytest.mark.parametrize("pair_name", slow_unless(["byte", "tiny_vocab"], ["tiny_vocab"]))  # byte: in CI
def test_head_trees_beside_lookups_are_identical_to_target_only(pairs, pair_name):
    """eagle-tree+ngram: each round the head's tree or, where it is expected to accept more, prompt lookup's or
    suffix drafting's continuation verified as a chain-shaped tree with no draft call; prompts that repeat themselves
    give the lookups rounds, fixed k and 'auto' alike."""
    target, head_dir = pairs[pair_name]
    prompts = [ids * 3 for ids in prompts_of(target, pair_name)]  # repeats: the lookup finds long matches
    requests = [(ids, *greedy(24, "eagle-tree+ngram", k)) for ids in prompts for k in (4, "auto")]
    results, _, trees = run(target, head_dir, requests)
    for (ids, params, _), result in zip(requests, results, strict=True):
        assert result.state.generated == own_greedy_loop(target.model, ids, params.max_new_tokens, set())
    lookups = [s for r in results for s in (*r.planner.by_match.values(), *r.planner.by_suffix_match.values())]
    assert sum(s.reached[0] for s in lookups if s.reached) > 0 and trees  # lookup rounds and the head's trees


@pytest.mark.slow
@pytest.mark.parametrize("method", ["eagle-tree", "eagle-tree+ngram"])
def test_sampled_trees_through_the_workers_match_the_targets_distribution(pairs, method):
    """2,000 seeded requests with trees of 4 nodes (2 candidates a level), top-p truncating: the chi-square test of
    tests/workers/speculation/test_engine_sampling.py against the exact joint of the next 3 tokens."""
    target, head_dir = pairs["tiny_vocab"]
    samples = 2000
    params = SamplingParams(temperature=1.0, top_p=0.8, max_new_tokens=NEW, stop_at_eos=False)
    results = sample_disaggregated(target, head_dir, params, SpecParams(method=method, k=4), samples)
    assert sum(r.state.stats.accepted for r in results) > 0.2 * samples
    assert_target_distribution([tuple(r.state.generated) for r in results], target.model, params, max_tv=0.04)


@pytest.mark.parametrize("method", ["eagle-tree", "ngram-tree"])
def test_a_tree_request_runs_through_the_serving_path(pairs, method):
    """The ingress's preparer takes "eagle-tree" for a model served with a head, "ngram-tree" for any; greedy output
    identical."""
    target, head_dir = pairs["byte"]
    app = app_with(target.path, head_dir)
    run_ = run_the_serving_path(app, BYTE_PROMPTS[2], 24, {"method": method, "k": 4})
    assert run_.prepared.spec.method == method
    assert run_.out["token_ids"] == own_greedy_loop(target.model, run_.prepared.prompt_ids, 24, {2})
    assert run_.out["stats"]["drafted"] > 0


# -- the scheduler alone ---------------------------------------------------------------------------------------------


def _features(start: int, rows: int) -> bytes:
    return feature_block(start, torch.zeros(rows, 6)).encode()


def _tree(nodes: int) -> DraftTree:
    """A chain of `nodes` whose path scores fall by 0.1 nats a node, i.e. likely."""
    return DraftTree(
        list(range(10, 10 + nodes)), [ROOT] + list(range(nodes - 1)), [-0.1 * (i + 1) for i in range(nodes)]
    )


def test_the_scheduler_sizes_trees_by_k_costs_and_load():
    s = Scheduler(["d"], ["t", "u"])  # one target worker each: neither pads the other's verify batch
    fixed = s.add([1, 2, 3], SamplingParams(max_new_tokens=30), SpecParams(method="eagle-tree", k=5), frozenset())
    auto = s.add([1, 2, 3], SamplingParams(max_new_tokens=30), SpecParams(method="eagle-tree", k="auto"), frozenset())
    assert s.wants_costs(auto) and not s.wants_costs(fixed)
    assert s.plan_round(fixed).k == s.plan_round(auto).k == 0  # no features before the prefill: a plain step
    for req in (fixed, auto):
        verify = s.plan_verify(req, [], b"")
        assert verify.want_features and verify.parents is None
        assert s.apply_round(req, req.round, VerifyResult(0, 7, features=_features(0, 3), path=[])) == [7]
    assert s.plan_round(fixed).k == 5 and s.plan_round(auto).k == MAX_TREE_NODES
    draft = s.plan_draft(fixed, 5)
    assert draft.tree and draft.k == 5 and draft.features
    s.drafted(fixed, draft)
    tree = s.prune_tree(fixed, _tree(5))
    assert tree == _tree(5)  # a fixed k verifies the whole tree
    verify = s.plan_verify(fixed, tree.tokens, b"", tree.parents)
    assert verify.parents == tree.parents and verify.drafted == tree.tokens
    reply = VerifyResult(2, 99, features=_features(3, 3), path=[0, 1])
    assert s.apply_round(fixed, fixed.round, reply, tree=tree) == [10, 11, 99]
    assert fixed.state.stats.drafted == 5 and fixed.state.stats.accepted == 2
    assert s.plan_round(fixed).k == 5

    # every width costs the same: every likely node pays
    s.planner_costs = PlannerCosts(VerifyCosts((0.1,) * (MAX_TREE_NODES + 1)), DraftCost(step_s=0.01, fixed_s=0.01))
    assert s.plan_round(auto).k == MAX_TREE_NODES
    assert len(s.prune_tree(auto, _tree(MAX_TREE_NODES)).tokens) == MAX_TREE_NODES
    # a verify that costs more with every node: no node pays, and plain steps follow before the next tree
    s.planner_costs = PlannerCosts(VerifyCosts(tuple(0.1 * w for w in range(1, MAX_TREE_NODES + 2))), DraftCost())
    auto.pruning = None
    assert s.plan_round(auto).k == MAX_TREE_NODES and s.prune_tree(auto, _tree(MAX_TREE_NODES)) is None
    assert s.plan_round(auto).k == 0 and s.plan_round(fixed).k == 5  # a fixed k is what the request asked for
    assert s.plan_round(auto).k == MAX_TREE_NODES and s.prune_tree(auto, _tree(MAX_TREE_NODES)) is None
    assert [s.plan_round(auto).k for _ in range(3)] == [0, 0, MAX_TREE_NODES]  # backing off: 1, then 2 plain rounds
    assert fixed.target_worker != auto.target_worker


def test_a_tree_is_pruned_for_its_target_workers_packed_batch():
    """Alone no node pays against a steep verify cost; beside a fixed-k row the packed forward's cost is the rows'
    mean width, so some do (the forward is shared); the round's time beyond the forward makes more pay."""
    s = Scheduler(["d"], ["t"])
    steep = VerifyCosts(tuple(0.1 * w for w in range(1, MAX_TREE_NODES + 2)))  # every node costs another step
    s.planner_costs = PlannerCosts(steep, DraftCost())
    auto = s.add([1, 2, 3], SamplingParams(max_new_tokens=30), SpecParams(method="eagle-tree", k="auto"), frozenset())
    s.apply_round(auto, auto.round, VerifyResult(0, 7, features=_features(0, 3), path=[]))
    assert s.plan_round(auto).k == MAX_TREE_NODES and s.prune_tree(auto, _tree(MAX_TREE_NODES)) is None  # alone
    fixed = s.add([4, 5, 6], SamplingParams(max_new_tokens=30), SpecParams(method="eagle-tree", k=5), frozenset())
    s.apply_round(fixed, fixed.round, VerifyResult(0, 8, features=_features(0, 3), path=[]))
    assert s.plan_round(fixed).k == 5
    auto.pruning.plain_rounds = 0
    assert s.plan_round(auto).k == MAX_TREE_NODES
    beside = len(s.prune_tree(auto, _tree(MAX_TREE_NODES)).tokens)
    assert 0 < beside < MAX_TREE_NODES
    # the round's time beyond the forward, measured (the head's drafting, the hops), makes more nodes pay
    s.release(fixed)
    s.batches["t"].tree_overhead.observe(1.0)
    assert s.plan_round(auto).k == MAX_TREE_NODES and len(s.prune_tree(auto, _tree(MAX_TREE_NODES)).tokens) > beside


def test_the_scheduler_weighs_drafting_a_tree_against_its_plain_rounds():
    """A head's plain rounds are measured apart from its tree rounds; a tree round that commits less a second than
    plain ones would (the H200's eager bf16 head: 40 ms of drafting beside a 4 ms step) backs the head off for many
    plain rounds, its tree still verified."""
    s = Scheduler(["d"], ["t"])
    s.planner_costs = PlannerCosts(VerifyCosts((0.004,) * (MAX_TREE_NODES + 1)), DraftCost())
    auto = s.add([1, 2, 3], SamplingParams(max_new_tokens=300), SpecParams(method="eagle-tree", k="auto"), frozenset())
    s.apply_round(auto, auto.round, VerifyResult(0, 7, features=_features(0, 3), path=[]))
    auto.pruning = None
    s.plan_round(auto)  # builds the request's pruning
    auto.pruning.plain_rounds = 1
    assert s.plan_round(auto).k == 0  # a plain round: measured apart
    reply = VerifyResult(0, 8, features=_features(3, 1), path=[], batch_seconds=0.004)
    s.apply_round(auto, auto.round, reply, round_s=0.005)
    batch = s.batches["t"]
    assert batch.plain_overhead.seconds == pytest.approx(0.001) and batch.tree_overhead.rounds == 0
    batch.tree_overhead.observe(0.040)
    assert s.plan_round(auto).k == MAX_TREE_NODES
    assert s.prune_tree(auto, _tree(8)) is not None  # drafted already: its best nodes are verified
    assert auto.pruning.backoff > 16 and [s.plan_round(auto).k for _ in range(16)] == [0] * 16
    assert batch.summary()["plain_overhead_ms"] == pytest.approx(1.0)


def test_a_workers_head_trees_back_off_together():
    """A tree that loses to plain rounds backs off every head tree of its target worker for as long (a plain row
    beside another's tree would wait for its drafting all the same); a fixed k and another worker's are untouched."""
    s = Scheduler(["d"], ["t", "u"])
    s.planner_costs = PlannerCosts(VerifyCosts((0.004,) * (MAX_TREE_NODES + 1)), DraftCost())
    params = SamplingParams(max_new_tokens=300)
    reqs = [s.add([1, 2, 3], params, SpecParams(method="eagle-tree", k=k), frozenset()) for k in ("auto",) * 3 + (5,)]
    for r in reqs:  # placed on both workers by load: all on one
        r.target_worker = "t"
    other_worker = s.add([1, 2, 3], params, SpecParams(method="eagle-tree", k="auto"), frozenset())
    other_worker.target_worker = "u"
    for r in (*reqs, other_worker):
        s.apply_round(r, r.round, VerifyResult(0, 7, features=_features(0, 3), path=[]))
        assert s.plan_round(r).k == (5 if r.spec.k == 5 else MAX_TREE_NODES)
    s.batches.setdefault("t", BatchWidth()).plain_overhead.observe(0.001)
    s.batches["t"].tree_overhead.observe(0.040)  # 40 ms of drafting beside a 4 ms step: trees lose
    first, *rest, fixed = reqs
    assert s.prune_tree(first, _tree(8)) is not None and first.pruning.plain_rounds > 16
    assert all(r.pruning.plain_rounds == first.pruning.plain_rounds for r in rest)
    assert [s.plan_round(r).k for r in rest] == [0, 0] and s.plan_round(fixed).k == 5
    assert other_worker.pruning.plain_rounds == 0 and s.plan_round(other_worker).k == MAX_TREE_NODES


def test_a_new_request_joins_its_workers_backoff():
    """A head-tree request that arrives while its worker's trees are backed off starts backed off too (its first
    tree would hold every plain row's pass for its drafting); on another worker it drafts its tree."""
    s = Scheduler(["d"], ["t", "u"])
    s.planner_costs = PlannerCosts(VerifyCosts((0.004,) * (MAX_TREE_NODES + 1)), DraftCost())
    params, spec = SamplingParams(max_new_tokens=300), SpecParams(method="eagle-tree", k="auto")
    first = s.add([1, 2, 3], params, spec, frozenset())
    first.target_worker = "t"
    s.apply_round(first, first.round, VerifyResult(0, 7, features=_features(0, 3), path=[]))
    assert s.plan_round(first).k == MAX_TREE_NODES
    s.batches["t"].plain_overhead.observe(0.001)
    s.batches["t"].tree_overhead.observe(0.040)
    assert s.prune_tree(first, _tree(8)) is not None and first.pruning.plain_rounds > 16
    later, elsewhere = (s.add([4, 5, 6], params, spec, frozenset()) for _ in range(2))
    later.target_worker, elsewhere.target_worker = "t", "u"
    for r in (later, elsewhere):
        s.apply_round(r, r.round, VerifyResult(0, 7, features=_features(0, 3), path=[]))
    assert s.plan_round(later).k == 0 and later.pruning.plain_rounds == first.pruning.plain_rounds - 1
    assert s.plan_round(elsewhere).k == MAX_TREE_NODES


def test_a_heads_trees_are_judged_by_every_request_of_the_worker():
    """A request's tree record starts from its worker's recent trees (a short request's own first tree, pruned to
    nothing, once left it judged at 0 accepted for the rest of its life); another worker's is its own."""
    s = Scheduler(["d"], ["t", "u"])
    s.planner_costs = PlannerCosts(VerifyCosts((0.1,) * (MAX_TREE_NODES + 1)), DraftCost())
    params, spec = SamplingParams(max_new_tokens=300), SpecParams(method="eagle-tree", k="auto")
    first = s.add([1, 2, 3], params, spec, frozenset())
    s.apply_round(first, first.round, VerifyResult(0, 7, features=_features(0, 3), path=[]))
    assert s.plan_round(first).k == MAX_TREE_NODES
    s.drafted(first, s.plan_draft(first, MAX_TREE_NODES))
    tree = s.prune_tree(first, _tree(MAX_TREE_NODES))
    s.plan_verify(first, tree.tokens, b"", tree.parents)
    s.apply_round(first, first.round, VerifyResult(3, 99, features=_features(3, 4), path=[0, 1, 2]), tree=tree)
    assert first.pruning.recent.accepted == 3 and first.pruning.recent.width == len(tree.tokens)
    later = s.add([4, 5, 6], params, spec, frozenset())
    later.target_worker = first.target_worker
    elsewhere = s.add([4, 5, 6], params, spec, frozenset())
    elsewhere.target_worker = "u" if first.target_worker == "t" else "t"
    for r in (later, elsewhere):
        s.apply_round(r, r.round, VerifyResult(0, 7, features=_features(0, 3), path=[]))
        assert s.plan_round(r).k == MAX_TREE_NODES
    assert later.pruning.recent.accepted == 3 and elsewhere.pruning.recent.accepted is None
