"""Tensor-parallel target replicas: N ranks, one torch.distributed group, each holding a shard of the model and of
every request's KV cache.

Sharding is transformers' own tensor parallelism (`from_pretrained(..., distributed_config=DistributedConfig(
tp_size=N))`): attention heads and MLP columns split across ranks, all-reduce after the row-parallel projections,
gloo on CPU and NCCL on CUDA. It covers every architecture whose transformers class ships a `base_model_tp_plan`
(Llama, Qwen2/Qwen3, Mistral, Gemma, Phi-3, ...); `load_sharded` says so when a model has none.

Rank 0 hosts the TargetWorker (and its gRPC server) over a `TensorParallelRunner`: every forward pass and every
release is first broadcast to the other ranks, which run the same call on their own `ModelRunner` in `follow`. All
ranks hold the same KV store state (same slots, same lengths, same rollbacks), only their heads differ.
"""

from __future__ import annotations

import datetime
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import NoReturn

import torch
import torch.distributed as dist

from specserve.workers.config.settings import KVCacheConfig, ModelConfig
from specserve.workers.errors import KVCapacityError, ModelLoadError, UnavailableError
from specserve.workers.runtime.loading import LoadedModel, load_model, resolve_device
from specserve.workers.runtime.runner import ForwardRow, ModelRunner, RowOutput
from specserve.workers.runtime.tree_rows import TreeRow
from specserve.workers.service.assembly import WorkerSpec, serve_in_process

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Rendezvous:
    """Where the ranks of one replica meet (the replica owns the address: rank 0's host and a free port)."""

    address: str
    port: int
    world_size: int
    timeout_s: float = 60.0


def check_shardable(hf_config, tp_size: int) -> None:
    """Clear errors for a tensor-parallel degree the model cannot be split by."""
    cfg = hf_config.get_text_config()
    heads = getattr(cfg, "num_attention_heads", None)
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    for name, n in (("num_attention_heads", heads), ("num_key_value_heads", kv_heads)):
        if n is not None and n % tp_size:
            raise ModelLoadError(f"tensor_parallel_size {tp_size} does not divide the model's {name} ({n})")


def check_replica(model: ModelConfig, tp_size: int) -> str:
    """Before starting any rank: the degree divides the model's heads, and on CUDA the node has a GPU per rank
    (STRICT_PACK puts every rank on one node). Returns the ranks' device type."""
    from transformers import AutoConfig

    check_shardable(AutoConfig.from_pretrained(os.path.expanduser(model.path), local_files_only=True), tp_size)
    device = resolve_device(model.device).type
    if device == "cuda" and torch.cuda.device_count() < tp_size:
        raise ModelLoadError(
            f"tensor_parallel_size {tp_size} needs {tp_size} GPUs on one node (STRICT_PACK), this node has "
            f"{torch.cuda.device_count()}"
        )
    return device


def backend_for(device: str, world_size: int) -> str:
    """NCCL on CUDA with a GPU per rank; gloo on CPU, and on CUDA where ranks share a GPU (NCCL refuses two ranks on
    one device; gloo moves CUDA tensors through the host): how one GPU runs the TP path, all but NCCL itself."""
    if device == "cuda" and torch.cuda.device_count() >= world_size:
        return "nccl"
    return "gloo"


def init_rank(rank: int, rendezvous: Rendezvous, device: str = "cpu") -> None:
    """Join the replica's process group (`backend_for`); on CUDA, rank r takes GPU r (mod the GPUs there are)."""
    backend = backend_for(device, rendezvous.world_size)
    if device == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    # transformers' tensor parallelism reads the rank and world size from the environment.
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(rendezvous.world_size))
    dist.init_process_group(
        backend,
        init_method=f"tcp://{rendezvous.address}:{rendezvous.port}",
        rank=rank,
        world_size=rendezvous.world_size,
        timeout=datetime.timedelta(seconds=rendezvous.timeout_s),
    )


def load_sharded(config: ModelConfig) -> LoadedModel:
    """This rank's shard of the model (call after `init_rank`)."""
    from transformers import AutoConfig, DistributedConfig

    world = dist.get_world_size()
    hf_config = AutoConfig.from_pretrained(os.path.expanduser(config.path), local_files_only=True)
    check_shardable(hf_config, world)
    try:
        return load_model(config, distributed_config=DistributedConfig(tp_size=world, tp_plan="auto"))
    except ModelLoadError:
        raise
    except Exception as e:  # noqa: BLE001 - transformers raises many kinds for an unsupported plan
        raise ModelLoadError(
            f"{config.path!r} cannot be sharded by transformers' tensor parallelism ({hf_config.model_type}): {e}"
        ) from None


