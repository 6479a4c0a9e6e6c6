"""Method "eagle+ngram" in the disaggregated path, and the packaged EAGLE-3 head as the serving default.

Each round the scheduler's per-request ChainPlanner picks the head's chain (a draft call to the head's worker) or
prompt lookup's continuation (proposed by the pipeline: no draft call); the target's features of the n-gram rounds
wait in the relay for the head's next call. Greedy output identical to target-only, every committed position's
features reach the head once and in order whichever chain drafted, sampling draws from the target's distribution. A
target with a packaged head serves with it, and with "eagle+ngram", unless its config names a draft."""

import json
import shutil

import pytest
import torch

from specserve.cluster.app_config import ModelPairConfig, app_config
from specserve.cluster.cli.main import main as cli_main
from specserve.cluster.scheduling.scheduler import FALLBACK_K, Scheduler
from specserve.cluster.serve import server
from specserve.workers.config.request import SamplingParams, SpecParams
from specserve.workers.models import packaged_heads
from specserve.workers.models.catalog import known_models
from specserve.workers.models.gguf_store import MARKER
from specserve.workers.service.results import VerifyResult
from specserve.workers.speculation.codec import feature_block
from specserve.workers.speculation.methods import HEAD_DEFAULT
from specserve.workers.speculation.planner import batch as batch_width
from specserve.workers.speculation.planner.acceptance import HEAD_PRIOR
from specserve.workers.speculation.planner.costs import DraftCost, PlannerCosts, VerifyCosts
from specserve.workers.speculation.planner.goodput import MAX_AUTO_K, ChainPlan
from specserve.workers.speculation.wire_format import decode_features
from tests.helpers.eagle_disaggregated import (
    BYTE_PROMPTS,
    build_pairs,
    generate_recording_features,
    greedy,
    prompts_of,
    run_the_serving_path,
    sample_disaggregated,
)
from tests.helpers.eagle_heads import hf_features
from tests.helpers.greedy_oracle import own_greedy_loop
from tests.helpers.marks import slow_unless
from tests.helpers.sampling_oracle import NEW, assert_target_distribution

WIDTH = 6  # feature values per position in the scheduler's unit test


@pytest.fixture(scope="module")
def pairs(tmp_path_factory, device) -> dict:
    return build_pairs(tmp_path_factory.mktemp("eagle_ngram_pairs"), device)


@pytest.fixture
def plan_sources(monkeypatch) -> list[str]:
    """The source of every chain the scheduler plans ("head", "ngram" or "none"), in order."""
    sources = []
    plan = Scheduler._plan_chain

    def spy(self, req):
        out = plan(self, req)
        sources.append(out.chain.source)
        return out

    monkeypatch.setattr(Scheduler, "_plan_chain", spy)
    return sources


