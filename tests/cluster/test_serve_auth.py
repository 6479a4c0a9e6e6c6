"""Authentication on a running Serve app: the public gRPC and HTTP endpoints require the API key when one is set
(UNAUTHENTICATED / 401 otherwise), and the pools' worker ports reject calls without the app's shared secret."""

import grpc
import openai
import pytest
import ray

from specserve.cluster.app_config import AppConfig, serve_config
from specserve.cluster.client import SpecServeClient
from specserve.cluster.registry import REGISTRY_NAMESPACE, registry_name
from specserve.cluster.server import start, stop
from specserve.protos import specserve_pb2 as pb
from specserve.protos import specserve_pb2_grpc as pb_grpc

from .test_serve_app import free_port

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(tiny_target):
    mp = pytest.MonkeyPatch()
    mp.setenv("SPECSERVE_TEST_API_KEY", "k-123")  # inherited by the local Ray's workers
    app = AppConfig.model_validate(
        {"models": [{"name": "tiny", "target": tiny_target, "draft": "ngram", "device": "cpu",
                     "target_pool": {"num_cpus": 0.5}}],
         "ingress": {"num_cpus": 0.5}, "auth": {"api_key_env": "SPECSERVE_TEST_API_KEY"}}
    )  # fmt: skip
    ray.init(num_cpus=4, include_dashboard=False, configure_logging=False)
    info = start(serve_config(app, grpc_port=free_port(), http_port=free_port()), ready_timeout_s=300)
    yield info
    stop({**info, "started_ray": False})
    ray.shutdown()
    mp.undo()


def test_grpc_requires_the_api_key(server):
    for token in (None, "wrong"):
        with SpecServeClient(server["grpc"], timeout_s=60, token=token) as client, pytest.raises(grpc.RpcError) as e:
            client.generate("def f(x):", max_new_tokens=4)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED and "API key" in e.value.details()
    with SpecServeClient(server["grpc"], timeout_s=60, token="k-123") as client:
        assert len(client.generate("def f(x):", max_new_tokens=4)["token_ids"]) == 4


def test_http_requires_the_api_key(server):
    bad = openai.OpenAI(base_url=server["http"] + "/v1", api_key="wrong", max_retries=0, timeout=60)
    with pytest.raises(openai.AuthenticationError) as e:
        bad.completions.create(model="tiny", prompt="x", max_tokens=2, temperature=0)
    assert e.value.status_code == 401 and e.value.body["type"] == "authentication_error"
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    good = openai.OpenAI(base_url=server["http"] + "/v1", api_key="k-123", max_retries=0, timeout=60)
    assert good.completions.create(model="tiny", prompt="x", max_tokens=2, temperature=0).usage.completion_tokens == 2


def test_worker_ports_reject_calls_without_the_app_secret(server):
    registry = ray.get_actor(registry_name("specserve"), namespace=REGISTRY_NAMESPACE)
    _, members = ray.get(registry.members.remote())
    (target,) = [m for m in members if m["kind"] == "target"]
    with grpc.insecure_channel(target["address"]) as channel, pytest.raises(grpc.RpcError) as e:
        pb_grpc.TargetWorkerStub(channel).Health(pb.HealthRequest(), timeout=30)
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
