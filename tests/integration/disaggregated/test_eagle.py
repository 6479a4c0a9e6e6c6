"""EAGLE-3 heads in the disaggregated path: the head on its own draft worker, the target's features of each round's
committed positions carried by the verify reply to the scheduler and by the next propose call to the head. Lossless
against target-only decoding with concurrent requests, rejections, lost and restarted draft workers and dropped
features; sampling draws from the target's distribution; the edge takes the head's methods only for a model served
with a head; the scheduler keeps only undelivered features. Method "eagle+ngram" served, and the packaged
head as the serving default: tests/integration/disaggregated/test_eagle_ngram.py."""

import asyncio

import pytest
import torch

from specserve.cluster.app_config import AppConfig
from specserve.cluster.scheduling import features as features_module
from specserve.cluster.scheduling.features import FeatureRelay, FeatureTraffic
from specserve.cluster.scheduling.scheduler import Scheduler
from specserve.cluster.scheduling.worker_clients import DraftClient, TargetClient
from specserve.cluster.serve import openai_api as oai
from specserve.cluster.serve.local_ray import init_ray
from specserve.cluster.serve.prepare import RequestPreparer
from specserve.cluster.serve.public_proto import request_from_proto
from specserve.protos import specserve_pb2 as pb
from specserve.workers.config.request import SamplingParams, SpecParams
from specserve.workers.errors import InvalidRequestError
from specserve.workers.service.results import VerifyResult
from specserve.workers.speculation import codec
from specserve.workers.speculation.codec import feature_block
from specserve.workers.speculation.methods import HEAD_DEFAULT
from specserve.workers.speculation.planner import batch as batch_width
from specserve.workers.speculation.planner.costs import PROFILE_ROWS
from specserve.workers.speculation.planner.goodput import MAX_AUTO_K
from specserve.workers.speculation.planner.round_plan import RoundPlan
from specserve.workers.speculation.planner.tree import MAX_TREE_NODES
from tests.helpers.eagle_disaggregated import (
    BYTE_PROMPTS,
    app_with,
    assert_all_released,
    build_pairs,
    generate_recording_features,
    greedy,
    prompts_of,
    run_the_serving_path,
    sample_disaggregated,
    until,
)
from tests.helpers.eagle_heads import hf_features
from tests.helpers.greedy_oracle import own_greedy_loop
from tests.helpers.marks import slow_unless
from tests.helpers.pipelines import generate_all
from tests.helpers.sampling_oracle import NEW, chi2_pvalue, exact_joint, marginal_tv
from tests.helpers.workers import LocalWorkers


@pytest.fixture(scope="module")
def pairs(tmp_path_factory, device) -> dict:
    return build_pairs(tmp_path_factory.mktemp("eagle_pairs"), device)


@pytest.fixture(scope="module")
def byte_pair(pairs):
    return pairs["byte"]


@pytest.fixture(scope="module")
def tiny_vocab_pair(pairs):
    return pairs["tiny_vocab"]


