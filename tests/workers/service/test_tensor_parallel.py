"""Tensor-parallel target replicas on CPU (gloo, 2 ranks in separate processes): sharded logits equal the
single-process model's, speculative greedy decoding through a TP=2 target is identical to target-only decoding, and a
rank killed mid-request makes the replica unhealthy while its requests finish on another target, unchanged."""

import asyncio
import multiprocessing as mp

import grpc
import pytest
import torch

from specserve.cluster.scheduling.pipeline import Pipeline
from specserve.cluster.scheduling.scheduler import Scheduler
from specserve.cluster.scheduling.worker_clients import DraftClient, TargetClient
from specserve.protos import specserve_pb2 as pb
from specserve.protos import specserve_pb2_grpc as pb_grpc
from specserve.workers.config.request import SamplingParams, SpecParams
from specserve.workers.config.settings import KVCacheConfig, ModelConfig
from specserve.workers.errors import ModelLoadError
from specserve.workers.runtime.kv_cache import RETAIN_LESS
from specserve.workers.runtime.loading import load_model
from specserve.workers.runtime.runner import ForwardRow, ModelRunner
from specserve.workers.service.local_processes import free_port
from specserve.workers.service.tensor_parallel import LocalTensorParallelReplica, Rendezvous, check_shardable
from specserve.workers.speculation.engine import SpecEngine
from tests.helpers.greedy_oracle import own_greedy_loop
from tests.helpers.workers import LocalWorkers, tensor_parallel_logits

pytestmark = pytest.mark.slow

PROMPTS = ["def add(a, b):\n    return", "for i in range(3):", "import json\n\ndata = json.loads("]


def test_sharded_logits_equal_the_single_process_model(tiny_target, device):
    """On CPU over gloo; on one GPU both ranks share it, CUDA tensors over gloo (NCCL refuses two ranks a device):
    every part of the TP path but NCCL itself."""
    rows = [
        ForwardRow("a", list(range(3, 40)), 1),
        ForwardRow("a", list(range(3, 30)) + [7, 8, 9], 4),
        ForwardRow("b", [5, 6, 7, 8, 9], 2),
    ]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    rendezvous = Rendezvous("127.0.0.1", free_port(), 2, timeout_s=60)
    procs = [ctx.Process(target=tensor_parallel_logits, args=(r, rendezvous, tiny_target, rows, results, device))
             for r in range(2)]  # fmt: skip
    for p in procs:
        p.start()
    sharded, sharded_lean = results.get(timeout=180)
    for p in procs:
        p.join(30)
    runner = ModelRunner(load_model(ModelConfig(path=tiny_target, device=device)), KVCacheConfig())
    # The sharded model's wrappers are skipped too (workers/runtime/lean_forward.py).
    assert sharded_lean and runner.lean
    expected = runner.logits_for_batch(rows[:1]) + runner.logits_for_batch(rows[1:])
    for got, want in zip(sharded, expected, strict=True):
        assert torch.allclose(torch.tensor(got), want.cpu(), atol=1e-5, rtol=0)


def test_ranks_share_one_gpu_over_gloo_and_take_nccl_with_a_gpu_each(monkeypatch):
    from specserve.workers.service import tensor_parallel

    assert tensor_parallel.backend_for("cpu", 2) == "gloo"
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert tensor_parallel.backend_for("cuda", 2) == "gloo"
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert tensor_parallel.backend_for("cuda", 2) == "nccl"


def test_heads_not_divisible_by_the_degree_is_a_clear_error(tiny_target):
    from transformers import AutoConfig

    with pytest.raises(ModelLoadError, match="tensor_parallel_size 3 does not divide the model's num_attention_heads"):
        check_shardable(AutoConfig.from_pretrained(tiny_target), 3)


@pytest.fixture(scope="module")
def models(tiny_target, tiny_draft):
    return load_model(ModelConfig(path=tiny_target)), load_model(ModelConfig(path=tiny_draft))


@pytest.fixture(scope="module")
def reference(models):
    engine = SpecEngine(models[0])
    params = SamplingParams(max_new_tokens=24)
    return [engine.generate(p, params, SpecParams(method="none")).token_ids for p in PROMPTS]


