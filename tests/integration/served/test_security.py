"""Security and admission on a running Serve app: the public gRPC and HTTP endpoints require the API key when one is
set (UNAUTHENTICATED / 401 otherwise), HTTP over TLS, gRPC over TLS through the gateway, the pools' worker ports
reject calls without the app's shared secret, and requests above the configured capacity get RESOURCE_EXHAUSTED /
429 with a retry hint, never a hang."""

import http.client
import json
import ssl
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import ray

from specserve.client import SpecServeClient
from specserve.cluster.app_config import AppConfig, serve_config
from specserve.cluster.serve.local_ray import init_ray
from specserve.cluster.serve.registry import REGISTRY_NAMESPACE, registry_name
from specserve.cluster.serve.server import start, stop
from specserve.cluster.serve.tls_gateway import GatewayConfig, GatewayThread
from specserve.protos import specserve_pb2 as pb
from specserve.protos import specserve_pb2_grpc as pb_grpc
from specserve.workers.service.local_processes import free_port
from tests.helpers.tls_certs import CertAuthority

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(tiny_target, tmp_path_factory):
    mp = pytest.MonkeyPatch()
    mp.setenv("SPECSERVE_TEST_API_KEY", "k-123")  # inherited by the local Ray's workers
    app = AppConfig.model_validate(
        {"models": [{"name": "tiny", "target": tiny_target, "draft": "ngram", "device": "cpu",
                     "target_pool": {"num_cpus": 0.5}}],
         "scheduler": {"num_cpus": 0.5, "max_active_requests": 2, "max_queued_requests": 2},
         "auth": {"api_key_env": "SPECSERVE_TEST_API_KEY"}}
    )  # fmt: skip
    config = serve_config(app, grpc_port=free_port(), http_port=free_port())
    ca = CertAuthority(tmp_path_factory.mktemp("tls"))
    key_file, cert_file = ca.issue("server")
    config["http_options"].update(ssl_keyfile=key_file, ssl_certfile=cert_file)
    init_ray(num_cpus=4, include_dashboard=False, configure_logging=False, log_to_driver=False)
    info = start(config, ready_timeout_s=300)
    info["tls"] = ssl.create_default_context(cafile=ca.cert_file)
    gateway = GatewayThread(GatewayConfig(listen="127.0.0.1:0", upstream=info["grpc"], certfile=cert_file,
                                          keyfile=key_file))  # fmt: skip
    info["grpc_tls"], info["ca"] = f"127.0.0.1:{gateway.port}", ca.cert_file
    yield info
    gateway.stop()
    stop({**info, "started_ray": False})
    ray.shutdown()
    mp.undo()


def post(server, path: str, body: dict, key: str | None) -> tuple[int, dict, dict]:
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    req = urllib.request.Request(server["http"] + path, json.dumps(body).encode(), headers, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=120, context=server["tls"]) as r:
            return r.status, dict(r.headers), json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), json.loads(e.read())


def test_grpc_requires_the_api_key(server):
    for token in (None, "wrong"):
        with SpecServeClient(server["grpc"], timeout_s=60, token=token) as client, pytest.raises(grpc.RpcError) as e:
            client.generate("def f(x):", max_new_tokens=4)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED and "API key" in e.value.details()
    with SpecServeClient(server["grpc"], timeout_s=60, token="k-123") as client:
        assert len(client.generate("def f(x):", max_new_tokens=4)["token_ids"]) == 4


def test_grpc_over_tls_through_the_gateway(server):
    with SpecServeClient(server["grpc_tls"], timeout_s=60, ca_file=server["ca"]) as client:
        with pytest.raises(grpc.RpcError) as e:
            client.generate("def f(x):", max_new_tokens=4)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED  # the app's own auth still applies
    with SpecServeClient(server["grpc"], timeout_s=60, token="k-123") as plain:
        expected = plain.generate("def f(x):", max_new_tokens=12, method="none")["token_ids"]
    with SpecServeClient(server["grpc_tls"], timeout_s=60, token="k-123", ca_file=server["ca"]) as client:
        assert client.generate("def f(x):", max_new_tokens=12, method="none")["token_ids"] == expected
        chunks = list(client.generate_stream("def f(x):", max_new_tokens=12))
        assert sum((c["token_ids"] for c in chunks), []) == expected and chunks[-1]["finish_reason"] == "length"
        with pytest.raises(grpc.RpcError) as e:
            client.generate("def f(x):", max_new_tokens=4, temperature=float("nan"))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "temperature" in e.value.details()


