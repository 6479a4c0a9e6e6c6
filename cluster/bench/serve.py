"""The benchmark's disaggregated rows: requests through Ray Serve's gRPC proxy to the Serve application (ingress with
the scheduler, a draft pool and a target pool replica), with the public client, one stream and all at once."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

from specserve.cluster.bench.rows import BenchConfig, Row
from specserve.cluster.bench.timing import finish_stream_rows
from specserve.protos.wire import APP_NAME
from specserve.workers.service.local_processes import free_port


def serve_rows(target_path: str, draft_path: str, prompts: list[list[int]], cfg: BenchConfig, k: int, device: str,
               base: Row) -> tuple[list[Row], dict]:  # fmt: skip
    """The rows, and the scheduler replica's status of the model afterwards (rounds, orchestration_ms_p50,
    wire_bytes_per_round, ...: cluster/scheduling/service.py)."""
    import ray
    from ray import serve

    from specserve.client import SpecServeClient
    from specserve.cluster.app_config import AppConfig, serve_config
    from specserve.cluster.serve.server import start, stop

    app = AppConfig.model_validate(
        {"models": [{"name": "bench", "target": target_path, "draft": draft_path, "device": device, "k": k,
                     "target_pool": {"num_cpus": 0.5}, "draft_pool": {"num_cpus": 0.5}}],
         "scheduler": {"num_cpus": 0.5}}
    )  # fmt: skip
    config = serve_config(app, grpc_port=free_port(), http_port=free_port())
    started = not ray.is_initialized()
    if started:
        ray.init(include_dashboard=False, log_to_driver=False, configure_logging=False)
    info = start(config, ready_timeout_s=600)
    try:
        with SpecServeClient(info["grpc"], timeout_s=600) as client:

            def one_request(prompt: list[int]) -> list[int]:
                return client.generate(prompt, max_new_tokens=cfg.max_new_tokens, k=k)["token_ids"]

            client.generate(prompts[0][:16], max_new_tokens=4, k=k)  # warm-up
            one = Row(f"serve gRPC e2e k={k} greedy, 1 stream", "serve", k, 0.0)
            for prompt in prompts:
                t0 = time.perf_counter()
                one.outputs.append(one_request(prompt))
                one.seconds += time.perf_counter() - t0
            many = Row(f"serve gRPC e2e k={k} greedy, {len(prompts)} streams", "serve", k, 0.0, streams=len(prompts))
            t0 = time.perf_counter()
            with ThreadPoolExecutor(len(prompts)) as pool:
                many.outputs = list(pool.map(one_request, prompts))
            many.seconds = time.perf_counter() - t0
        status = serve.get_deployment_handle("scheduler", APP_NAME).status.remote().result(timeout_s=60)["bench"]
    finally:
        stop({**info, "started_ray": False})
        if started:
            ray.shutdown()
    return finish_stream_rows([one, many], base), status
