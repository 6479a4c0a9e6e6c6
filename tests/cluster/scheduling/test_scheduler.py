"""The scheduler's worker membership alone (CPU-only state machine, no I/O): workers joining and leaving a pool,
requests moving off a worker that left, re-attaching to a draft worker that came back, stranded requests."""

import math

import pytest

from specserve.cluster.scheduling.sched_request import SchedRequest
from specserve.cluster.scheduling.scheduler import NoTargetWorker, Scheduler
from specserve.workers.config.request import SamplingParams, SpecParams
from specserve.workers.service.results import VerifyResult
from specserve.workers.speculation.planner.acceptance import PositionAcceptance
from specserve.workers.speculation.planner.costs import DraftCost, PlannerCosts, VerifyCosts
from specserve.workers.speculation.planner.round_plan import PLAIN, RoundPlan
from specserve.workers.speculation.planner.tree import TreePruning
from tests.helpers.cost_surfaces import cpu_surface

PARAMS, SPEC = SamplingParams(max_new_tokens=8), SpecParams(method="draft", k=2)


def test_workers_join_and_requests_spread_over_them():
    s = Scheduler([], [])
    with pytest.raises(NoTargetWorker):
        s.add([1, 2], PARAMS, SPEC, frozenset())
    s.add_worker("target", "t1")
    s.add_worker("target", "t2")
    s.add_worker("draft", "d1")
    a, b = (s.add([1, 2], PARAMS, SPEC, frozenset()) for _ in range(2))
    assert {a.target_worker, b.target_worker} == {"t1", "t2"} and a.draft_worker == b.draft_worker == "d1"


def test_a_worker_that_leaves_hands_its_requests_over_and_told_state_is_dropped():
    s = Scheduler(["d1"], ["t1", "t2"])
    req = s.add([1, 2, 3], PARAMS, SPEC, frozenset())
    call = s.plan_verify(req, [], b"")
    assert req.told[call.worker] == [1, 2, 3]
    s.remove_worker(call.worker)
    assert req.target_worker != call.worker and call.worker not in req.told
    assert s.healthy("target") == [req.target_worker]


def test_a_call_in_flight_when_its_worker_is_replaced_resends_its_whole_sequence():
    """A restart elsewhere clears what the scheduler told the worker while this call is on the wire; the fresh worker
    answers "lost", and the re-sent call still carries the whole sequence the call was planned on."""
    s = Scheduler(["d1"], ["t1"])
    req = s.add([1, 2, 3], PARAMS, SPEC, frozenset())
    s.plan_verify(req, [], b"")
    req.state.commit_round([], 0, 4)
    call = s.plan_verify(req, [], b"")
    assert call.new_tokens == [4] and call.committed_len == 4
    s.forget_worker("t1")
    again = s.resend(req, call)
    assert again.new_tokens == [1, 2, 3, 4] and again.committed_len == 4 and req.told["t1"] == [1, 2, 3, 4]


def test_requests_reattach_to_a_draft_worker_that_joins_later():
    s = Scheduler(["d1"], ["t1"])
    req = s.add([1, 2], PARAMS, SPEC, frozenset())
    s.remove_worker("d1")
    assert req.draft_worker is None and s.plan_round(req).k == 0  # target-only rounds meanwhile
    s.add_worker("draft", "d2")
    assert s.plan_round(req).k == 2 and req.draft_worker == "d2"


def test_a_request_whose_only_target_fails_is_stranded():
    s = Scheduler([], ["t1"])
    req = s.add([1, 2], PARAMS, SpecParams(method="none"), frozenset())
    s.mark_unhealthy("t1")
    assert s.stranded(req)
    s.add_worker("target", "t1")  # the same worker came back
    assert not s.stranded(req)


def test_goodput_planning_drafts_alone_stops_under_load_and_resumes_when_it_drops():
    """k='auto' on a CPU-like target (batching nearly free, each verified position dearer): a weak drafter pays for
    one request; with 16 on the same target worker no chain pays, every request runs plain steps (a fixed-k request
    keeps its k); once the load is gone the remaining request drafts again (no state stuck 'off')."""
    s = Scheduler(["d1"], ["t1"])
    s.planner_costs = PlannerCosts(cpu_surface(), draft=DraftCost(step_s=0.003, fixed_s=0.002))
    params, auto = SamplingParams(max_new_tokens=50), SpecParams(method="draft", k="auto")

    def weak() -> SchedRequest:
        req = s.add([1, 2], params, auto, frozenset())
        req.planner.draft = PositionAcceptance((0.2, 0.3))
        return req

    first = weak()
    assert s.plan_round(first).k > 0
    crowd = [weak() for _ in range(15)]
    for req in crowd:
        s.plan_round(req)  # every row's choice is known before the batch is planned again
    assert [s.plan_round(req).k for req in [first, *crowd]] == [0] * 16
    fixed = s.add([1, 2], params, SpecParams(method="draft", k=5), frozenset())
    assert s.plan_round(fixed).k == 5
    for req in [*crowd, fixed]:
        s.release(req)
    assert s.plan_round(first).k > 0