async def _generate(targets: dict[str, str], drafts: dict[str, str], tokenizer, during=None,
                    spec=SpecParams(method="draft", k=3), decode_steps=1):  # fmt: skip
    draft_clients = {n: DraftClient(a, timeout_s=60) for n, a in drafts.items()}
    target_clients = {n: TargetClient(a, timeout_s=60) for n, a in targets.items()}
    scheduler = Scheduler(list(draft_clients), list(target_clients), decode_steps=decode_steps)
    pipeline = Pipeline(scheduler, draft_clients, target_clients)
    eos = frozenset({tokenizer.eos_token_id})
    params = SamplingParams(max_new_tokens=24)
    jobs = [pipeline.generate(tokenizer(p)["input_ids"], params, spec, eos) for p in PROMPTS]
    if during is not None:
        jobs.append(during())
    results = await asyncio.gather(*jobs)
    return results[: len(PROMPTS)], pipeline


@pytest.mark.parametrize("spec, decode_steps", [(SpecParams(method="draft", k=3), 1), (SpecParams(method="none"), 8)],
                         ids=["draft", "none-streamed"])  # fmt: skip
def test_greedy_through_a_tp2_target_is_identical_to_target_only(models, reference, tiny_target, spec, decode_steps):
    """Drafted rounds, and plain steps streamed in one Decode call (every rank runs each step's batch)."""
    tokenizer = models[0].tokenizer

    async def main():
        with LocalTensorParallelReplica(tiny_target, 2) as tp:
            async with LocalWorkers(models[0], [models[1]], n_targets=0) as w:
                results, _ = await _generate({"target-tp": tp.address}, w.draft_addresses, tokenizer, spec=spec,
                                             decode_steps=decode_steps)  # fmt: skip
                async with grpc.aio.insecure_channel(tp.address) as channel:
                    health = await pb_grpc.TargetWorkerStub(channel).Health(pb.HealthRequest(), timeout=10)
                return results, health

    results, health = asyncio.run(main())
    assert [r.state.generated for r in results] == reference
    assert health.healthy
    if spec.method == "draft":
        assert sum(r.state.stats.accepted for r in results) > 0


def test_a_killed_rank_makes_the_replica_unhealthy_and_its_requests_finish_elsewhere(models, reference, tiny_target):
    tokenizer = models[0].tokenizer

    async def main():
        with LocalTensorParallelReplica(tiny_target, 2) as tp:
            async with LocalWorkers(models[0], [models[1]], n_targets=1) as w:

                async def kill():
                    await asyncio.sleep(0.3)
                    tp.processes[1].kill()

                targets = {"target-tp": tp.address, **w.target_addresses}
                results, pipeline = await _generate(targets, w.draft_addresses, tokenizer, during=kill)
                async with grpc.aio.insecure_channel(tp.address) as channel:
                    health = await pb_grpc.TargetWorkerStub(channel).Health(pb.HealthRequest(), timeout=10)
                return results, pipeline.scheduler.unhealthy, health

    results, unhealthy, health = asyncio.run(main())
    assert [r.state.generated for r in results] == reference
    assert unhealthy == {"target-tp"} and not health.healthy
    assert {r.target_worker for r in results} == {"target-0"}


def test_a_tp2_targets_second_turn_takes_its_first_turns_cache_over(models, tiny_target):
    """Prefix caching on a tensor-parallel target: rank 0 and its follower keep and take over the same caches (the
    follower replays rank 0's store operations), so the second turn computes only what follows its history."""
    tokenizer = models[0].tokenizer
    history = tokenizer("def fibonacci(n):\n    if n < 2:\n        return n\n" * 3)["input_ids"]
    params, spec = SamplingParams(max_new_tokens=16), SpecParams(method="ngram", k=3)

    async def main():
        with LocalTensorParallelReplica(tiny_target, 2) as tp:
            client = TargetClient(tp.address, timeout_s=60)
            pipeline = Pipeline(Scheduler([], ["target-tp"]), {}, {"target-tp": client})
            first = await pipeline.generate(history, params, spec, frozenset())
            await pipeline.drain_releases()
            turn_2 = history + first.state.generated + tokenizer("\n# next")["input_ids"]
            second = await pipeline.generate(turn_2, params, spec, frozenset())
            return first, second, await client.health()

    first, second, health = asyncio.run(main())
    for req in (first, second):
        prompt = req.state.tokens[: req.state.prompt_len]
        assert req.state.generated == own_greedy_loop(models[0].model, prompt, 16, set())
    assert health.prefix_cache_hits >= len(history) + 15 - RETAIN_LESS and health.healthy