class TensorParallelRunner:
    """Rank 0's runner: the ModelRunner interface, every call mirrored on the other ranks first. A rank that died
    makes the next collective fail; the replica then reports unhealthy and answers UNAVAILABLE from then on."""

    def __init__(self, runner: ModelRunner):
        self.runner = runner
        self.failed: str | None = None

    def __getattr__(self, name):  # store, loaded, vocab_size, counters: rank 0's own
        return getattr(self.runner, name)

    def _mirror(self, message: tuple):
        if self.failed is not None:
            raise UnavailableError(f"tensor-parallel replica is down: {self.failed}")
        try:
            dist.broadcast_object_list([message], src=0)
        except Exception as e:  # noqa: BLE001 - gloo/NCCL report a dead peer in many ways
            self._fail(f"rank broadcast failed: {e}", e)

    def _fail(self, reason: str, error: Exception) -> NoReturn:
        self.failed = reason
        log.error("tensor-parallel replica is down: %s", reason, exc_info=error)
        raise UnavailableError(f"tensor-parallel replica is down: {reason}") from None

    def logits_for_batch(self, rows: Sequence[ForwardRow]) -> list[torch.Tensor]:
        rows = [ForwardRow(row.request_id, list(row.sequence), row.n) for row in rows]  # plain lists pickle anywhere
        self._mirror(("batch", rows))
        try:
            return self.runner.logits_for_batch(rows)
        except (KVCapacityError, ValueError):
            raise  # raised identically on every rank, before any collective
        except RuntimeError as e:  # DistBackendError included
            self._fail(f"collective failed mid-forward: {e}", e)

    def logits_for(self, request_id: str, sequence: Sequence[int], n: int) -> torch.Tensor:
        return self.logits_for_batch([ForwardRow(request_id, sequence, n)])[0]

    def forward_tree(self, rows: Sequence[TreeRow], capture: bool = False) -> list[RowOutput]:
        """Rank 0 alone captures features (the other ranks run the same collectives without keeping them)."""
        rows = [replace(r, sequence=list(r.sequence), tokens=list(r.tokens), parents=list(r.parents)) for r in rows]
        self._mirror(("tree", rows))
        try:
            return self.runner.forward_tree(rows, capture=capture)
        except (KVCapacityError, ValueError):
            raise  # raised identically on every rank, before any collective
        except RuntimeError as e:
            self._fail(f"collective failed mid-forward: {e}", e)

    def forward_mixed(self, chains: Sequence[ForwardRow], trees: Sequence[TreeRow],
                      capture: bool = False) -> tuple[list[RowOutput], list[RowOutput]]:  # fmt: skip
        """Rank 0 alone captures features, as forward_tree."""
        chains = [replace(r, sequence=list(r.sequence)) for r in chains]
        trees = [replace(r, sequence=list(r.sequence), tokens=list(r.tokens), parents=list(r.parents)) for r in trees]
        self._mirror(("mixed", (chains, trees)))
        try:
            return self.runner.forward_mixed(chains, trees, capture=capture)
        except (KVCapacityError, ValueError):
            raise  # raised identically on every rank, before any collective
        except RuntimeError as e:
            self._fail(f"collective failed mid-forward: {e}", e)

    def keep_path(self, request_id: str, nodes: Sequence[int]) -> None:
        self._mirror(("keep_path", (request_id, list(nodes))))
        self.runner.keep_path(request_id, nodes)

    def release(self, request_id: str) -> bool:
        self._mirror(("release", request_id))
        return self.runner.release(request_id)

    def shutdown(self) -> None:
        if self.failed is None:
            self._mirror(("stop", None))


def follow(runner: ModelRunner) -> None:
    """Ranks > 0: run whatever rank 0 broadcasts until it says stop (or the group breaks)."""
    while True:
        box = [None]
        dist.broadcast_object_list(box, src=0)
        kind, payload = box[0]
        if kind == "stop":
            return
        if kind == "release":
            runner.release(payload)
        elif kind == "keep_path":
            runner.keep_path(*payload)
        elif kind in ("batch", "tree", "mixed"):
            forward = {"batch": runner.logits_for_batch, "tree": runner.forward_tree,
                       "mixed": lambda rows: runner.forward_mixed(*rows)}[kind]  # fmt: skip
            try:
                forward(payload)
            except (KVCapacityError, ValueError) as e:  # rank 0 raised the same before any collective and answers
                log.debug("rank %d: %s refused as on rank 0: %s", dist.get_rank(), kind, e)