def test_drafting_rounds_that_take_longer_than_planned_turn_a_workers_batches_plain():
    """Four requests whose drafter pays on paper. Their rounds' wall times go back to the scheduler with each verify:
    drafting rounds at three times their plan (as when drafting splits a worker's requests across forward passes),
    then plain rounds at their plan. The worker's batches go plain; the prefill round's time is not counted."""
    s = Scheduler(["d1"], ["t1"])
    s.planner_costs = PlannerCosts(cpu_surface(), draft=DraftCost(step_s=0.003, fixed_s=0.002))
    params, auto = SamplingParams(max_new_tokens=200), SpecParams(method="draft", k="auto")
    reqs = [s.add([1, 2], params, auto, frozenset()) for _ in range(4)]
    for req in reqs:
        req.planner.draft = PositionAcceptance((0.6, 0.5))
    for req in reqs:
        s.plan_round(req)
    assert [s.plan_round(req).k for req in reqs] == [s.plan_round(reqs[0]).k] * 4 and s.plan_round(reqs[0]).k > 0
    first = reqs[0]
    s.apply_round(first, first.round, VerifyResult(0, 9), [], round_s=100.0)  # a prefill round: its time tells nothing
    assert s.batches["t1"].realized.factor(True, 4) == 1.0 == s.batches["t1"].realized.factor(False, 4)
    for _ in range(20):
        for req in reqs:
            k = s.plan_round(req).k
            planned = s.batches["t1"].forecast.seconds
            s.apply_round(req, req.round, VerifyResult(0, 9), [3] * k, round_s=3 * planned if k else planned)
    assert [s.plan_round(req).k for req in reqs] == [0] * 4
    summary = s.batches["t1"].summary()  # what the scheduler replica's status shows
    assert summary["width"] == 0 and summary["requests"] == 4
    assert summary["features_paused"]  # plain for more than 8 re-plans: a head's chains would stop asking for them
    assert summary["slowdown_drafting"] > 1.2 and summary["slowdown_plain"] == pytest.approx(1.0)
    # Plain rounds at their plan relax the drafting slowdown back towards the plan: the worker drafts again (and
    # measures again) rather than believing a few disturbed rounds for ever.
    for rounds in range(1, 400):
        req = reqs[rounds % 4]
        k = s.plan_round(req).k
        if k:
            break
        s.apply_round(req, req.round, VerifyResult(0, 9), [], round_s=s.batches["t1"].forecast.seconds)
    assert k > 0 and rounds < 200


def test_a_requests_first_drafting_round_is_its_drafters_catch_up_and_not_counted():
    """The first round a request drafts in also brings its drafter up to the prompt (a head's extension over the
    prompt's features, a draft model's prefill): its wall time says nothing of steady drafting rounds. One such round
    at five times its plan leaves the worker's drafting slowdown at the plan, and its batches drafting."""
    s = Scheduler(["d1"], ["t1"])
    s.planner_costs = PlannerCosts(cpu_surface(), draft=DraftCost(step_s=0.003, fixed_s=0.002))
    params, auto = SamplingParams(max_new_tokens=200), SpecParams(method="draft", k="auto")
    req = s.add([1, 2], params, auto, frozenset())
    req.planner.draft = PositionAcceptance((0.6, 0.5))
    s.apply_round(req, req.round, VerifyResult(0, 9), [], round_s=1.0)  # the prompt's round
    k = s.plan_round(req).k
    assert k > 0
    s.apply_round(req, req.round, VerifyResult(0, 9), [3] * k, round_s=5 * s.batches["t1"].forecast.seconds)
    assert s.batches["t1"].realized.factor(True, 1) == 1.0
    k = s.plan_round(req).k
    slow = 5 * s.batches["t1"].forecast.seconds
    s.apply_round(req, req.round, VerifyResult(0, 9), [3] * k, round_s=slow)  # a steady round: counted
    assert s.batches["t1"].realized.factor(True, 1) > 1.5


