"""The tensor-parallel rows of `specserve bench`: the same prompts decoded through a TP=N target replica (N processes,
gloo on CPU / NCCL on CUDA, rank 0 serving gRPC) with and without a draft worker, and the communication share of a
sharded decode step. On CPU, sharding a small model only adds communication: the rows say by how much."""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import time

from specserve.cluster.bench.rows import Row
from specserve.cluster.bench.timing import finish_stream_rows
from specserve.cluster.pools.worker_processes import WorkerProcesses
from specserve.cluster.scheduling.pipeline import build_pipeline
from specserve.cluster.scheduling.worker_clients import DraftClient, TargetClient
from specserve.workers.config import BatchingConfig, ModelConfig, SamplingParams, SpecParams
from specserve.workers.service.local_processes import free_port, wait_ready
from specserve.workers.service.tensor_parallel import LocalTensorParallelReplica, Rendezvous, profile_forward


async def _decode(target_address, draft_addresses, prompts, new_tokens, spec) -> tuple[list[list[int]], float]:
    drafts = {n: DraftClient(a, timeout_s=300) for n, a in draft_addresses.items()}
    targets = {"target-tp": TargetClient(target_address, timeout_s=300)}
    pipeline = build_pipeline(drafts, targets)
    params = SamplingParams(max_new_tokens=new_tokens)
    outputs, seconds = [], 0.0
    for prompt in prompts:  # one stream, like the in-process rows
        start = time.perf_counter()
        req = await pipeline.generate(prompt, params, spec, frozenset())
        seconds += time.perf_counter() - start
        outputs.append(req.state.generated)
    await pipeline.drain_releases()
    for client in (*drafts.values(), *targets.values()):
        await client.close()
    return outputs, seconds


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


def tp_rows(
    target: ModelConfig, draft: ModelConfig, vocab: int, prompts, new_tokens: int, k: int, base: Row, world_size: int
) -> tuple[list[Row], dict]:
    """Rows `TP=N target-only greedy` and `TP=N target k greedy` (speedups over `base`, the single-process
    target-only row), plus {ms_per_step, communication_share} of a TP=N decode step."""
    only = Row(f"TP={world_size} target-only greedy", "tensor-parallel", None, 0.0)
    spec = Row(f"TP={world_size} target k={k} greedy", "tensor-parallel", k, 0.0)
    with (
        LocalTensorParallelReplica(target.path, world_size, device=target.device) as tp,
        WorkerProcesses(None, draft, vocab, BatchingConfig()) as d,
    ):
        asyncio.run(_decode(tp.address, d.draft_addresses, prompts[:1], 4, SpecParams(method="draft", k=k)))  # warm
        only.outputs, only.seconds = asyncio.run(
            _decode(tp.address, {}, prompts, new_tokens, SpecParams(method="none"))
        )
        spec.outputs, spec.seconds = asyncio.run(
            _decode(tp.address, d.draft_addresses, prompts, new_tokens, SpecParams(method="draft", k=k))
        )
    profile = communication_share(target, prompts[0], world_size)
    return finish_stream_rows([only, spec], base), profile
