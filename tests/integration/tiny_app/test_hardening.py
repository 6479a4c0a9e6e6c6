"""The Serve app on a local Ray (the package's app, conftest.py) under hostile or unlucky conditions: oversize gRPC
messages and HTTP bodies refused with the memory of Serve's proxy and the ingress bounded, and the
registry actor killed (and restarted by Ray) mid-traffic without a failed request."""

import http.client
import json
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import grpc
import psutil
import pytest
import ray

from specserve.client import SpecServeClient
from specserve.cluster.serve.registry import REGISTRY_NAMESPACE, registry_name
from specserve.cluster.serve.scheduler_replica import REJOIN_S
from specserve.protos import specserve_pb2 as pb
from specserve.protos import specserve_pb2_grpc as pb_grpc
from specserve.workers.service.grpc_service import GRPC_OPTIONS

pytestmark = pytest.mark.slow

OVERSIZE = 64_000_000  # characters: a 64 MB prompt or body, sixteen times the 4 MiB limits
MB = 1024 * 1024


def _serve_processes() -> list[psutil.Process]:
    """Serve's proxy and the ingress replicas: the processes an oversize request reaches."""
    procs = psutil.Process().children(recursive=True)
    found = [p for p in procs if p.name().startswith(("ray::ProxyActor", "ray::ServeReplica:specserve:ingress"))]
    assert len(found) == 2, [p.name() for p in procs]
    return found


class PeakRss:
    """Samples the processes' RSS every few milliseconds; `growth` is each one's peak above its start."""

    def __init__(self, procs: list[psutil.Process]):
        self.procs, self.start = procs, {p.pid: p.memory_info().rss for p in procs}
        self.peak, self._stop = dict(self.start), threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.is_set():
            for p in self.procs:
                self.peak[p.pid] = max(self.peak[p.pid], p.memory_info().rss)
            time.sleep(0.005)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    def growth(self) -> dict[str, float]:
        return {p.name().split(".")[0]: (self.peak[p.pid] - self.start[p.pid]) / MB for p in self.procs}


def _oversize_grpc(address: str) -> grpc.StatusCode:
    with grpc.insecure_channel(address, options=GRPC_OPTIONS) as channel:
        try:
            pb_grpc.SpecServeStub(channel).Generate(pb.GenerateRequest(prompt="x" * OVERSIZE), timeout=60,
                                                    metadata=(("application", "specserve"),))  # fmt: skip
        except grpc.RpcError as e:
            return e.code()
    return grpc.StatusCode.OK


def _oversize_http(url: str, chunked: bool = False) -> int | str:
    host, port = url.removeprefix("http://").split(":")
    body = b'{"model": "tiny", "prompt": "' + b"x" * OVERSIZE + b'"}'
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    try:
        if chunked:  # no Content-Length: the limit must hold while the body streams in
            conn.request("POST", "/v1/completions", body=(body[i : i + MB] for i in range(0, len(body), MB)),
                         headers={"content-type": "application/json"}, encode_chunked=True)  # fmt: skip
        else:
            conn.request("POST", "/v1/completions", body=body, headers={"content-type": "application/json"})
        return conn.getresponse().status
    except (ConnectionError, http.client.HTTPException) as e:  # the server may answer and close mid-upload
        return type(e).__name__
    finally:
        conn.close()


def _normal_requests_work(server) -> None:
    with SpecServeClient(server["grpc"], timeout_s=120) as client:
        assert client.generate("def add(a, b):", max_new_tokens=8, k=2)["token_ids"]
    body = json.dumps({"model": "tiny", "prompt": "import json", "max_tokens": 8}).encode()
    req = urllib.request.Request(server["http"] + "/v1/completions", data=body,
                                 headers={"content-type": "application/json"})  # fmt: skip
    assert json.loads(urllib.request.urlopen(req, timeout=120).read())["choices"][0]["text"] is not None


