"""The Serve app on a multi-node Ray cluster: each pool's replicas placed by the pool's custom resources on their own
nodes, and a tensor-parallel target pool (TP=2: the replica is rank 0 of a STRICT_PACK placement group and starts rank
1 in the other bundle, which must land on its node) decoding exactly what the single-process target does, drafted
for by a draft model or by prompt lookup."""

import pytest
import ray
from ray import serve

from specserve.client import SpecServeClient
from specserve.cluster.app_config import AppConfig, serve_config
from specserve.cluster.serve.server import start, stop
from specserve.protos.wire import APP_NAME
from specserve.workers.config.request import SamplingParams, SpecParams
from specserve.workers.config.settings import ModelConfig
from specserve.workers.runtime.loading import load_model
from specserve.workers.service.local_processes import free_port
from specserve.workers.speculation.engine import SpecEngine
from tests.helpers.ray_cluster import start_cluster

pytestmark = pytest.mark.slow

PROMPTS = ["def add(a, b):", "class Stack:", "for i in range(3):", "import json"]
N = 40


@pytest.fixture(scope="module")
def cluster():
    c, draft_node, target_node = start_cluster()
    ray.init(address=c.address, include_dashboard=False, configure_logging=False, log_to_driver=False)
    c.wait_for_nodes()
    yield c, draft_node.node_id, target_node.node_id
    ray.shutdown()
    c.shutdown()


@pytest.fixture(scope="module")
def expected(tiny_target):
    engine = SpecEngine(load_model(ModelConfig(path=tiny_target, device="cpu")))
    return [engine.generate(p, SamplingParams(max_new_tokens=N), SpecParams(method="none")).token_ids for p in PROMPTS]


def test_pools_run_on_their_resource_nodes_and_a_tensor_parallel_target_pool_is_lossless(
    cluster, tiny_target, tiny_draft, expected
):
    _, draft_node, target_node = cluster
    app = AppConfig.model_validate(
        {"models": [{"name": "tiny", "target": tiny_target, "draft": tiny_draft, "device": "cpu",
                     "target_pool": {"num_cpus": 0.5, "resources": {"target_gpu": 1}, "tensor_parallel_size": 2,
                                     "threads": 2},
                     "draft_pool": {"num_cpus": 0.5, "resources": {"draft_gpu": 1}}}],
         "scheduler": {"num_cpus": 0.25, "worker_wait_s": 300}}
    )  # fmt: skip
    config = serve_config(app, grpc_port=free_port(), http_port=free_port())
    config["proxy_location"] = "HeadOnly"  # the nodes share this machine's ports: one proxy
    info = start(config, ready_timeout_s=600)
    try:
        with SpecServeClient(info["grpc"], timeout_s=300) as client:
            outs = {m: [client.generate(p, max_new_tokens=N, method=m, k=4)["token_ids"] for p in PROMPTS]
                    for m in ("draft", "ngram")}  # fmt: skip
        pools = {name: serve.get_deployment_handle(name, APP_NAME).info.remote().result(timeout_s=60)
                 for name in ("draft-tiny", "target-tiny")}  # fmt: skip
    finally:
        stop({**info, "started_ray": False})
    assert outs == {"draft": expected, "ngram": expected}
    assert pools["draft-tiny"]["node_id"] == draft_node and pools["target-tiny"]["node_id"] == target_node
    assert pools["target-tiny"]["followers"] == [target_node]  # rank 1 packed on rank 0's node
    # The pool's threads, although Ray gives an actor reserving half a CPU one OpenMP thread; the draft keeps Ray's.
    assert pools["target-tiny"]["threads"] == 2 and pools["draft-tiny"]["threads"] == 1