@pytest.mark.parametrize("pair_name", slow_unless(["byte", "tiny_vocab"], ["tiny_vocab"]))  # byte: in CI
def test_concurrent_greedy_requests_are_identical_to_target_only(pairs, pair_name, plan_sources, monkeypatch):
    """k fixed and auto, two head draft workers, "eagle" requests in the same batches. Both chains win rounds; only
    the head's rounds call a draft worker; each head got every committed position's features once and in order,
    those of the n-gram rounds with its next call. (Features never pause here: with 11 requests the planner may plan
    plain rounds long enough to pause them, which tests/cluster/scheduling/test_scheduler_head_features.py covers.)"""
    monkeypatch.setattr(batch_width, "QUIET_AFTER_PLANS", 10**9)
    target, head_dir = pairs[pair_name]
    prompts = prompts_of(target, pair_name)
    requests = [(ids, *greedy(12 + 4 * i, "eagle+ngram", k)) for i, ids in enumerate(prompts) for k in (1, 3, "auto")]
    requests += [(ids, *greedy(16)) for ids in prompts[:2]]
    results, _, handed = generate_recording_features(target, head_dir, requests)
    for (ids, params, _), result in zip(requests, results, strict=True):
        assert result.state.generated == own_greedy_loop(target.model, ids, params.max_new_tokens, set())
    mixed = [r for r, (_, _, spec) in zip(results, requests, strict=True) if spec.method == "eagle+ngram"]
    assert {"head", "ngram"} <= set(plan_sources)
    with_head = [r for r in results if r.features is not None]  # "eagle" requests plan their rounds too
    assert plan_sources.count("head") == sum(r.features.traffic.proposes for r in with_head)  # a draft call each
    assert sum(r.state.stats.drafted for r in mixed) > 0
    assert {r.draft_worker for r in mixed} == {"draft-0", "draft-1"}
    drafted_by_head = [r for r in mixed if r.request_id in handed]
    assert drafted_by_head
    for r in drafted_by_head:
        starts = [start for start, _ in handed[r.request_id]]
        ends = [start + len(f) for start, f in handed[r.request_id]]
        assert starts == [0, *ends[:-1]]
        got = torch.cat([f for _, f in handed[r.request_id]])
        torch.testing.assert_close(got, hf_features(target.model, r.state.tokens)[: ends[-1]].cpu(), atol=2e-3,
                                   rtol=2e-3)  # fmt: skip


def _features(start: int, rows: int) -> bytes:
    return feature_block(start, torch.ones(rows, WIDTH)).encode()


def test_the_scheduler_plans_each_round_and_learns_from_its_result():
    """Prompt lookup drafts the prefill round (no features yet); the head drafts once features came and lookup finds
    nothing; the outcome of each round goes to its chain's statistics (and, for k='auto', AdaptiveK learns from the
    head's rounds only); without a draft worker only prompt lookup drafts, and no features are asked for."""
    s = Scheduler(["d1"], ["t1"])
    req = s.add([1, 2, 3, 1, 2], SamplingParams(max_new_tokens=20), SpecParams(method="eagle+ngram", k=3), frozenset())
    assert req.draft_worker == "d1" and req.features is not None and s.plan_round(req).k == 3
    assert (req.round.chain.source, req.round.chain.tokens, req.round.chain.match) == ("ngram", (3, 1, 2), 2)
    assert s.plan_verify(req, [3, 1, 2], b"").want_features  # for the head's next call
    s.apply_round(req, req.round, VerifyResult(1, 9, features=_features(0, 6)), [3, 1, 2])
    assert req.planner.by_match[2].reached == [1, 1] and req.planner.by_match[2].accepted == [1, 0]
    assert s.plan_round(req).k == 3 and req.round.chain.source == "head"  # [..., 3, 9]: nothing to look up
    draft = s.plan_draft(req, 3)
    sent = decode_features(draft.features)
    assert draft.k == 3 and (sent.start, sent.rows) == (0, 6)
    s.drafted(req, draft)
    s.apply_round(req, req.round, VerifyResult(0, 8, features=_features(6, 1)), [5, 6, 7])
    assert req.planner.head.reached == [1] and req.planner.head.accepted == [0]
    s.remove_worker("d1")
    assert s.plan_round(req).k == 0 and req.round.chain.source == "none"  # [..., 9, 8]: nothing to look up, and no head
    assert not s.plan_verify(req, [], b"").want_features

    auto = s.add([4, 4, 4], SamplingParams(max_new_tokens=20), SpecParams(method="eagle+ngram", k="auto"), frozenset())
    s.add_worker("draft", "d1")
    # no costs known yet (a worker did not report them): k='auto' drafts FALLBACK_K, the lookup's as far as it goes
    assert s.plan_round(auto).k == 1 and auto.round.chain == ChainPlan("ngram", 1, (4,), 2)
    assert auto.draft_worker == "d1" and auto.round.drafted  # the lookup's tokens come with the plan
    s.apply_round(auto, auto.round, VerifyResult(0, 5, features=_features(0, 3)), [4])
    assert auto.planner.by_match[2].reached == [1] and auto.planner.by_match[2].accepted == [0]
    assert s.plan_round(auto).k == FALLBACK_K and auto.round.chain.source == "head"
    s.drafted(auto, s.plan_draft(auto, FALLBACK_K))
    s.apply_round(auto, auto.round, VerifyResult(0, 6, features=_features(3, 1)), [1, 1, 1])
    assert auto.planner.head.reached == [1] and auto.planner.head.accepted == [0]