def test_oversize_requests_are_refused_and_memory_stays_bounded(server):
    procs = _serve_processes()
    _normal_requests_work(server)
    # First use of the refusal paths (connection and buffer setup) before the baseline.
    assert _oversize_grpc(server["grpc"]) == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert _oversize_http(server["http"]) == 413
    with PeakRss(procs) as rss:
        codes = [_oversize_grpc(server["grpc"]) for _ in range(4)]
        with ThreadPoolExecutor(4) as pool:
            codes += list(pool.map(lambda _: _oversize_grpc(server["grpc"]), range(4)))
        statuses = [_oversize_http(server["http"]) for _ in range(3)]
        statuses += [_oversize_http(server["http"], chunked=True) for _ in range(2)]
        with ThreadPoolExecutor(3) as pool:
            statuses += list(pool.map(lambda _: _oversize_http(server["http"]), range(3)))
    growth = rss.growth()
    print(f"\npeak RSS growth over 8 gRPC messages and 8 HTTP bodies of 64 MB (MB): {growth}")
    assert codes == [grpc.StatusCode.RESOURCE_EXHAUSTED] * 8
    assert statuses.count(413) >= 6 and set(statuses) <= {413, "ConnectionResetError", "BrokenPipeError"}
    # None was buffered whole (it was ~2.5 GB for three): whole buffering is at least 61 MB a message, and three or
    # four arrive at once, so at least 183 MB. The refusals' own buffers (the 4 MiB limits, read-ahead, the drain)
    # come to 12-20 MB alone, and reached 48 and 73 MB in CI with the suite's other Ray processes beside them: the
    # bound is two messages, under what the concurrent ones would hold whole.
    assert max(growth.values()) < 2 * OVERSIZE / MB, growth
    _normal_requests_work(server)


def _secret_after_restart(registry, timeout_s: float = 60) -> str:
    """The restarted actor's secret; a call that reaches it while Ray is still restarting it fails fast
    (ActorUnavailableError), so it is retried until the deadline."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return ray.get(registry.secret.remote(), timeout=timeout_s)
        except ray.exceptions.ActorUnavailableError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def test_registry_restart_mid_traffic_loses_no_request(server):
    registry = ray.get_actor(registry_name(server["app"]), namespace=REGISTRY_NAMESPACE)
    secret = ray.get(registry.secret.remote())
    before = {m["worker_id"] for m in ray.get(registry.members.remote())[1]}
    assert {w.split("-")[0] for w in before} == {"draft", "target"}
    results, stop_at = [], [time.monotonic() + 3600]
    lock = threading.Lock()

    def traffic(i):
        with SpecServeClient(server["grpc"], timeout_s=120, retries=0) as client:
            while time.monotonic() < stop_at[0]:
                try:
                    if i % 2:
                        out = client.generate(f"def f{i}(x):", max_new_tokens=12, k=3)
                    else:
                        chunks = list(client.generate_stream(f"class C{i}:", max_new_tokens=12, k=3))
                        out = {"token_ids": sum((c["token_ids"] for c in chunks), [])}
                    ok = bool(out["token_ids"])
                except grpc.RpcError as e:
                    ok = f"{e.code().name}: {e.details()}"
                with lock:
                    results.append((time.monotonic(), ok))

    with ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(traffic, i) for i in range(4)]
        try:
            time.sleep(3)
            killed_at = time.monotonic()
            ray.kill(registry, no_restart=False)
            assert _secret_after_restart(registry) == secret  # restarted by Ray, with the same secret
            # Past the rejoin window: every worker has re-registered and the schedulers trust the registry again.
            stop_at[0] = time.monotonic() + REJOIN_S + 5
        finally:
            stop_at[0] = min(stop_at[0], time.monotonic() + REJOIN_S + 5)  # a failure above ends the traffic too
        for f in futures:
            f.result()
    failed = [ok for _, ok in results if ok is not True]
    assert failed == []
    assert len([t for t, _ in results if t > killed_at]) >= 8  # requests ran across the restart
    after = {m["worker_id"] for m in ray.get(registry.members.remote())[1]}
    assert after == before  # the same replicas, re-registered
    _normal_requests_work(server)
