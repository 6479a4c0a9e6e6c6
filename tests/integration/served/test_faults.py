"""Faults on a running Serve app (local Ray): a draft replica killed mid-stream (requests go target-only for the failed
round, then re-attach to the healthy draft replica; Serve replaces the dead one), a target replica killed mid-
request (its requests re-prefill on the other replica), and the scheduler replica killed (in-flight calls end with
UNAVAILABLE, never a truncated success; the client retries Generate). Greedy outputs stay identical to target-only
decoding; no request is lost."""

import json
import threading
import time
import urllib.request

import grpc
import pytest
import ray
from ray import serve

from specserve.client import SpecServeClient
from specserve.cluster.app_config import AppConfig, serve_config
from specserve.cluster.serve.local_ray import init_ray
from specserve.cluster.serve.server import start, stop
from specserve.workers.config.request import SamplingParams, SpecParams
from specserve.workers.config.settings import ModelConfig
from specserve.workers.runtime.loading import load_model
from specserve.workers.service.local_processes import free_port
from specserve.workers.speculation.engine import SpecEngine

pytestmark = pytest.mark.slow

PROMPTS = ["def add(a, b):", "class Stack:", "for i in range(3):", "import json"]
N = 120


@pytest.fixture(scope="module")
def reference(tiny_target):
    engine = SpecEngine(load_model(ModelConfig(path=tiny_target, device="cpu")))
    return [engine.generate(p, SamplingParams(max_new_tokens=N), SpecParams(method="none")).token_ids for p in PROMPTS]


@pytest.fixture(scope="module")
def server(tiny_target, tiny_draft):
    app = AppConfig.model_validate(
        {"models": [{"name": "tiny", "target": tiny_target, "draft": tiny_draft, "device": "cpu", "predraft": False,
                     "target_pool": {"num_cpus": 0.25, "replicas": 2},
                     "draft_pool": {"num_cpus": 0.25, "replicas": 2}}],
         "scheduler": {"num_cpus": 0.25, "worker_wait_s": 120}}
    )  # fmt: skip
    init_ray(num_cpus=4, include_dashboard=False, configure_logging=False, log_to_driver=False)
    info = start(serve_config(app, grpc_port=free_port(), http_port=free_port()), ready_timeout_s=300)
    yield info
    stop({**info, "started_ray": False})
    ray.shutdown()


def _replica(deployment: str):
    """(actor, worker id) of a live replica of the deployment (Serve names replica actors
    ...specserve#<deployment>#<replica id>; pool replicas register as <deployment>-<replica id>)."""
    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
             if a["namespace"] == "serve" and f"specserve#{deployment}#" in a["name"]]  # fmt: skip
    return ray.get_actor(names[0], namespace="serve"), f"{deployment}-{names[0].rsplit('#', 1)[-1]}"


def _streams(server, results: dict, errors: list, drafted_at: dict | None = None) -> list[threading.Thread]:
    def run(i):
        try:
            chunks = []
            with SpecServeClient(server["grpc"], timeout_s=300) as client:
                for chunk in client.generate_stream(PROMPTS[i], max_new_tokens=N, k=3):
                    if drafted_at is not None:
                        drafted_at.setdefault(("rounds", i), []).append(time.monotonic())
                    if drafted_at is not None and chunks and chunk["stats"]["drafted"] > chunks[-1]["stats"]["drafted"]:
                        drafted_at.setdefault(i, []).append(time.monotonic())  # this round used a draft worker
                    chunks.append(chunk)
            results[i] = (sum((c["token_ids"] for c in chunks), []), chunks[-1]["finish_reason"])
        except grpc.RpcError as e:
            errors.append((i, e.code(), e.details()))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    return threads


def _wait_until_all_stream(drafted_at: dict, timeout_s: float = 120) -> None:
    """Until every stream has had its first chunk (requests this short finish within a second: a fixed sleep before
    the fault could let them all finish first, and the fault would hit no request)."""
    deadline = time.monotonic() + timeout_s
    while not all(("rounds", i) in drafted_at for i in range(len(PROMPTS))):
        assert time.monotonic() < deadline, "the streams did not start"
        time.sleep(0.005)


def _healthy(server) -> dict:
    return json.loads(urllib.request.urlopen(server["http"] + "/health", timeout=30).read())["models"]["tiny"]


