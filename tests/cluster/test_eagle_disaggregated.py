"""EAGLE-3 heads in the disaggregated path: the head on its own draft worker, the target's features of each round's
committed positions carried by the verify reply to the scheduler and by the next propose call to the head. Lossless
against target-only decoding with concurrent requests, rejections, lost and restarted draft workers and dropped
features; sampling draws from the target's distribution; the edge takes the head's methods only for a model served
with a head; the scheduler keeps only undelivered features. Method "eagle+ngram" served, and the packaged
head as the serving default: tests/cluster/test_eagle_ngram_disaggregated.py."""

import asyncio
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from specserve.cluster.app_config import AppConfig
from specserve.cluster.scheduling import features as features_module
from specserve.cluster.scheduling.features import FeatureRelay, FeatureTraffic
from specserve.cluster.scheduling.pipeline import Pipeline
from specserve.cluster.scheduling.prepared import Prepared
from specserve.cluster.scheduling.scheduler import Scheduler
from specserve.cluster.scheduling.service import SpecService
from specserve.cluster.scheduling.worker_clients import DraftClient, TargetClient
from specserve.cluster.serve import openai_api as oai
from specserve.cluster.serve.prepare import RequestPreparer
from specserve.cluster.serve.public_proto import request_from_proto
from specserve.protos import specserve_pb2 as pb
from specserve.workers.config import ModelConfig, SamplingParams, SpecParams
from specserve.workers.errors import InvalidRequestError
from specserve.workers.runtime.loading import load_model
from specserve.workers.speculation import codec
from specserve.workers.speculation.chain_policy import MAX_AUTO_K
from specserve.workers.speculation.codec import feature_block
from specserve.workers.speculation.eagle3_io import save_head
from specserve.workers.speculation.goodput import NO_DRAFT, PROFILE_ROWS
from specserve.workers.speculation.tree_policy import MAX_TREE_NODES
from tests.worker_helpers import LocalWorkers, save_tiny_llama
from tests.workers.test_eagle_engine import hf_features, random_head
from tests.workers.test_engine_greedy import own_greedy_loop
from tests.workers.test_engine_sampling import NEW, PROMPT, chi2_pvalue, exact_joint, marginal_tv

BYTE_PROMPTS = ["def add(a, b):\n    return", "class Stack:", "for i in range(3):\n    print(i)\n" * 3, "x"]


def build_pairs(models_dir: Path, device: str) -> dict:
    """(target, head directory) pairs. byte: a byte-vocabulary target and a random head over 64 of its 259 tokens,
    which drafts nearly nothing acceptable; tiny_vocab: an 8-token target and a peaked random head over 5 of them,
    a third of whose drafts are accepted. Under `models_dir`, which a module of tests owns."""
    byte = save_tiny_llama(models_dir / "eagle_dis_byte", seed=4, layers=4, hidden=32)
    tv = save_tiny_llama(models_dir / "eagle_dis_tv", seed=10, layers=4, hidden=16, tiny_vocab=True, init_range=0.5)
    out = {}
    for name, path, draft_vocab, seed, std in (("byte", byte, 64, 1, 0.3), ("tiny_vocab", tv, 5, 4, 0.5)):
        target = load_model(ModelConfig(path=path, device=device))
        head = random_head(target.model.config, draft_vocab, seed=seed, std=std)
        out[name] = target, str(save_head(head, models_dir / f"{name}_{device}_head", torch.float32))
    return out


@pytest.fixture(scope="module")
def pairs(tmp_path_factory, device) -> dict:
    return build_pairs(tmp_path_factory.mktemp("eagle_pairs"), device)


@pytest.fixture(scope="module")
def byte_pair(pairs):
    return pairs["byte"]


@pytest.fixture(scope="module")
def tiny_vocab_pair(pairs):
    return pairs["tiny_vocab"]


def prompts_of(target, pair_name: str) -> list[list[int]]:
    if pair_name == "byte":
        return [target.tokenizer(p)["input_ids"] for p in BYTE_PROMPTS]
    return [[1, 3, 4, 3, 4, 3], [1, 5, 6], [1, 7, 3, 5, 4, 6, 7, 3, 4, 5, 6, 7, 5, 3]]


def generate_recording_features(target, head_dir: str, requests) -> tuple[list, Pipeline, dict]:
    """Run `requests` on two head draft workers and two targets; also returns request id -> [(start, features)] as
    each head got them."""
    handed = {}

    async def main():
        async with LocalWorkers(target, [], n_targets=2, eagle_head=head_dir, eagle_drafts=2) as w:
            for worker in w.drafts.values():
                add = worker.drafter.add_features
                worker.drafter.add_features = lambda rid, start, f, add=add: (
                    handed.setdefault(rid, []).append((start, f)) or add(rid, start, f)
                )
            results, pipeline = await generate_all(w, requests)
            assert_all_released(w)
            return results, pipeline

    results, pipeline = asyncio.run(main())
    return results, pipeline, handed


