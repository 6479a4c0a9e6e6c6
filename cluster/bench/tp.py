"""The tensor-parallel rows of `specserve bench`: the same prompts decoded through the Serve app with a TP=N target
pool (N processes a replica, gloo on CPU / NCCL on CUDA, rank 0 serving gRPC) without and with its draft pool, and the
communication share of a sharded decode step. On CPU, sharding a small model only adds communication: the rows say by
how much."""

from __future__ import annotations

import multiprocessing as mp

from specserve.cluster.bench.rows import Row
from specserve.cluster.bench.serve import SMALL_POOL, served_model
from specserve.cluster.bench.timing import finish_stream_rows
from specserve.workers.config.settings import ModelConfig
from specserve.workers.service.local_processes import free_port, wait_ready
from specserve.workers.service.tensor_parallel import Rendezvous, profile_forward


def communication_share(target: ModelConfig, prompt: list[int], world_size: int, steps: int = 20) -> dict:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    rendezvous = Rendezvous("127.0.0.1", free_port(), world_size)
    procs = [ctx.Process(target=profile_forward, args=(r, rendezvous, target, prompt, steps, results), daemon=True)
             for r in range(world_size)]  # fmt: skip
    for p in procs:
        p.start()
    try:
        (profile,) = wait_ready(results, procs, 1, timeout_s=600)
        return profile
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()


def tp_rows(target: ModelConfig, draft: ModelConfig, prompts: list[list[int]], new_tokens: int, k: int, base: Row,
            world_size: int) -> tuple[list[Row], dict]:  # fmt: skip
    """Rows `TP=N target-only greedy` and `TP=N target k greedy` (one stream each; speedups over `base`, the
    single-process target-only row), served by the Serve app with a target pool of tensor_parallel_size N beside a
    draft pool; plus {ms_per_step, communication_share} of a TP=N decode step."""
    pool = {**SMALL_POOL, "tensor_parallel_size": world_size}
    with served_model(target.path, draft.path, target.device, new_tokens, dtype=target.dtype, target_pool=pool) as s:
        s.generate(prompts[0], "draft", k, new_tokens=4)  # warm-up
        only = s.one_stream(f"TP={world_size} target-only greedy", "tensor-parallel", prompts, "none")
        spec = s.one_stream(f"TP={world_size} target k={k} greedy", "tensor-parallel", prompts, "draft", k)
    profile = communication_share(target, prompts[0], world_size)
    return finish_stream_rows([only, spec], base), profile
