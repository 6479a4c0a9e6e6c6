"""A stopped target worker process on the running Serve app (local Ray): SIGSTOP while a request streams; the
scheduler declares the worker failed within `call_timeout_s` (`/health` turns 503, naming it), the request waits for
a target; SIGCONT: the worker answers its health check, rejoins without a restart of anything, `/health` is 200
again, the waiting request finishes and the next one succeeds, every output identical to target-only decoding."""

import json
import os
import signal
import threading
import time

import pytest
import ray

from specserve.client import SpecServeClient
from specserve.cluster.app_config import AppConfig, serve_config
from specserve.cluster.serve.local_ray import init_ray
from specserve.cluster.serve.server import start, stop
from specserve.workers.config.request import SamplingParams, SpecParams
from specserve.workers.config.settings import ModelConfig
from specserve.workers.runtime.loading import load_model
from specserve.workers.service.local_processes import free_port
from specserve.workers.speculation.engine import SpecEngine
from tests.helpers.serve_app import http_health

pytestmark = pytest.mark.slow

PROMPTS = ["def add(a, b):", "class Stack:"]
N = 400  # long enough to be mid-stream when the worker stops
CALL_TIMEOUT_S = 2.0


@pytest.fixture(scope="module")
def reference(tiny_target):
    engine = SpecEngine(load_model(ModelConfig(path=tiny_target, device="cpu")))
    return [engine.generate(p, SamplingParams(max_new_tokens=N), SpecParams(method="none")).token_ids for p in PROMPTS]


@pytest.fixture(scope="module")
def server(tiny_target):
    app = AppConfig.model_validate(
        {"models": [{"name": "tiny", "target": tiny_target, "draft": "ngram", "device": "cpu",
                     "target_pool": {"num_cpus": 0.5}}],
         "scheduler": {"num_cpus": 0.5, "call_timeout_s": CALL_TIMEOUT_S, "worker_wait_s": 120},
         "auth": {"api_key_env": None}}
    )  # fmt: skip
    init_ray(address="local", num_cpus=4, include_dashboard=False, configure_logging=False, log_to_driver=False)
    info = start(serve_config(app, grpc_port=free_port(), http_port=free_port()), ready_timeout_s=300)
    yield info
    stop({**info, "started_ray": False})
    ray.shutdown()


def _target_pid() -> int:
    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
             if a["namespace"] == "serve" and "specserve#target-tiny#" in a["name"]]  # fmt: skip
    assert len(names) == 1, names
    actor = ray.get_actor(names[0], namespace="serve")
    return ray.get(actor.__ray_call__.remote(lambda self: os.getpid()))


def _until(predicate, timeout_s: float, step_s: float = 0.05) -> float:
    """Seconds until `predicate()` held; fails at the timeout."""
    start = time.monotonic()
    while not predicate():
        assert time.monotonic() - start < timeout_s, f"not within {timeout_s} s"
        time.sleep(step_s)
    return time.monotonic() - start


def test_a_stopped_target_is_declared_failed_and_rejoins_after_sigcont(server, reference):
    assert http_health(server)[0] == 200
    pid = _target_pid()
    streaming, outcome = threading.Event(), {}

    def stream():
        try:
            tokens = []
            with SpecServeClient(server["grpc"], timeout_s=300) as client:
                for chunk in client.generate_stream(PROMPTS[0], max_new_tokens=N, k=3):
                    tokens += chunk["token_ids"]
                    streaming.set()
                    outcome["last_at"] = time.monotonic()
            outcome["tokens"] = tokens
        except Exception as e:  # noqa: BLE001 - the assertion below shows it
            outcome["error"] = e

    thread = threading.Thread(target=stream)
    thread.start()
    assert streaming.wait(120)
    os.kill(pid, signal.SIGSTOP)
    stopped = time.monotonic()
    try:
        failed_after = _until(lambda: http_health(server)[0] == 503, 30)
        status, body = http_health(server)
        assert "no healthy target worker" in json.dumps(body), body
    finally:
        os.kill(pid, signal.SIGCONT)
    resumed = time.monotonic()
    # Declared failed within call_timeout_s of the stop (a little more: /health is polled every 50 ms, through Serve)
    assert failed_after < CALL_TIMEOUT_S + 1.0, failed_after
    rejoined_after = _until(lambda: http_health(server)[0] == 200, 30)
    thread.join(300)
    assert "error" not in outcome, outcome
    assert outcome["tokens"] == reference[0]
    assert outcome["last_at"] > resumed  # it was mid-stream: its rounds went on after the worker came back
    with SpecServeClient(server["grpc"], timeout_s=120) as client:
        assert client.generate(PROMPTS[1], max_new_tokens=N, k=3)["token_ids"] == reference[1]
    assert _target_pid() == pid  # the same process, not a replacement
    print(f"declared failed {failed_after:.2f} s after SIGSTOP (stopped {resumed - stopped:.2f} s); /health 200 "
          f"{rejoined_after:.2f} s after SIGCONT")  # fmt: skip