def run_follower(rank: int, rendezvous: Rendezvous, model: ModelConfig, kv_cache: KVCacheConfig) -> None:
    """The whole life of a rank > 0 process."""
    device = resolve_device(model.device).type
    init_rank(rank, rendezvous, device)
    try:
        follow(ModelRunner(load_sharded(model), kv_cache))
    finally:
        dist.destroy_process_group()


def serve_rank0(rendezvous: Rendezvous, spec: WorkerSpec, ready, secret: str | None = None) -> None:
    """The whole life of rank 0 as a process: join the group, load its shard, serve the worker of `spec` over gRPC
    on a free port ((role, port) sent through `ready`, a multiprocessing queue), until terminated."""
    init_rank(0, rendezvous, resolve_device(spec.model.device).type)
    runner = TensorParallelRunner(ModelRunner(load_sharded(spec.model), spec.kv_cache, vocab_size=spec.vocab_size))
    serve_in_process(spec, ready, runner, secret)


def profile_forward(
    rank: int, rendezvous: Rendezvous, model: ModelConfig, prompt: list[int], steps: int, results=None
) -> None:
    """One rank of a measurement: prefill `prompt`, then `steps` single-token decode steps through the mirrored runner
    under torch.profiler; rank 0 puts {ms_per_step, communication_share} in `results` (a multiprocessing queue).
    The communication share is the collectives' self time (all-reduce, broadcast, gloo/NCCL work) over the steps'."""
    import time

    from torch.profiler import ProfilerActivity, profile

    device = resolve_device(model.device).type
    init_rank(rank, rendezvous, device)
    runner = ModelRunner(load_sharded(model), KVCacheConfig())
    try:
        if rank != 0:
            follow(runner)
            return
        tp = TensorParallelRunner(runner)
        seq = list(prompt)
        tp.logits_for("bench", seq, 1)
        for _ in range(3):  # warm-up
            seq.append(int(tp.logits_for("bench", seq, 1)[-1].argmax()))
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
        with profile(activities=activities) as prof:
            start = time.perf_counter()
            for _ in range(steps):
                seq.append(int(tp.logits_for("bench", seq, 1)[-1].argmax()))
            seconds = time.perf_counter() - start
        comm_us = sum(
            e.self_cpu_time_total
            for e in prof.key_averages()
            if any(word in e.key.lower() for word in ("all_reduce", "allreduce", "broadcast", "gloo", "nccl", "wait"))
        )
        results.put({"ms_per_step": seconds / steps * 1e3, "communication_share": comm_us / 1e6 / seconds})
        tp.shutdown()
    finally:
        dist.destroy_process_group()


class LocalTensorParallelReplica:
    """A tensor-parallel target replica on this machine without Ray (tests, the bench): `world_size` processes in one
    gloo group, rank 0 serving the TargetWorker over gRPC. `with LocalTensorParallelReplica(path, 2) as tp:` gives
    tp.address and tp.processes (rank -> process, to kill one)."""

    def __init__(self, path: str, world_size: int = 2, capacity_tokens: int = 100_000, device: str = "cpu"):
        self.path, self.world_size, self.capacity_tokens, self.device = path, world_size, capacity_tokens, device

    def __enter__(self):
        import multiprocessing as mp

        from specserve.workers.service.local_processes import free_port, wait_ready

        rendezvous = Rendezvous("127.0.0.1", free_port(), self.world_size, timeout_s=120)
        model = ModelConfig(path=self.path, device=self.device)
        kv = KVCacheConfig(capacity_tokens=self.capacity_tokens)
        ctx = mp.get_context("spawn")
        ready = ctx.Queue()
        spec = WorkerSpec("target", model, kv)
        self.processes = {0: ctx.Process(target=serve_rank0, args=(rendezvous, spec, ready))}
        for rank in range(1, self.world_size):
            self.processes[rank] = ctx.Process(target=run_follower, args=(rank, rendezvous, model, kv))
        for p in self.processes.values():
            p.daemon = True
            p.start()
        try:
            ((_, port),) = wait_ready(ready, list(self.processes.values()), 1)
        except RuntimeError:
            self.__exit__()
            raise
        self.address = f"127.0.0.1:{port}"
        return self

    def __exit__(self, *exc):
        for p in self.processes.values():
            p.kill()
            p.join(10)