def test_killed_draft_replica_mid_stream(server, reference):
    before = _healthy(server)["drafts"]
    assert len(before) == 2
    results, errors, drafted_at = {}, [], {}
    threads = _streams(server, results, errors, drafted_at)
    actor, killed_id = _replica("draft-tiny")
    _wait_until_all_stream(drafted_at)
    killed = time.monotonic()
    assert killed_id in before
    ray.kill(actor, no_restart=True)  # Serve replaces the replica
    for t in threads:
        t.join(300)
    assert errors == [] and [results[i][0] for i in range(len(PROMPTS))] == reference
    # Every stream still running drafted again after the kill: on the surviving replica, long before the replacement
    # has loaded (a stream with fewer than 3 rounds left may have spent them on the failed round).
    running = [i for i in range(len(PROMPTS)) if len([t for t in drafted_at[("rounds", i)] if t > killed]) >= 3]
    reattached = {i: min([t for t in drafted_at.get(i, []) if t > killed], default=None) for i in running}
    assert running and all(t is not None for t in reattached.values()), reattached
    print(f"{len(running)} streams drafting again {max(reattached.values()) - killed:.2f} s after the kill (slowest)")
    # The dead replica leaves /health at its first failed call or when its registration expires (30 s without a
    # heartbeat), whichever comes first; its replacement joins once loaded.
    drafts = set(before)
    while time.monotonic() - killed < 120 and (killed_id in drafts or not drafts - set(before)):
        time.sleep(0.25)
        drafts = set(_healthy(server)["drafts"])
    assert killed_id not in drafts, f"the killed draft replica {killed_id} is still listed as healthy: {drafts}"
    assert drafts - set(before), f"no replacement draft replica joined: {drafts}"
    print(f"replacement draft replica joined, killed one gone, {time.monotonic() - killed:.1f} s after the kill")
    with SpecServeClient(server["grpc"], timeout_s=120) as client:
        out = client.generate(PROMPTS[0], max_new_tokens=N, k=3)
    assert out["token_ids"] == reference[0] and out["stats"]["drafted"] > 0  # drafting again


def test_killed_target_replica_mid_request(server, reference):
    results, errors, drafted_at = {}, [], {}
    threads = _streams(server, results, errors, drafted_at)
    actor, _ = _replica("target-tiny")
    _wait_until_all_stream(drafted_at)
    killed = time.monotonic()
    ray.kill(actor, no_restart=True)
    for t in threads:
        t.join(300)
    assert errors == [] and [results[i][0] for i in range(len(PROMPTS))] == reference
    # the fault hit requests in flight: streams went on committing rounds after it
    assert any(t > killed for i in range(len(PROMPTS)) for t in drafted_at[("rounds", i)])


def test_killed_scheduler_fails_in_flight_calls_with_unavailable_and_the_client_retries(server, reference):
    outcome, streaming = {}, threading.Event()

    def unary():
        with SpecServeClient(server["grpc"], timeout_s=300, retries=5) as client:
            outcome["unary"] = client.generate(PROMPTS[1], max_new_tokens=N, k=3)["token_ids"]

    def stream():
        try:
            chunks = []
            with SpecServeClient(server["grpc"], timeout_s=300) as client:
                for chunk in client.generate_stream(PROMPTS[2], max_new_tokens=400, k=3):  # long: cut mid-way
                    chunks.append(chunk)
                    streaming.set()
            outcome["stream"] = sum((c["token_ids"] for c in chunks), [])
        except grpc.RpcError as e:
            outcome["stream_error"], outcome["stream_details"] = e.code(), e.details()

    threads = [threading.Thread(target=unary), threading.Thread(target=stream)]
    for t in threads:
        t.start()
    assert streaming.wait(120)
    ray.kill(_replica("scheduler")[0], no_restart=True)
    for t in threads:
        t.join(300)
    assert outcome["unary"] == reference[1]  # retried on the replacement scheduler replica
    # the stream was cut mid-way: it ends with UNAVAILABLE, never as a truncated success
    assert "stream" not in outcome and outcome["stream_error"] == grpc.StatusCode.UNAVAILABLE, outcome
    assert "scheduler replica" in outcome["stream_details"]
    deadline = time.monotonic() + 120  # Serve replaces the scheduler replica and the app is healthy again
    while serve.status().applications["specserve"].status != "RUNNING" and time.monotonic() < deadline:
        time.sleep(1)
    assert serve.status().applications["specserve"].status == "RUNNING"
    with SpecServeClient(server["grpc"], timeout_s=120) as client:
        assert client.generate(PROMPTS[3], max_new_tokens=N, k=3)["token_ids"] == reference[3]
