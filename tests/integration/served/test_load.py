"""A bounded load test on loopback: 64 concurrent streams for 60 s within capacity (0 errors, 0 lost requests, KV
memory within the configured capacity), then a burst above capacity (RESOURCE_EXHAUSTED with a retry hint, never a
hang). Prints p50/p99 request latency; the figures go in the README, not into assertions."""

import os
import statistics
import threading
import time

import grpc
import pytest
import ray

from specserve.client import SpecServeClient
from specserve.cluster.app_config import AppConfig, serve_config
from specserve.cluster.serve.local_ray import init_ray
from specserve.cluster.serve.registry import REGISTRY_NAMESPACE, registry_name
from specserve.cluster.serve.server import start, stop
from specserve.protos import specserve_pb2 as pb
from specserve.protos import specserve_pb2_grpc as pb_grpc
from specserve.workers.service.local_processes import free_port

pytestmark = pytest.mark.slow

STREAMS, SECONDS = 64, float(os.environ.get("SPECSERVE_LOAD_SECONDS", "30"))
CAPACITY_TOKENS = 4096


def test_load_within_capacity_then_a_burst_above_it(tiny_target, tiny_draft):
    app = AppConfig.model_validate(
        {"models": [{"name": "tiny", "target": tiny_target, "draft": tiny_draft, "device": "cpu",
                     "target_pool": {"num_cpus": 0.25, "kv_cache": {"capacity_tokens": CAPACITY_TOKENS}},
                     "draft_pool": {"num_cpus": 0.25, "kv_cache": {"capacity_tokens": CAPACITY_TOKENS}}}],
         "scheduler": {"num_cpus": 0.25, "max_active_requests": STREAMS,
                       "max_queued_requests": STREAMS // 2}}
    )  # fmt: skip
    init_ray(num_cpus=4, include_dashboard=False, configure_logging=False, log_to_driver=False)
    info = start(serve_config(app, grpc_port=free_port(), http_port=free_port()), ready_timeout_s=300)
    try:
        registry = ray.get_actor(registry_name("specserve"), namespace=REGISTRY_NAMESPACE)
        secret = ray.get(registry.secret.remote())
        workers = {m["address"]: m["kind"] for m in ray.get(registry.members.remote())[1]}
        kv_peak = {a: 0 for a in workers}
        latencies, errors, started, finished = [], [], [0], [0]
        stop_at = time.monotonic() + SECONDS
        lock = threading.Lock()

        def stream(i):
            with SpecServeClient(info["grpc"], timeout_s=120, retries=0) as client:
                while time.monotonic() < stop_at:
                    t0 = time.perf_counter()
                    with lock:
                        started[0] += 1
                    try:
                        out = client.generate(f"def f{i}(x):", max_new_tokens=16, k=3)
                        assert len(out["token_ids"]) == 16 or out["finish_reason"] == "stop"
                        with lock:
                            finished[0] += 1
                            latencies.append(time.perf_counter() - t0)
                    except grpc.RpcError as e:
                        with lock:
                            errors.append((e.code(), e.details()))

        def watch_kv():
            try:
                while time.monotonic() < stop_at:
                    for address, kind in workers.items():
                        stub = pb_grpc.TargetWorkerStub if kind == "target" else pb_grpc.DraftWorkerStub
                        with grpc.insecure_channel(address) as channel:
                            h = stub(channel).Health(
                                pb.HealthRequest(), timeout=30, metadata=(("x-specserve-secret", secret),)
                            )
                        kv_peak[address] = max(kv_peak[address], h.kv_used_tokens)
                        assert h.kv_capacity_tokens == CAPACITY_TOKENS
                    time.sleep(0.5)
            except Exception as e:  # noqa: BLE001 - reported by the main thread
                errors.append(("watcher", repr(e)))

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(STREAMS)]
        threads.append(threading.Thread(target=watch_kv))
        for t in threads:
            t.start()
        for t in threads:
            t.join(SECONDS + 180)
        assert not any(t.is_alive() for t in threads), "a request hung"
        assert errors == [] and finished[0] == started[0] > STREAMS  # none failed, none lost
        assert all(0 < peak <= CAPACITY_TOKENS for peak in kv_peak.values())
        p50, p99 = statistics.median(latencies), statistics.quantiles(latencies, n=100)[98]
        print(
            f"\nload: {STREAMS} streams x {SECONDS:.0f} s: {finished[0]} requests, 0 errors, "
            f"latency p50 {p50 * 1e3:.0f} ms p99 {p99 * 1e3:.0f} ms, KV peak {max(kv_peak.values())} tokens"
        )

        # A burst above capacity: twice the streams at once; half of the excess queues, the rest is told to retry,
        # nothing hangs.
        burst: list = []

        def one(i):
            with SpecServeClient(info["grpc"], timeout_s=120, retries=0) as client:
                try:
                    out = client.generate(f"def g{i}(x):", max_new_tokens=16, k=3)
                    burst.append(len(out["token_ids"]) == 16 or out["finish_reason"] == "stop")
                except grpc.RpcError as e:
                    burst.append((e.code(), e.details()))

        threads = [threading.Thread(target=one, args=(i,)) for i in range(2 * STREAMS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(180)
        assert not any(t.is_alive() for t in threads) and len(burst) == 2 * STREAMS
        rejected = [b for b in burst if isinstance(b, tuple)]
        assert rejected and all(c == grpc.StatusCode.RESOURCE_EXHAUSTED and "retry after" in d for c, d in rejected)
        assert all(b is True for b in burst if not isinstance(b, tuple))  # served ones complete
        assert len(burst) - len(rejected) >= STREAMS + STREAMS // 2  # running and queued ones
        print(f"burst: {2 * STREAMS} at once: {len(burst) - len(rejected)} served, {len(rejected)} RESOURCE_EXHAUSTED")
    finally:
        stop({**info, "started_ray": False})
        ray.shutdown()