@pytest.mark.parametrize("pair_name", slow_unless(["byte", "tiny_vocab"], ["tiny_vocab"]))  # byte: in CI
def test_concurrent_greedy_requests_are_identical_to_target_only(pairs, pair_name, monkeypatch):
    """Prompts of different lengths, k fixed and auto, two head draft workers and two targets, and requests of other
    methods in the same target batches (rows that want features beside rows that do not). Features never pause here
    (every round's reach the head: counted below); tests/cluster/scheduling/test_scheduler_head_features.py covers
    the pause."""
    monkeypatch.setattr(batch_width, "QUIET_AFTER_PLANS", 10**9)
    target, head_dir = pairs[pair_name]
    prompts = prompts_of(target, pair_name)
    requests = [(ids, *greedy(12 + 4 * i, k=k)) for i, ids in enumerate(prompts) for k in (1, 3, 5, "auto")]
    requests += [(ids, *greedy(16, method)) for ids in prompts[:2] for method in ("none", "ngram")]

    results, pipeline, handed = generate_recording_features(target, head_dir, requests)
    for (ids, params, _), result in zip(requests, results, strict=True):
        assert result.state.generated == own_greedy_loop(target.model, ids, params.max_new_tokens, set())
    eagle = [r for r, (_, _, spec) in zip(results, requests, strict=True) if spec.method == "eagle"]
    drafted, accepted = sum(r.state.stats.drafted for r in eagle), sum(r.state.stats.accepted for r in eagle)
    assert drafted > 0 and accepted < drafted  # rejections (and, for the tiny vocabulary, acceptances)
    assert accepted > 0 or pair_name == "byte"
    assert {r.draft_worker for r in eagle} == {"draft-0", "draft-1"}
    width = 2 * 3 * target.model.config.hidden_size  # float16 bytes per position
    for r in eagle:  # every committed position's features came exactly once, but the newest token's
        positions = len(r.state.tokens) - 1
        traffic = r.features.traffic
        assert traffic.replies == r.state.stats.rounds
        assert 0 < traffic.received_bytes - width * positions <= 40 * traffic.replies  # msgpack's framing
        # k='auto' may draft nothing: on tiny models a head's draft can cost more than the tokens it is expected to win
        assert (1 if r.spec.k != "auto" else 0) <= traffic.proposes <= r.state.stats.rounds - 1
        if not traffic.proposes:
            continue
        # each head got the target's features of every committed position once, in order, as the target computes
        # them without a cache (float16)
        starts = [start for start, _ in handed[r.request_id]]
        ends = [start + len(f) for start, f in handed[r.request_id]]
        assert starts == [0, *ends[:-1]]
        got = torch.cat([f for _, f in handed[r.request_id]])
        want = hf_features(target.model, r.state.tokens)[: ends[-1]]
        torch.testing.assert_close(got, want.cpu(), atol=2e-3, rtol=2e-3)
    costs = pipeline.scheduler.planner_costs  # k='auto' asked the workers for their measured costs
    profile = costs.verify.profile  # one row up to a tree's width; the profiled batch sizes up to a chain's
    assert len(profile.seconds[0]) == max(MAX_AUTO_K, MAX_TREE_NODES) + 1 and costs.head.step_s > 0
    assert profile.rows == PROFILE_ROWS and all(len(row) == MAX_AUTO_K + 1 for row in profile.seconds[1:])
    totals = pipeline.scheduler.feature_traffic
    assert totals.received_bytes == sum(r.features.traffic.received_bytes for r in eagle)
    assert 0 < totals.bytes_per_propose and totals.to_dict()["feature_bytes_per_verify_reply"] > 0
    assert all(r.features is None for r, (_, _, spec) in zip(results, requests, strict=True) if spec.method != "eagle")


