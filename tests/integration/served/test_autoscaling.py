"""End to end on a local Ray: the application-level pool autoscaling policy adds a draft replica when load rises
(the pools' busy fractions, reported through record_autoscaling_stats, drive it), and the app keeps serving
lossless outputs while the pool grows."""

import threading
import time

import pytest
import ray
from ray import serve

from specserve.client import SpecServeClient
from specserve.cluster.app_config import AppConfig, serve_config
from specserve.cluster.serve.local_ray import init_ray
from specserve.cluster.serve.server import start, stop
from specserve.workers.service.local_processes import free_port

pytestmark = pytest.mark.slow


def _running(deployment: str) -> int:
    status = serve.status().applications["specserve"].deployments[deployment]
    return status.replica_states.get("RUNNING", 0)


def test_rising_load_adds_a_draft_replica(tiny_target, tiny_draft):
    fast = {"upscale_delay_s": 0, "downscale_delay_s": 600, "metrics_interval_s": 1, "look_back_period_s": 4}
    app = AppConfig.model_validate(
        {"models": [{"name": "tiny", "target": tiny_target, "draft": tiny_draft, "device": "cpu",
                     "target_pool": {"num_cpus": 0.5, "autoscaling": {"min_replicas": 1, "max_replicas": 1, **fast}},
                     "draft_pool": {"num_cpus": 0.25, "autoscaling": {"min_replicas": 1, "max_replicas": 2, **fast}}}],
         "scheduler": {"num_cpus": 0.25},
         # a low goal, so that the load a 2-core CI machine can produce asks for a second draft replica
         "autoscaling_goal_busy_fraction": 0.05}
    )  # fmt: skip
    config = serve_config(app, grpc_port=free_port(), http_port=free_port())
    assert config["applications"][0]["autoscaling_policy"]["policy_kwargs"] == {"goal_busy_fraction": 0.05}
    init_ray(num_cpus=4, include_dashboard=False, configure_logging=False, log_to_driver=False)
    info = start(config, ready_timeout_s=300)
    stop_load = threading.Event()
    outputs: list[list[int]] = []
    threads: list[threading.Thread] = []
    try:
        time.sleep(8)
        assert _running("draft-tiny") == 1  # idle: the policy keeps one draft replica

        def load():
            with SpecServeClient(info["grpc"], timeout_s=120) as client:
                while not stop_load.is_set():
                    outputs.append(client.generate("def add(a, b):", max_new_tokens=24, k=4)["token_ids"])

        threads += [threading.Thread(target=load) for _ in range(6)]
        for t in threads:
            t.start()
        deadline = time.time() + 180
        while _running("draft-tiny") < 2 and time.time() < deadline:
            time.sleep(2)
        assert _running("draft-tiny") == 2
        assert _running("target-tiny") == 1  # bounded by its max_replicas
    finally:
        stop_load.set()
        for t in threads:
            t.join(timeout=120)
        stop({**info, "started_ray": False})
        ray.shutdown()
    assert outputs and all(o == outputs[0] for o in outputs)  # greedy: every request the same tokens