def test_k_auto_weighs_the_workers_costs_once_they_are_known():
    """Until the workers' costs are known, k='auto' drafts FALLBACK_K; then the goodput planner drafts the k with the
    most committed tokens per second: the longest chain when drafting is free and every width costs the same,
    nothing when a drafted token costs more than a target step. Fixed k needs no costs."""
    s = Scheduler(["d1"], ["t1"], head_prior=(0.9,) * MAX_AUTO_K)
    req = s.add([4, 5, 6], SamplingParams(max_new_tokens=40), SpecParams(method="eagle", k="auto"), frozenset())
    assert s.wants_costs(req) and s.plan_round(req).k == 0  # the prefill round: no features yet
    s.apply_round(req, req.round, VerifyResult(0, 7, features=_features(0, 3)), [])
    assert s.plan_round(req).k == FALLBACK_K and req.round.chain.source == "head"
    flat = VerifyCosts((0.1,) * (MAX_AUTO_K + 1))
    s.planner_costs = PlannerCosts(flat, DraftCost())
    assert not s.wants_costs(req)
    assert s.plan_round(req).k == MAX_AUTO_K and req.round.chain.source == "head"
    s.planner_costs = PlannerCosts(flat, DraftCost(step_s=0.2))
    s.batches.clear()  # re-planned at the next batch round anyway; now
    assert s.plan_round(req).k == 0 and req.round.chain.source == "none"
    fixed = s.add([4, 5, 6], SamplingParams(max_new_tokens=40), SpecParams(method="eagle", k=3), frozenset())
    assert not Scheduler(["d1"], ["t1"]).wants_costs(fixed)


def test_the_heads_recorded_acceptance_is_where_planning_starts():
    """The scheduler's eagle+ngram planners start from the head's recorded acceptance (ServedModel.load reads it from
    the head's config), else from the generic prior."""
    prompt, params, spec = [1, 2, 3, 1, 2], SamplingParams(max_new_tokens=20), SpecParams(method="eagle+ngram", k=3)
    measured = Scheduler(["d1"], ["t1"], head_prior=(0.1, 0.1))
    assert measured.add(prompt, params, spec, frozenset()).planner.head.prior == (0.1, 0.1)
    assert Scheduler(["d1"], ["t1"]).add(prompt, params, spec, frozenset()).planner.head.prior == HEAD_PRIOR


def test_every_requests_head_rounds_move_where_the_next_request_starts():
    """A request of a few rounds never learns its own acceptance: the model's, over every request's head rounds, is
    where a new request's planning starts. Heads that missed their first drafted token pull it down from the record."""
    s = Scheduler(["d1"], ["t1"], head_prior=(0.6, 0.5))
    params, spec = SamplingParams(max_new_tokens=20), SpecParams(method="eagle", k=3)
    assert s.add([4, 5, 6], params, spec, frozenset()).planner.head.prior == (0.6, 0.5)
    for _ in range(30):
        req = s.add([4, 5, 6], params, spec, frozenset())
        assert s.plan_round(req).k == 0  # the prefill round: no features yet
        s.apply_round(req, req.round, VerifyResult(0, 7, features=_features(0, 3)), [])
        assert s.plan_round(req).k == 3 and req.round.chain.source == "head"
        s.drafted(req, s.plan_draft(req, 3))
        s.apply_round(req, req.round, VerifyResult(0, 8, features=_features(3, 1)), [1, 1, 1])
        s.release(req)
    first, second = s.add([4, 5, 6], params, spec, frozenset()).planner.head.prior
    assert first < 0.3 and second == pytest.approx(0.5)  # position 2 was never reached: its prior stands