def test_https_requires_the_api_key(server):
    assert server["http"].startswith("https://")
    body = {"model": "tiny", "prompt": "x", "max_tokens": 2, "temperature": 0}
    for key in (None, "wrong"):
        status, _, out = post(server, "/v1/completions", body, key)
        assert status == 401 and out["error"]["type"] == "authentication_error"
    status, _, out = post(server, "/v1/completions", body, "k-123")
    assert status == 200 and out["usage"]["completion_tokens"] == 2
    with pytest.raises(urllib.error.URLError, match="CERTIFICATE_VERIFY_FAILED"):  # an untrusting client
        urllib.request.urlopen(server["http"] + "/health", timeout=30, context=ssl.create_default_context())


def test_odd_api_keys_and_bodies_are_refused_not_crashed(server):
    host, port = server["http"].removeprefix("https://").rsplit(":", 1)
    body = json.dumps({"model": "tiny", "prompt": "x", "max_tokens": 2}).encode()
    keys = [b"Bearer \xed\xa0\x80", b"Bearer \xff\xfe", b"\xed\xb0\x80", b"Bearer k-123\xc3\xa9",
            b"Bearer " + b"k" * 6000, b"Basic k-123", b"Bearer"]  # fmt: skip
    for key in keys:
        conn = http.client.HTTPSConnection(host, int(port), timeout=60, context=server["tls"])
        conn.putrequest("POST", "/v1/completions")
        conn.putheader("Content-Type", "application/json")
        conn.putheader("Content-Length", str(len(body)))
        conn.putheader("Authorization", key)
        conn.endheaders(body)
        r = conn.getresponse()
        assert r.status == 401 and json.loads(r.read())["error"]["type"] == "authentication_error", key[:20]
        conn.close()
    # the right key with a lone surrogate in the prompt or the model (in a field the server does not know, such as
    # `api_key`, it is ignored with the field, as vLLM ignores unknown fields)
    for raw, field in ((rb'{"prompt": "\ud800"}', "prompt"), (rb'{"prompt": "x", "model": "\udfff"}', "model")):
        req = urllib.request.Request(server["http"] + "/v1/completions", raw, method="POST",
                                     headers={"Authorization": "Bearer k-123"})  # fmt: skip
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(req, timeout=60, context=server["tls"])
        assert e.value.code == 400 and json.loads(e.value.read())["error"]["param"] == field
    req = urllib.request.Request(server["http"] + "/v1/completions",
                                 rb'{"prompt": "x", "max_tokens": 2, "api_key": "\ud800"}', method="POST",
                                 headers={"Authorization": "Bearer k-123"})  # fmt: skip
    with urllib.request.urlopen(req, timeout=60, context=server["tls"]) as r:
        assert r.status == 200 and json.loads(r.read())["usage"]["completion_tokens"] == 2
    status, _, out = post(server, "/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 2}, "k-123")
    assert status == 200 and out["usage"]["completion_tokens"] == 2


def test_above_capacity_requests_are_told_to_retry_and_the_rest_complete(server):
    def grpc_call(_):
        with SpecServeClient(server["grpc"], timeout_s=120, token="k-123", retries=0) as client:
            try:
                return client.generate("def f(x):", max_new_tokens=150, method="none")["token_ids"]
            except grpc.RpcError as e:
                return e.code(), e.details()

    def http_call(_):
        return post(server, "/v1/completions", {"model": "tiny", "prompt": "def f(x):", "max_tokens": 150,
                                                "temperature": 0}, "k-123")  # fmt: skip

    with ThreadPoolExecutor(12) as pool:
        grpc_results = list(pool.map(grpc_call, range(6)))
        http_results = list(pool.map(http_call, range(6)))
    done = [r for r in grpc_results if isinstance(r, list)]
    rejected = [r for r in grpc_results if not isinstance(r, list)]
    assert done and all(r == done[0] for r in done)
    assert rejected and all(code == grpc.StatusCode.RESOURCE_EXHAUSTED and "retry after" in d for code, d in rejected)
    assert {s for s, _, _ in http_results} <= {200, 429} and 429 in {s for s, _, _ in http_results}
    assert all(h["retry-after"] == "1" for s, h, _ in http_results if s == 429)
    with SpecServeClient(server["grpc"], timeout_s=120, token="k-123") as client:  # still serving
        assert client.generate("def f(x):", max_new_tokens=150, method="none")["token_ids"] == done[0]


def test_worker_ports_reject_calls_without_the_app_secret(server):
    registry = ray.get_actor(registry_name("specserve"), namespace=REGISTRY_NAMESPACE)
    _, members = ray.get(registry.members.remote())
    (target,) = [m for m in members if m["kind"] == "target"]
    with grpc.insecure_channel(target["address"]) as channel, pytest.raises(grpc.RpcError) as e:
        pb_grpc.TargetWorkerStub(channel).Health(pb.HealthRequest(), timeout=30)
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