def test_max_k_caps_what_auto_drafts_and_a_fixed_k_is_the_clients():
    """vLLM's num_speculative_tokens: the most k='auto' drafts a round (chains and trees); a request's own k stays."""
    strong = PositionAcceptance((0.95,) * 8)
    drafted = {}
    for cap in (None, 2):
        s = Scheduler(["d1"], ["t1"], max_k=cap)
        s.planner_costs = PlannerCosts(cpu_surface(), draft=DraftCost(step_s=0.0001, fixed_s=0.0001))
        req = s.add([1, 2], SamplingParams(max_new_tokens=50), SpecParams(method="draft", k="auto"), frozenset())
        req.planner.draft = strong
        drafted[cap] = s.plan_round(req).k
        fixed = s.add([1, 2], SamplingParams(max_new_tokens=50), SpecParams(method="draft", k=5), frozenset())
        assert s.plan_round(fixed).k == 5
    assert drafted[None] > 2 and drafted[2] == 2
    assert Scheduler([], ["t1"], max_k=3).max_tree_nodes == 3


def test_a_rounds_prediction_is_its_plans_k_expected_acceptance_and_forecast():
    """What the round accounting sets against each round (k='auto''s diagnostic): the plan's k, the accepted tokens
    its drafter's rates expect of it, and the worker's forecast round; a fixed k forecasts nothing."""
    s = Scheduler(["d1"], ["t1"])
    s.planner_costs = PlannerCosts(cpu_surface(), draft=DraftCost(step_s=0.003, fixed_s=0.002))
    params = SamplingParams(max_new_tokens=200)
    auto = s.add([1, 2], params, SpecParams(method="draft", k="auto"), frozenset())
    auto.planner.draft = PositionAcceptance((0.6, 0.5))
    plan = s.plan_round(auto)
    k, expected = plan.k, plan.expected
    rates = auto.planner.draft.rates(k)
    assert k > 0 and plan.forecast_s > 0 and plan.rate == pytest.approx((1 + expected) / plan.forecast_s)
    assert expected == pytest.approx(sum(math.prod(rates[: j + 1]) for j in range(k)))
    fixed = s.add([1, 2], params, SpecParams(method="draft", k=3), frozenset())
    assert s.plan_round(fixed).k == 3 and fixed.round.forecast_s == 0.0 and fixed.round.rate == 0.0


def test_only_plain_rounds_known_ahead_run_several_steps_a_call():
    """Speculation off (every round plain), and a head's trees backed off (TreePruning.plain_rounds); never a prompt's
    round, a drafting round, one that asks for the prompt's logprobs, or a head not backed off."""
    s = Scheduler(["d1"], ["t1"], decode_steps=6)
    plain = s.add([1, 2], SamplingParams(max_new_tokens=10), SpecParams(method="none"), frozenset())
    assert s.plain_steps(plain, s.plan_round(plain)) == 1  # its prompt's round: one call (chunks, its first token)
    plain.state.commit_round([], 0, 5)
    assert s.plain_steps(plain, s.plan_round(plain)) == 6
    plain.state.commit_round([], 0, 6)
    for token in range(7, 12):
        plain.state.commit_round([], 0, token)
    assert plain.state.remaining == 3 and s.plain_steps(plain, PLAIN) == 3  # no step past max_new_tokens
    drafting = s.add([1, 2], SamplingParams(max_new_tokens=10), SPEC, frozenset())
    drafting.state.commit_round([], 0, 5)
    assert s.plain_steps(drafting, s.plan_round(drafting)) == 1
    scored = s.add([1, 2], SamplingParams(max_new_tokens=10, prompt_logprobs=1), SpecParams(method="none"), frozenset())
    scored.state.commit_round([], 0, 5)
    assert s.plain_steps(scored, PLAIN) == 1
    assert Scheduler([], ["t1"]).plain_steps(plain, PLAIN) == 1  # the default: a call a step
    tree = s.add([1, 2], SamplingParams(max_new_tokens=40), SpecParams(method="eagle-tree", k="auto"), frozenset())
    tree.state.commit_round([], 0, 5)
    tree.pruning = TreePruning(VerifyCosts((0.01,) * 17))
    assert s.plain_steps(tree, PLAIN) == 1  # not backed off: its next round may draft
    tree.pruning.plain_rounds = 3
    assert s.plain_steps(tree, PLAIN) == 4  # this round and the three the backoff holds
    assert s.plain_steps(tree, RoundPlan(nodes=8)) == 1
    tree.pruning.plain_rounds = 500
    assert s.plain_steps(tree, PLAIN) == 6