@pytest.mark.slow
def test_sampling_through_the_workers_matches_the_targets_distribution(pairs, plan_sources):
    """2,500 seeded requests (about 20 s on 2 cores), 64 at a time, as tests/integration/disaggregated/test_eagle.py's
    "eagle" test: the prompt's repeats give prompt lookup the prefill round and some later ones (one-hot drafts), the
    head the others."""
    target, head_dir = pairs["tiny_vocab"]
    samples = 2500
    params = SamplingParams(temperature=1.0, top_p=0.8, max_new_tokens=NEW, stop_at_eos=False)
    results = sample_disaggregated(target, head_dir, params, SpecParams(method="eagle+ngram", k=2), samples)
    assert plan_sources.count("head") > 0.1 * samples and plan_sources.count("ngram") > 0.1 * samples
    assert sum(r.state.stats.accepted for r in results) > 0.2 * samples
    assert_target_distribution([tuple(r.state.generated) for r in results], target.model, params, max_tv=0.04)


# -- the packaged head as the serving default ------------------------------------------------------------------------


def _package(head_dir: str, heads, name: str, identity: str):
    """A copy of the head packaged under `heads` for the target of that identity."""
    packaged = shutil.copytree(head_dir, heads / name)
    config = json.loads((packaged / "config.json").read_text())
    config["specserve"]["target_identity"] = identity
    (packaged / "config.json").write_text(json.dumps(config))
    packaged_heads.packaged_heads.cache_clear()
    return packaged


def test_a_target_with_a_packaged_head_serves_with_it_and_its_default_method(pairs, heads_dir, tmp_path,
                                                                               monkeypatch):  # fmt: skip
    """`specserve serve --model DIR` for a converted target with a packaged head: the config's draft is 'eagle', the
    draft pool runs that head, and a request without a method drafts with the head's default ("eagle-tree+ngram"),
    identical to target-only. `--draft ngram` still gives n-gram; the known name finds its head by its pinned GGUF
    hash (nothing pulled)."""
    target, head_dir = pairs["byte"]
    converted = shutil.copytree(target.path, tmp_path / "converted")
    (converted / MARKER).write_text(json.dumps({"sha256": "c" * 64}))
    packaged = _package(head_dir, heads_dir, "tiny", "c" * 64)
    configs = []

    def serve_forever(config_path, grpc_port, http_port, metrics_port, grpc_tls=None, model=None, draft=None,
                      host=None, overrides=None):  # fmt: skip
        configs.append(server.prepare_config(config_path, grpc_port, http_port, model, draft, host, overrides))
        return 0

    monkeypatch.setattr(server, "serve_forever", serve_forever)
    for argv in (["--model", str(converted)], ["--model", str(converted), "--draft", "ngram"],
                 ["--model", "smollm2-135m-instruct"]):  # fmt: skip
        assert cli_main(["serve", *argv]) == 0
    _package(head_dir, heads_dir, "smol", known_models()["smollm2-135m-instruct"].gguf_sha256)
    assert cli_main(["serve", "--model", "smollm2-135m-instruct"]) == 0
    args = [config["applications"][0]["args"] for config in configs]
    assert [a["models"][0]["draft"] for a in args] == ["eagle", "ngram", "ngram", "eagle"]
    assert ModelPairConfig().draft == "eagle" and ModelPairConfig(draft="ngram").draft == "ngram"
    assert ModelPairConfig(target=target.path).draft == "ngram"  # a plain directory: no cheap identity, no lookup

    run = run_the_serving_path(app_config(args[0]), BYTE_PROMPTS[0], 24)
    assert (
        run.paths == (str(converted), str(packaged)) and run.prepared.spec.method == HEAD_DEFAULT == "eagle-tree+ngram"
    )
    assert run.out["token_ids"] == own_greedy_loop(target.model, run.prepared.prompt_ids, 24, {2})
    assert run.out["stats"]["drafted"] > 0