async def generate_all(w: LocalWorkers, requests, during=None, reconnect=None, predraft=True):
    """Generate every (prompt ids, params, spec) concurrently through a Scheduler + Pipeline on `w`'s workers, with
    no stop token (so every position the target commits is one the request keeps)."""
    drafts = {n: DraftClient(a, timeout_s=30) for n, a in w.draft_addresses.items()}
    targets = {n: TargetClient(a, timeout_s=30) for n, a in w.target_addresses.items()}
    pipeline = Pipeline(Scheduler(list(drafts), list(targets)), drafts, targets, predraft=predraft, reconnect=reconnect)
    jobs = [pipeline.generate(ids, params, spec, frozenset()) for ids, params, spec in requests]
    if during is not None:
        jobs.append(during(pipeline))
    results = await asyncio.gather(*jobs)
    await pipeline.drain_releases()
    for client in (*pipeline.drafts.values(), *pipeline.targets.values()):
        await client.close()
    return results[: len(requests)], pipeline


def greedy(max_new: int, method: str = "eagle", k=3):
    return SamplingParams(max_new_tokens=max_new), SpecParams(method=method, k=k)


def assert_all_released(w: LocalWorkers) -> None:
    for worker in (*w.drafts.values(), *w.targets.values()):
        assert len(worker.committed) == 0
    for worker in w.drafts.values():
        assert not worker.drafter.drafting._requests and not worker.drafter._pending


@pytest.mark.parametrize("pair_name", ["byte", "tiny_vocab"])
def test_concurrent_greedy_requests_are_identical_to_target_only(pairs, pair_name):
    """Prompts of different lengths, k fixed and auto, two head draft workers and two targets, and requests of other
    methods in the same target batches (rows that want features beside rows that do not)."""
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
        return NO_DRAFT if req.state.stats.rounds % 6 in (2, 3, 4) else out

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
                    await _until(lambda: pipeline.scheduler.feature_traffic.proposes >= 4)
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
    assert sum(r.resent for r in results) >= 1 and pipeline.restarts == 1
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


def sample_disaggregated(target, head_dir: str, params: SamplingParams, spec: SpecParams, samples: int) -> list:
    """One seeded request per seed 0..samples-1, 64 at a time, through a head draft worker and a target worker."""

    async def main():
        async with LocalWorkers(target, [], eagle_head=head_dir) as w:
            drafts = {n: DraftClient(a, 30) for n, a in w.draft_addresses.items()}
            targets = {n: TargetClient(a, 30) for n, a in w.target_addresses.items()}
            pipeline = Pipeline(Scheduler(list(drafts), list(targets)), drafts, targets)
            running = asyncio.Semaphore(64)

            async def one(seed):
                async with running:
                    seeded = params.model_copy(update={"seed": seed})
                    return await pipeline.generate(PROMPT, seeded, spec, frozenset())

            results = await asyncio.gather(*(one(seed) for seed in range(samples)))
            await pipeline.drain_releases()
            return results

    return asyncio.run(main())


@pytest.mark.slow
def test_sampling_through_the_workers_matches_the_targets_distribution(tiny_vocab_pair):
    """2,500 seeded requests (about 20 s on 2 cores), 64 at a time: top-p truncates both distributions and the head
    never proposes 3 of the 8 tokens (the target's mass there comes through recovered tokens only). The chi-square
    test of tests/workers/test_engine_sampling.py against the exact joint of the next 3 tokens."""
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
    assert req.draft_worker == "d1" and s.k_for(req) == 0  # no features before the prefill: a target-only round
    verify = s.plan_verify(req, [], b"")
    assert verify.want_features
    s.apply_verify(req, [], 0, 9, feature_block(0, torch.ones(3, WIDTH)).encode())
    assert s.k_for(req) == 3
    draft = s.plan_draft(req, 3)
    assert draft.features == req.features.to_send() and draft.committed_len == 4
    assert s.plan_predraft(req, [5, 6, 7], 3) is None  # round r + 1 needs round r's features
    s.drafted(req, draft)
    assert req.features.pending is None and s.k_for(req) == 0
    s.remove_worker("d1")
    assert req.draft_worker is None and not s.plan_verify(req, [], b"").want_features
    other = s.add([1, 2], SamplingParams(), SpecParams(method="draft"), frozenset())
    assert other.features is None and not s.plan_verify(other, [], b"").want_features
    with pytest.raises(InvalidRequestError, match="'medusa' is not served") as e:
        s.add([1, 2], SamplingParams(), SpecParams.model_construct(method="medusa", k=4), frozenset())
    assert e.value.field == "method"