def test_plain_rounds_make_no_draft_call_feed_one_position_and_keep_the_head_in_step(tiny_vocab_pair, monkeypatch):
    """k = 0 rounds (the goodput planner's answer where drafting does not pay): no draft call, the target is fed
    exactly the plain step's one new position, and the head gets those rounds' features with its next call, so it
    holds every position's once, in order (drafting after them is drafting as if it had drafted every round)."""
    target, head_dir = tiny_vocab_pair
    plan, verifies, proposes = Scheduler._plan_chain, [], []

    def some_plain(self, req):  # rounds 2-4 of every 6 are plain, as a planner under load would make them
        out = plan(self, req)
        return RoundPlan(row=out.row) if req.state.stats.rounds % 6 in (2, 3, 4) else out

    verify, propose = TargetClient.verify, DraftClient.propose

    async def spy_verify(self, call, params):
        verifies.append((call.request_id, len(call.drafted), len(call.new_tokens)))
        return await verify(self, call, params)

    async def spy_propose(self, call, params):
        proposes.append(call.request_id)
        return await propose(self, call, params)

    monkeypatch.setattr(Scheduler, "_plan_chain", some_plain)
    monkeypatch.setattr(TargetClient, "verify", spy_verify)
    monkeypatch.setattr(DraftClient, "propose", spy_propose)
    requests = [(ids, *greedy(30, k=3)) for ids in prompts_of(target, "tiny_vocab")]
    results, _, handed = generate_recording_features(target, head_dir, requests)
    for r, (ids, _, _) in zip(results, requests, strict=True):
        assert r.state.generated == own_greedy_loop(target.model, ids, 30, set())
        mine = [(drafted, new) for rid, drafted, new in verifies if rid == r.request_id]
        # after the prefill, a plain round that follows a plain round feeds one position: the token it committed
        plain = [new for (before, _), (drafted, new) in zip(mine[1:], mine[2:], strict=False) if before == drafted == 0]
        assert len(plain) >= 2 and set(plain) == {1}
        assert proposes.count(r.request_id) == sum(drafted > 0 for drafted, _ in mine)  # no call for a plain round
        starts = [start for start, _ in handed[r.request_id]]
        ends = [start + len(f) for start, f in handed[r.request_id]]
        assert starts == [0, *ends[:-1]]  # every position's features, once, in order
        got = torch.cat([f for _, f in handed[r.request_id]])
        torch.testing.assert_close(got, hf_features(target.model, r.state.tokens)[: ends[-1]].cpu(), atol=2e-3,
                                   rtol=2e-3)  # fmt: skip


def test_a_restarted_or_forgetful_draft_worker_changes_no_output(byte_pair):
    """The head's draft worker forgets every request a few times (NOT_FOUND: the whole sequence is re-sent with the
    undelivered features, and the head starts its cache at their first position), then dies and comes back as a
    fresh process at a new address. Outputs stay identical; the fresh head started later than position 0."""
    target, head_dir = byte_pair
    prompts = prompts_of(target, "byte")
    requests = [(ids, *greedy(40)) for ids in prompts]

    async def main():
        async with (
            LocalWorkers(target, [], eagle_head=head_dir) as w,
            LocalWorkers(target, [], eagle_head=head_dir) as fresh,
        ):
            starts = []
            restart = fresh.drafts["draft-0"].drafter.drafting.restart
            fresh.drafts["draft-0"].drafter.drafting.restart = lambda rid, p: starts.append(p) or restart(rid, p)

            async def faults(pipeline):
                for _ in range(3):
                    await until(lambda: pipeline.scheduler.feature_traffic.proposes >= 4)
                    for rid in w.drafts["draft-0"].committed.least_recent():
                        await pipeline.drafts["draft-0"].release(rid)
                    await asyncio.sleep(0.02)
                await w.stop("draft-0")

            async def reconnect(name):
                return fresh.addresses[name]

            results, pipeline = await generate_all(w, requests, during=faults, reconnect=reconnect)
            assert_all_released(fresh)
            return results, pipeline, starts

    results, pipeline, starts = asyncio.run(main())
    for (ids, params, _), result in zip(requests, results, strict=True):
        assert result.state.generated == own_greedy_loop(target.model, ids, params.max_new_tokens, set())
    assert sum(r.resent for r in results) >= 1 and pipeline.faults.restarts == 1
    assert starts and min(starts) > 0  # the fresh head started each request's cache where its features began


