"""Faults on a running Serve app (local Ray): a draft replica killed mid-stream (requests go target-only, then
re-attach to the restarted replica), a target replica killed mid-request (its requests re-prefill on the other
replica), and the ingress replica killed (in-flight calls end with an error status, never a truncated success; the
client retries Generate). Greedy outputs stay identical to target-only decoding; no request is lost."""

import json
import threading
import time
import urllib.request

import grpc
import pytest
import ray
from ray import serve

from specserve.cluster.app_config import AppConfig, serve_config
from specserve.cluster.client import SpecServeClient
from specserve.cluster.server import start, stop
from specserve.workers.config import ModelConfig, SamplingParams, SpecParams
from specserve.workers.engine import SpecEngine
from specserve.workers.loading import load_model

from .test_serve_app import free_port

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
                     "target_pool": {"num_cpus": 0.25, "replicas": 2}, "draft_pool": {"num_cpus": 0.25}}],
         "ingress": {"num_cpus": 0.25, "worker_wait_s": 120}}
    )  # fmt: skip
    ray.init(num_cpus=4, include_dashboard=False, configure_logging=False)
    info = start(serve_config(app, grpc_port=free_port(), http_port=free_port()), ready_timeout_s=300)
    yield info
    stop({**info, "started_ray": False})
    ray.shutdown()


def _replica_actor(deployment: str):
    """A live replica actor of the deployment (Serve names them ...specserve#<deployment>#<replica id>)."""
    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
             if a["namespace"] == "serve" and f"specserve#{deployment}#" in a["name"]]  # fmt: skip
    return ray.get_actor(names[0], namespace="serve")


def _streams(server, results: dict, errors: list) -> list[threading.Thread]:
    def run(i):
        try:
            with SpecServeClient(server["grpc"], timeout_s=300) as client:
                chunks = list(client.generate_stream(PROMPTS[i], max_new_tokens=N, k=3))
            results[i] = (sum((c["token_ids"] for c in chunks), []), chunks[-1]["finish_reason"])
        except grpc.RpcError as e:
            errors.append((i, e.code(), e.details()))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    return threads


def _healthy(server) -> dict:
    return json.loads(urllib.request.urlopen(server["http"] + "/health", timeout=30).read())["tiny"]


def test_killed_draft_replica_mid_stream(server, reference):
    before = _healthy(server)["drafts"]
    results, errors = {}, []
    threads = _streams(server, results, errors)
    time.sleep(1.0)
    killed = time.monotonic()
    ray.kill(_replica_actor("draft-tiny"), no_restart=True)  # Serve replaces the replica
    while time.monotonic() - killed < 120 and (set(_healthy(server)["drafts"]) - set(before)) == set():
        time.sleep(0.25)
    back_after_s = time.monotonic() - killed
    for t in threads:
        t.join(300)
    assert errors == [] and [results[i][0] for i in range(len(PROMPTS))] == reference
    assert set(_healthy(server)["drafts"]) - set(before), "the replacement draft replica joined"
    print(f"draft replica replaced and re-attached after {back_after_s:.1f} s")
    with SpecServeClient(server["grpc"], timeout_s=120) as client:
        out = client.generate(PROMPTS[0], max_new_tokens=N, k=3)
    assert out["token_ids"] == reference[0] and out["stats"]["drafted"] > 0  # drafting again


def test_killed_target_replica_mid_request(server, reference):
    results, errors = {}, []
    threads = _streams(server, results, errors)
    time.sleep(1.0)
    ray.kill(_replica_actor("target-tiny"), no_restart=True)
    for t in threads:
        t.join(300)
    assert errors == [] and [results[i][0] for i in range(len(PROMPTS))] == reference


def test_killed_ingress_fails_in_flight_calls_loudly_and_the_client_retries(server, reference):
    outcome = {}

    def unary():
        with SpecServeClient(server["grpc"], timeout_s=300, retries=5) as client:
            outcome["unary"] = client.generate(PROMPTS[1], max_new_tokens=N, k=3)["token_ids"]

    def stream():
        try:
            with SpecServeClient(server["grpc"], timeout_s=300) as client:
                chunks = list(client.generate_stream(PROMPTS[2], max_new_tokens=N, k=3))
            outcome["stream"] = sum((c["token_ids"] for c in chunks), [])
        except grpc.RpcError as e:
            outcome["stream_error"] = e.code()

    threads = [threading.Thread(target=unary), threading.Thread(target=stream)]
    for t in threads:
        t.start()
    time.sleep(1.0)
    ray.kill(_replica_actor("ingress"), no_restart=True)
    for t in threads:
        t.join(300)
    assert outcome["unary"] == reference[1]  # retried on the replacement ingress replica
    # the stream either finished before the kill (complete and correct) or ended with an error status
    assert outcome.get("stream") == reference[2] or outcome.get("stream_error") in (
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.INTERNAL,
    )
    deadline = time.monotonic() + 120  # Serve replaces the ingress replica and the app is healthy again
    while serve.status().applications["specserve"].status != "RUNNING" and time.monotonic() < deadline:
        time.sleep(1)
    assert serve.status().applications["specserve"].status == "RUNNING"
    with SpecServeClient(server["grpc"], timeout_s=120) as client:
        assert client.generate(PROMPTS[3], max_new_tokens=N, k=3)["token_ids"] == reference[3]