# -- the edge and the serving path -----------------------------------------------------------------------------------


def app_with(target_path: str, draft: str) -> AppConfig:
    return AppConfig.model_validate({"models": [{"name": "m", "target": target_path, "draft": draft, "device": "cpu"}],
                                     "auth": {"api_key_env": None}})  # fmt: skip


@pytest.mark.parametrize("method", ["eagle", "eagle+ngram", "eagle-tree"])
def test_the_edge_takes_the_head_methods_only_for_a_model_served_with_a_head(byte_pair, method):
    """Both edges take "eagle", "eagle+ngram" and "eagle-tree"; a model served with a head drafts with "eagle+ngram"
    by default."""
    target, head_dir = byte_pair
    with_head = RequestPreparer(app_with(target.path, head_dir), {"m": (target.path, head_dir)})
    without = RequestPreparer(app_with(target.path, "ngram"), {"m": (target.path, None)})
    http = oai.parse_completion({"prompt": "x", "speculation": {"method": method, "k": 2}}).request
    grpc_request = request_from_proto(pb.GenerateRequest(prompt="x", speculation=pb.SpeculationOptions(method=method)))
    default = oai.parse_completion({"prompt": "x"}).request
    assert with_head.prepare(http).spec.method == method and with_head.prepare(default).spec.method == "eagle+ngram"
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


@dataclass
class ServedRun:
    paths: tuple[str, str | None]  # the model's resolved (target, draft) directories
    prepared: Prepared
    out: dict  # the scheduler replica's reply
    status: dict  # the scheduler replica's status of the model


def run_the_serving_path(app: AppConfig, prompt: str, max_tokens: int, speculation: dict | None = None) -> ServedRun:
    """What the Serve app runs for the first model of `app`, without Ray: the pool replicas' worker bodies (the draft
    pool runs the head, the target pool captures its features), the ingress's RequestPreparer (a greedy request,
    without a method unless `speculation` says) and the scheduler replica's SpecService."""
    from specserve.cluster.serve.pool_worker import _worker_body
    from specserve.cluster.serve.replica_env import resolve_paths

    name = app.models[0].name
    paths = {name: resolve_paths(app.models[0])}
    bodies = {kind: _worker_body(app.models[0], kind) for kind in ("target", "draft")}
    assert bodies["draft"].runner is None and bodies["target"].runner.capture_layers == (2, 2, 1)
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    request = oai.parse_completion({**body, "speculation": speculation} if speculation else body).request
    prepared = RequestPreparer(app, paths).prepare(request)

    async def main():
        rows = [{"model": name, "kind": kind, "worker_id": f"{kind}-0", "address": await body.start()}
                for kind, body in bodies.items()]  # fmt: skip
        service = SpecService(app, paths)
        service.sync_workers(rows)
        out = await service.generate(prepared)
        pipeline = service.models[name].pipeline
        await pipeline.drain_releases()
        for client in (*pipeline.drafts.values(), *pipeline.targets.values()):
            await client.close()
        for body in bodies.values():
            await body.server.stop(None)
        return out, service.status()[name]

    out, status = asyncio.run(main())
    return ServedRun(paths[name], prepared, out, status)


def test_a_model_served_with_a_head_runs_through_the_serving_path(byte_pair):
    """No method: "eagle+ngram", the head's default (k fixed: a tiny random head would rarely pay under k='auto').
    Greedy output identical to target-only; the replica's status reports feature bytes."""
    target, head_dir = byte_pair
    run = run_the_serving_path(app_with(target.path, head_dir), BYTE_PROMPTS[0], 24, speculation={"k": 3})
    assert run.paths == (target.path, head_dir) and run.prepared.spec.method == "eagle+ngram"
    assert run.out["token_ids"] == own_greedy_loop(target.model, run.prepared.prompt_ids, 24, {2})
    assert run.out["stats"]["drafted"] > 0
    assert run.status["feature_bytes_per_verify_reply"] > 0 and run.status["feature_bytes_per_propose"] > 0


async def _until(condition, timeout_s: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("timed out waiting")
        await asyncio.sleep(0.002)


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
    from tests.cluster.test_serve_app import free_port

    target, head_dir = byte_pair
    if target.device.type != "cpu":
        pytest.skip("the app serves on cpu: once is enough")
    pool = {"num_cpus": 0.5}
    app = AppConfig.model_validate(
        {"models": [{"name": "tiny", "target": target.path, "draft": head_dir, "device": "cpu", "target_pool": pool,
                     "draft_pool": pool}],
         "ingress": {"num_cpus": 0.5, "call_timeout_s": 30, "worker_wait_s": 60}, "auth": {"api_key_env": None}}
    )  # fmt: skip
    ray.init(num_cpus=4, include_dashboard=False, configure_logging=False, log_to_driver=False)
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