def test_a_dead_draft_worker_leaves_target_only_rounds_and_drops_the_features(byte_pair):
    """The draft worker dies as a request's round is about to call it, once 4 propose calls carried features (so
    mid-request, however fast or slow the machine): that call fails, the worker is marked unhealthy, and at that
    moment no running request keeps a draft worker or undelivered features."""
    target, head_dir = byte_pair
    requests = [(ids, *greedy(30)) for ids in prompts_of(target, "byte")]
    seen, killed = [], []

    async def main():
        async with LocalWorkers(target, [], eagle_head=head_dir) as w:

            async def kill(pipeline):
                # Installed before any propose call: a request's first round (the prefill) never drafts.
                scheduler, propose = pipeline.scheduler, pipeline._propose
                mark_unhealthy = scheduler.mark_unhealthy

                async def propose_or_kill(req, call):
                    if not killed and scheduler.feature_traffic.proposes >= 4:
                        killed.append(req.request_id)
                        await w.stop("draft-0")
                    return await propose(req, call)

                def marked(worker):
                    mark_unhealthy(worker)
                    seen.extend((r.draft_worker, r.features.pending) for r in scheduler.requests.values())

                pipeline._propose, scheduler.mark_unhealthy = propose_or_kill, marked

            return await generate_all(w, requests, during=kill)

    results, pipeline = asyncio.run(main())
    for (ids, params, _), result in zip(requests, results, strict=True):
        assert result.state.generated == own_greedy_loop(target.model, ids, params.max_new_tokens, set())
    assert killed and pipeline.scheduler.unhealthy == {"draft-0"}
    killed_request = next(r for r in results if r.request_id == killed[0])
    assert killed_request.state.stats.rounds > killed_request.features.traffic.replies  # target-only rounds after
    assert seen and all(draft is None and pending is None for draft, pending in seen)
    rounds = sum(r.state.stats.rounds for r in results)
    assert pipeline.scheduler.feature_traffic.replies < rounds  # target-only rounds ask for no features


def test_features_over_the_byte_limit_start_the_head_later_and_change_no_output(byte_pair, monkeypatch):
    """With room for 4 positions a message, a long prompt's prefill ships its newest 4 and the head starts there."""
    target, head_dir = byte_pair
    limit = 4 * 2 * 3 * target.model.config.hidden_size
    monkeypatch.setattr(codec, "MAX_FEATURE_BYTES", limit)
    monkeypatch.setattr(features_module, "MAX_FEATURE_BYTES", limit)
    requests = [(ids, *greedy(16)) for ids in prompts_of(target, "byte")]

    async def main():
        async with LocalWorkers(target, [], eagle_head=head_dir) as w:
            starts = []
            drafting = w.drafts["draft-0"].drafter.drafting
            restart = drafting.restart
            drafting.restart = lambda rid, p: starts.append(p) or restart(rid, p)
            return await generate_all(w, requests), starts

    (results, _), starts = asyncio.run(main())
    for (ids, params, _), result in zip(requests, results, strict=True):
        assert result.state.generated == own_greedy_loop(target.model, ids, params.max_new_tokens, set())
    long_prompts = [len(ids) - 4 for ids, _, _ in requests if len(ids) > 4]
    assert sorted(starts) == sorted(long_prompts) and sum(r.state.stats.drafted for r in results) > 0


@pytest.mark.slow
def test_sampling_through_the_workers_matches_the_targets_distribution(tiny_vocab_pair):
    """2,500 seeded requests (about 20 s on 2 cores), 64 at a time: top-p truncates both distributions and the head
    never proposes 3 of the 8 tokens (the target's mass there comes through recovered tokens only). The chi-square
    test of tests/workers/speculation/test_engine_sampling.py against the exact joint of the next 3 tokens."""
    target, head_dir = tiny_vocab_pair
    samples = 2500
    params = SamplingParams(temperature=1.0, top_p=0.8, max_new_tokens=NEW, stop_at_eos=False)
    results = sample_disaggregated(target, head_dir, params, SpecParams(method="eagle", k=2), samples)
    outputs = [tuple(r.state.generated) for r in results]
    joint = exact_joint(target.model, params, target.model.config.vocab_size)
    assert sum(r.state.stats.accepted for r in results) > 0.2 * samples  # measured: 0.36 per request
    assert chi2_pvalue(outputs, joint) > 1e-3
    for pos in range(NEW):
        assert marginal_tv(outputs, joint, pos, target.model.config.vocab_size) <= 0.04


# -- the scheduler alone ---------------------------------------------------------------------------------------------

WIDTH = 6  # values per position in these unit tests


