"""A head's features under load: while a target worker's batches plan no drafting, its k='auto' chains stop asking
for the features every verify reply would carry, and ask again when the load falls (planner/batch.py: BatchWidth)."""

import pytest
import torch

from specserve.cluster.scheduling.sched_request import SchedRequest
from specserve.cluster.scheduling.scheduler import Scheduler
from specserve.workers.config.request import SamplingParams, SpecParams
from specserve.workers.service.results import VerifyResult
from specserve.workers.speculation.codec import feature_block
from specserve.workers.speculation.methods import HEAD_CHAIN
from specserve.workers.speculation.planner.acceptance import PositionAcceptance
from specserve.workers.speculation.planner.batch import QUIET_AFTER_PLANS, QUIET_CALLS, BatchWidth
from specserve.workers.speculation.planner.costs import DraftCost, PlannerCosts
from specserve.workers.speculation.planner.goodput import Option, RowChoice
from tests.helpers.cost_surfaces import cpu_surface
from tests.helpers.eagle_disaggregated import build_pairs, generate_recording_features, greedy, prompts_of
from tests.helpers.eagle_heads import hf_features
from tests.helpers.greedy_oracle import own_greedy_loop

WIDTH = 6  # values per position
WEAK = PositionAcceptance((0.2, 0.3))  # a head that pays alone on a CPU-like target, not beside 15 others


def _rows(n: int) -> list[RowChoice]:
    return [RowChoice((Option(HEAD_CHAIN, (0.2, 0.06)),), None, 4)] * n


def test_batch_width_pauses_after_plain_replans_and_resumes_when_the_load_falls_or_to_look_again():
    costs = PlannerCosts(cpu_surface(), head=DraftCost(step_s=0.003, fixed_s=0.002))
    batch = BatchWidth()
    for _ in range(QUIET_AFTER_PLANS // 2):  # each call with a new row count re-plans
        batch.for_round(_rows(16), costs, 8)
        batch.for_round(_rows(15), costs, 8)
    assert batch.width == 0 and batch.features_paused(16)  # 8 plain re-plans, the fewest rows 15
    assert batch.features_paused(12)  # 12 >= 3/4 of 15: still under load
    assert not batch.features_paused(10) and not batch.features_paused(16)  # the load fell: features back
    alone = BatchWidth()
    for _ in range(3 * QUIET_AFTER_PLANS):
        alone.for_round(_rows(1), costs, 8)
    assert alone.width > 0 and not alone.features_paused(1)  # one request drafts: nothing to pause
    steady = BatchWidth()
    for _ in range(QUIET_AFTER_PLANS):
        steady.for_round(_rows(16), costs, 8)
        for _ in range(15):
            steady.for_round(_rows(16), costs, 8)  # one re-plan a batch round
    assert all(steady.features_paused(16) for _ in range(QUIET_CALLS - 1))
    assert not steady.features_paused(16)  # QUIET_CALLS calls later the planner looks again, features back


def _round(s: Scheduler, req: SchedRequest) -> bool:
    """One round of `req` (plain: the planner drafts nothing under load); returns whether it asked for features."""
    assert s.plan_round(req).k == 0
    call = s.plan_verify(req, [], b"")
    start = 0 if not req.state.generated else len(req.state.tokens) - 1  # the positions this verify computed
    rows = len(req.state.tokens) - start
    features = feature_block(start, torch.ones(rows, WIDTH)).encode() if call.want_features else b""
    s.apply_round(req, req.round, VerifyResult(0, 9, features=features), [])
    return call.want_features


def test_under_load_head_chains_stop_asking_for_features_and_ask_again_when_it_falls():
    """16 k='auto' head requests on one target worker: no chain pays, and after QUIET_AFTER_PLANS batch rounds the
    verify calls stop asking for features and drop those waiting; a fixed-k request keeps asking. When 12 of them
    finish, the rest ask again, and the head drafts once they come (from the later position they start at)."""
    s = Scheduler(["d1"], ["t1"])
    s.planner_costs = PlannerCosts(cpu_surface(), head=DraftCost(step_s=0.003, fixed_s=0.002))
    params = SamplingParams(max_new_tokens=500)
    crowd = [s.add([1, 2, 3], params, SpecParams(method="eagle", k="auto"), frozenset()) for _ in range(16)]
    for req in crowd:
        req.planner.head = WEAK
    fixed = s.add([1, 2, 3], params, SpecParams(method="eagle", k=3), frozenset())
    asked = [[_round(s, req) for req in crowd] for _ in range(QUIET_AFTER_PLANS + 2)]
    assert all(asked[0]) and not any(asked[-1])
    assert all(req.features.pending is None for req in crowd)  # nothing kept for a head that will not draft
    assert s.plan_verify(fixed, [], b"").want_features
    s.release(fixed)
    for req in crowd[4:]:
        s.release(req)
    rest = crowd[:4]
    assert [_round(s, req) for req in rest] == [True] * 4  # the load fell: features again
    assert rest[0].features.pending.start > 3  # after the gap: the head starts again there
    rest[0].planner.head = PositionAcceptance((0.9, 0.9, 0.9, 0.9))
    assert s.plan_round(rest[0]).k > 0


@pytest.fixture(scope="module")
def pairs(tmp_path_factory, device) -> dict:
    return build_pairs(tmp_path_factory.mktemp("pause_pairs"), device)


def test_a_pause_restarts_the_heads_later_on_real_workers_and_outputs_stay_identical(pairs, monkeypatch):
    """Real gRPC workers (two head draft workers, two targets): the verify calls 10-29 ask for no features (as under
    load). Outputs stay identical to target-only; each head gets its features in order, never twice, each block the
    target's own at those positions, with a gap where the pause was: it started again later."""
    target, head_dir = pairs["byte"]
    calls = []
    monkeypatch.setattr(Scheduler, "_features_paused", lambda self, req: calls.append(1) or 10 <= len(calls) < 30)
    methods = ("eagle", "eagle+ngram")
    requests = [(ids, *greedy(24, method, 3)) for ids in prompts_of(target, "byte") for method in methods]
    results, _, handed = generate_recording_features(target, head_dir, requests)
    for (ids, params, _), result in zip(requests, results, strict=True):
        assert result.state.generated == own_greedy_loop(target.model, ids, params.max_new_tokens, set())
    assert len(calls) > 30
    tokens = {r.request_id: r.state.tokens for r in results}
    gaps = 0
    for rid, blocks in handed.items():
        starts, ends = [s for s, _ in blocks], [s + len(f) for s, f in blocks]
        assert starts[0] == 0 and all(s >= e for s, e in zip(starts[1:], ends, strict=False))
        gaps += sum(s > e for s, e in zip(starts[1:], ends, strict=False))
        own = hf_features(target.model, tokens[rid]).cpu()
        for start, f in blocks:
            torch.testing.assert_close(f, own[start : start + len(f)], atol=2e-3, rtol=2e-3)
    assert gaps > 0
