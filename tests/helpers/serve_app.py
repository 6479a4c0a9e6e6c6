"""The tiny pair's Serve app config, and the prompts of tests/integration/tiny_app/: its `reference` fixture
holds their target-only outputs, which the bad-input cases compare the next valid request against."""

PROMPTS = ["def add(a, b):", "class Stack:", "for i in range(3):", "import json"]
N = 24  # new tokens of their reference outputs
METRICS_REPORT_S = 1  # how often the metric tests' Ray exports each process's metrics (its metrics_report_interval_ms)


def tiny_app_config(tiny_target: str, tiny_draft: str):
    """The Serve app's config for the tiny pair: one model, half a CPU a replica."""
    from specserve.cluster.app_config import AppConfig

    pool = {"num_cpus": 0.5}
    return AppConfig.model_validate(
        {"models": [{"name": "tiny", "target": tiny_target, "draft": tiny_draft, "device": "cpu",
                     "target_pool": pool, "draft_pool": pool}],
         "scheduler": {"num_cpus": 0.5, "call_timeout_s": 30, "worker_wait_s": 60}}
    )  # fmt: skip


def tiny_app_info(tiny_target: str, tiny_draft: str, metrics_port: int | None = None):
    """A generator for a module fixture: the Serve app on the tiny pair (a local Ray of 4 CPUs, half a CPU a
    replica), yielding `start`'s info; stops it and Ray after."""
    import ray

    from specserve.cluster.app_config import serve_config
    from specserve.cluster.serve.local_ray import init_ray
    from specserve.cluster.serve.server import start, stop
    from specserve.workers.service.local_processes import free_port

    init_ray(address="local", num_cpus=4, include_dashboard=False, configure_logging=False, log_to_driver=False)
    app = tiny_app_config(tiny_target, tiny_draft)
    info = start(serve_config(app, grpc_port=free_port(), http_port=free_port()),
                 metrics_port=metrics_port or free_port(), ready_timeout_s=300)  # fmt: skip
    try:
        yield info
    finally:
        stop({**info, "started_ray": False})
        ray.shutdown()