def block(start: int, rows: int) -> bytes:
    return feature_block(start, torch.arange(rows * WIDTH, dtype=torch.float32).view(rows, WIDTH) + start).encode()


def test_a_request_keeps_only_the_features_its_draft_worker_has_not_been_given(monkeypatch):
    relay = FeatureRelay(FeatureTraffic())
    relay.received(block(0, 5))
    relay.received(block(5, 2))
    assert (relay.pending.start, relay.pending.end) == (0, 7)
    relay.delivered(relay.to_send())
    assert relay.pending is None and relay.delivered_end == 7
    relay.received(block(0, 9))  # a target that lost the request recomputed it all: only 7, 8 are new
    assert (relay.pending.start, relay.pending.end) == (7, 9)
    relay.received(block(8, 3))  # the newer features of position 8 replace the older ones
    assert (relay.pending.start, relay.pending.end) == (7, 11)
    relay.received(block(20, 1))  # a gap: only what the head can start from is kept
    assert (relay.pending.start, relay.pending.end) == (20, 21)
    monkeypatch.setattr(features_module, "MAX_FEATURE_BYTES", 3 * 2 * WIDTH)
    relay.received(block(21, 5))
    assert (relay.pending.start, relay.pending.end) == (23, 26)  # bounded: the newest 3 positions
    assert relay.traffic.replies == 6 and relay.totals.replies == 6 and relay.traffic.proposes == 1
    relay.drop()
    assert relay.pending is None and relay.to_send() == b""


def test_the_scheduler_drafts_for_a_head_only_from_new_features_and_never_ahead():
    s = Scheduler(["d1"], ["t1"])
    req = s.add([1, 2, 3], SamplingParams(max_new_tokens=20), SpecParams(method="eagle", k=3), frozenset())
    assert req.draft_worker == "d1" and s.plan_round(req).k == 0  # no features before the prefill: a target-only round
    verify = s.plan_verify(req, [], b"")
    assert verify.want_features
    s.apply_round(req, req.round, VerifyResult(0, 9, features=feature_block(0, torch.ones(3, WIDTH)).encode()), [])
    assert s.plan_round(req).k == 3
    draft = s.plan_draft(req, 3)
    assert draft.features == req.features.to_send() and draft.committed_len == 4
    assert s.plan_predraft(req, [5, 6, 7], 3) is None  # round r + 1 needs round r's features
    s.drafted(req, draft)
    assert req.features.pending is None and s.plan_round(req).k == 0
    s.remove_worker("d1")
    assert req.draft_worker is None and not s.plan_verify(req, [], b"").want_features
    other = s.add([1, 2], SamplingParams(), SpecParams(method="draft"), frozenset())
    assert other.features is None and not s.plan_verify(other, [], b"").want_features
    with pytest.raises(InvalidRequestError, match="'medusa' is not served") as e:
        s.add([1, 2], SamplingParams(), SpecParams.model_construct(method="medusa", k=4), frozenset())
    assert e.value.field == "method"


# -- the edge and the serving path -----------------------------------------------------------------------------------


@pytest.mark.parametrize("method", ["eagle", "eagle+ngram", "eagle-tree", "eagle-tree+ngram"])
def test_the_edge_takes_the_head_methods_only_for_a_model_served_with_a_head(byte_pair, method):
    """Both edges take every head method; a model served with a head drafts with its default ("eagle-tree+ngram")
    unless the request names one."""
    target, head_dir = byte_pair
    with_head = RequestPreparer(app_with(target.path, head_dir), {"m": (target.path, head_dir)})
    without = RequestPreparer(app_with(target.path, "ngram"), {"m": (target.path, None)})
    http = oai.parse_completion({"prompt": "x", "speculation": {"method": method, "k": 2}}).request
    grpc_request = request_from_proto(pb.GenerateRequest(prompt="x", speculation=pb.SpeculationOptions(method=method)))
    default = oai.parse_completion({"prompt": "x"}).request
    assert with_head.prepare(http).spec.method == method and with_head.prepare(default).spec.method == HEAD_DEFAULT
    assert with_head.prepare(grpc_request).spec.method == method
    for request in (http, grpc_request):
        with pytest.raises(InvalidRequestError) as e:
            without.prepare(request)
        assert e.value.field == "speculation.method" and "without an EAGLE-3 head" in e.value.message
    draft = oai.parse_completion({"prompt": "x", "speculation": {"method": "draft"}}).request
    with pytest.raises(InvalidRequestError, match="drafts with an EAGLE-3 head, not a draft model"):
        with_head.prepare(draft)
    lookup_tree = oai.parse_completion({"prompt": "x", "speculation": {"method": "ngram-tree"}}).request
    assert without.prepare(lookup_tree).spec.method == with_head.prepare(lookup_tree).spec.method == "ngram-tree"


