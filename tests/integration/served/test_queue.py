"""Bursts queue instead of being refused (the Serve app on local Ray, tiny models): with the default settings 512
requests at once are all answered 200 while no more than `max_active_requests` run, the rest queued and their queue
time reported; with a small bound, the requests past it get 429 with Retry-After (RESOURCE_EXHAUSTED over gRPC), and
a queued request whose client leaves gives its place up."""

import json
import os
import signal
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import ray

from specserve.client import SpecServeClient
from specserve.cluster.app_config import AppConfig, serve_config
from specserve.cluster.serve.local_ray import init_ray
from specserve.cluster.serve.server import start, stop
from specserve.workers.service.local_processes import free_port

pytestmark = pytest.mark.slow


def _app(tiny_target: str, scheduler: dict):
    app = AppConfig.model_validate(
        {"models": [{"name": "tiny", "target": tiny_target, "draft": "ngram", "device": "cpu",
                     "target_pool": {"num_cpus": 0.5}}],
         "scheduler": {"num_cpus": 0.5, **scheduler}, "auth": {"api_key_env": None}}
    )  # fmt: skip
    init_ray(address="local", num_cpus=4, include_dashboard=False, configure_logging=False, log_to_driver=False)
    return start(serve_config(app, grpc_port=free_port(), http_port=free_port()), ready_timeout_s=300)


def _close(info) -> None:
    stop({**info, "started_ray": False})
    ray.shutdown()


def _post(info, body: dict, timeout_s: float = 300) -> tuple[int, dict, dict]:
    req = urllib.request.Request(info["http"] + "/v1/completions", json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})  # fmt: skip
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            return r.status, dict(r.headers), json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), json.loads(e.read())


def _admission(info) -> dict:
    try:
        with urllib.request.urlopen(info["http"] + "/health", timeout=30) as r:
            body = json.loads(r.read())
    except urllib.error.HTTPError as e:
        body = json.loads(e.read())
    return {**body["models"]["tiny"]["admission"], "active_requests": body["models"]["tiny"]["active_requests"]}


def _watch(info, seen: list, done: threading.Event) -> threading.Thread:
    def run():
        while not done.is_set():
            seen.append(_admission(info))
            time.sleep(0.1)

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def test_512_requests_at_once_are_all_answered_with_the_default_settings(tiny_target):
    info = _app(tiny_target, {})
    try:
        limit = AppConfig().scheduler.max_active_requests
        seen, done = [], threading.Event()
        watcher = _watch(info, seen, done)
        body = {"model": "tiny", "prompt": "def f(x):", "max_tokens": 8, "temperature": 0}
        with ThreadPoolExecutor(512) as pool:
            results = list(pool.map(lambda _: _post(info, body), range(512)))
        done.set()
        watcher.join()
        statuses = [s for s, _, _ in results]
        assert statuses == [200] * 512, {s: statuses.count(s) for s in set(statuses)}
        outputs = {tuple(r["choices"][0]["text"] for r in [out]) for _, _, out in results}
        assert len(outputs) == 1  # greedy: every answer the same
        assert max(s["running_requests"] for s in seen) <= limit and max(s["active_requests"] for s in seen) <= limit
        assert max(s["queued_requests"] for s in seen) > 0  # the burst queued
        final = _admission(info)
        assert final["refused_requests"] == 0 and final["queue_time_s_max"] > 0
        print(f"512 at once: all 200; most running {max(s['running_requests'] for s in seen)}, most queued "
              f"{max(s['queued_requests'] for s in seen)}; queue time p50 {final['queue_time_s_p50']:.2f} s, max "
              f"{final['queue_time_s_max']:.2f} s")  # fmt: skip
    finally:
        _close(info)


def _target_pid() -> int:
    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
             if a["namespace"] == "serve" and "specserve#target-tiny#" in a["name"]]  # fmt: skip
    return ray.get(ray.get_actor(names[0], namespace="serve").__ray_call__.remote(lambda self: os.getpid()))


def _until(predicate, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "not in time"
        time.sleep(0.05)


def test_past_the_bound_429_with_retry_after_and_a_leaving_client_frees_its_place(tiny_target):
    """The target worker is stopped (SIGSTOP) so that the running requests hold their slots while the test fills
    the queue; it continues before the scheduler's liveness check would declare it failed (call_timeout_s 60)."""
    info = _app(tiny_target, {"max_active_requests": 2, "max_queued_requests": 3})
    pid = _target_pid()
    body = {"model": "tiny", "prompt": "class Stack:", "max_tokens": 16, "temperature": 0}
    reference = _post(info, body)[2]["choices"][0]["text"]
    pool = ThreadPoolExecutor(8)
    os.kill(pid, signal.SIGSTOP)
    try:
        running = [pool.submit(_post, info, body) for _ in range(2)]
        _until(lambda: _admission(info)["running_requests"] == 2)
        queued = [pool.submit(_post, info, body) for _ in range(2)]
        _until(lambda: _admission(info)["queued_requests"] == 2)

        def leaving():
            with SpecServeClient(info["grpc"], timeout_s=3, retries=0) as client:
                try:
                    client.generate("class Stack:", max_new_tokens=16)
                except grpc.RpcError as e:
                    return e.code()

        left = pool.submit(leaving)
        _until(lambda: _admission(info)["queued_requests"] == 3)
        status, headers, error = _post(info, body)  # past the bound: refused at once
        assert status == 429 and headers["retry-after"] == "1", (status, error)
        assert "queued" in error["error"]["message"]
        with SpecServeClient(info["grpc"], timeout_s=30, retries=0) as client, pytest.raises(grpc.RpcError) as e:
            client.generate("class Stack:", max_new_tokens=16)
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert left.result(30) == grpc.StatusCode.DEADLINE_EXCEEDED
        _until(lambda: _admission(info)["queued_requests"] == 2)  # its place is free again
        queued.append(pool.submit(_post, info, body))
        _until(lambda: _admission(info)["queued_requests"] == 3)
    finally:
        os.kill(pid, signal.SIGCONT)
    try:
        answers = [f.result(120) for f in running + queued]
        assert [s for s, _, _ in answers] == [200] * 5
        assert all(out["choices"][0]["text"] == reference for _, _, out in answers)
        final = _admission(info)
        assert final["running_requests"] == final["queued_requests"] == 0 and final["refused_requests"] == 2
    finally:
        pool.shutdown()
        _close(info)