def test_a_model_served_with_a_head_runs_through_the_serving_path(byte_pair):
    """No method: "eagle-tree+ngram", the head's default (k fixed: a tiny random head would rarely pay under k='auto').
    Greedy output identical to target-only; the replica's status reports feature bytes."""
    target, head_dir = byte_pair
    run = run_the_serving_path(app_with(target.path, head_dir), BYTE_PROMPTS[0], 24, speculation={"k": 3})
    assert run.paths == (target.path, head_dir) and run.prepared.spec.method == HEAD_DEFAULT
    assert run.out["token_ids"] == own_greedy_loop(target.model, run.prepared.prompt_ids, 24, {2})
    assert run.out["stats"]["drafted"] > 0
    assert run.status["feature_bytes_per_verify_reply"] > 0 and run.status["feature_bytes_per_propose"] > 0


@pytest.mark.slow
def test_the_serve_app_serves_a_model_with_a_head(byte_pair):
    """The real Serve app on a local Ray (about a minute): the draft pool runs the head, a request without a method
    drafts with it, one with method "eagle-tree" drafts trees with it (both identical to target-only), method "draft"
    is INVALID_ARGUMENT naming the field."""
    import grpc
    import ray

    from specserve.client import SpecServeClient
    from specserve.cluster.app_config import serve_config
    from specserve.cluster.serve.server import start, stop
    from specserve.workers.service.local_processes import free_port

    target, head_dir = byte_pair
    if target.device.type != "cpu":
        pytest.skip("the app serves on cpu: once is enough")
    pool = {"num_cpus": 0.5}
    app = AppConfig.model_validate(
        {"models": [{"name": "tiny", "target": target.path, "draft": head_dir, "device": "cpu", "target_pool": pool,
                     "draft_pool": pool}],
         "scheduler": {"num_cpus": 0.5, "call_timeout_s": 30, "worker_wait_s": 60}, "auth": {"api_key_env": None}}
    )  # fmt: skip
    init_ray(num_cpus=4, include_dashboard=False, configure_logging=False, log_to_driver=False)
    info = start(serve_config(app, grpc_port=free_port(), http_port=free_port()), ready_timeout_s=300)
    try:
        with SpecServeClient(info["grpc"], timeout_s=120) as client:
            out = client.generate(BYTE_PROMPTS[0], max_new_tokens=24, k=3)
            tree = client.generate(BYTE_PROMPTS[1], max_new_tokens=16, method="eagle-tree", k=4)
            with pytest.raises(grpc.RpcError) as e:
                client.generate("x", method="draft")
    finally:
        stop({**info, "started_ray": False})
        ray.shutdown()
    ids = target.tokenizer(BYTE_PROMPTS[0])["input_ids"]
    assert out["token_ids"] == own_greedy_loop(target.model, ids, 24, {2}) and out["stats"]["drafted"] > 0
    tree_ids = target.tokenizer(BYTE_PROMPTS[1])["input_ids"]
    assert tree["token_ids"] == own_greedy_loop(target.model, tree_ids, 16, {2}) and tree["stats"]["drafted"] > 0
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "speculation.method" in e.value.details()
