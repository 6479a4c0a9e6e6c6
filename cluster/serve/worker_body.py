"""What a pool replica (pool_worker.py) runs: a draft or target worker built from the model and its pool's config
(workers/service/assembly.py), its gRPC server inside the replica's event loop, and, for a tensor-parallel replica,
the follower ranks it starts as Ray actors in the replica's placement group."""

from __future__ import annotations

import logging
import socket

from specserve.cluster.app_config import WorkerPoolConfig, binds_cpus
from specserve.workers.config.settings import ModelConfig

log = logging.getLogger(__name__)


def in_ray_actor() -> bool:
    """Whether this process is a Ray actor's own (a pool replica), whose CPUs a binding may take: never a driver that
    builds a worker body in its own process (a test, a bench), which a binding would pin with everything it starts."""
    import ray

    return ray.is_initialized() and ray.get_runtime_context().get_actor_id() is not None


def _host() -> str:
    try:
        import ray

        return ray.util.get_node_ip_address()
    except Exception:  # noqa: BLE001 - outside Ray
        return socket.gethostbyname("localhost")


class WorkerBody:
    """Hosts a worker built by `_build` (workers/service/assembly.py) behind its gRPC server."""

    def _build(self, role: str, model: ModelConfig, pool: WorkerPoolConfig, vocab_size: int | None = None,
               eagle_head: str | None = None) -> None:  # fmt: skip
        from specserve.workers.runtime.loading import resolve_device
        from specserve.workers.runtime.threads import bind_process, cpu_split, use_threads, worker_threads
        from specserve.workers.service.assembly import WorkerSpec, build_worker

        device = resolve_device(model.device).type
        split = cpu_split() if role == "target" and binds_cpus(pool, device) and in_ray_actor() else None
        if split is not None:  # every CPU but the first, which the serving processes keep
            bind_process(split[1])
            log.info("target worker bound to CPUs %s, %d torch threads; the serving processes run on CPU %s",
                     split[1], len(split[1]), split[0][0])  # fmt: skip
            use_threads(len(split[1]))
        else:
            use_threads(worker_threads(pool.threads, role, device, pool.num_cpus, pool.tensor_parallel_size))
        # A draft's tensor-parallel degree is independent of the target's (a head's draft worker runs no model).
        tensor_parallel = pool.tensor_parallel_size > 1 and not (role == "draft" and eagle_head)
        runner = self._tensor_parallel_runner(model, pool, vocab_size) if tensor_parallel else None
        spec = WorkerSpec(role, model, pool.kv_cache, pool.batching, vocab_size, eagle_head)
        self.built = build_worker(spec, runner=runner)
        self.runner, self.worker, self.servicer = self.built.runner, self.built.worker, self.built.servicer

    async def start(self, secret: str | None = None, max_message_bytes: int | None = None) -> str:
        """Start the gRPC server on this node (inside the replica's event loop) unless it runs; returns its address.
        With `secret`, the server accepts only calls carrying it (the app's shared secret). It listens on the node's
        cluster address only (Ray's node IP; loopback on a local-only Ray), never on every interface."""
        from specserve.workers.service.assembly import start_worker_server
        from specserve.workers.service.grpc_service import DEFAULT_SERVER_MESSAGE_BYTES

        if getattr(self, "address", None) is None:
            host = _host()
            host = f"[{host}]" if ":" in host else host
            self.server, port = await start_worker_server(
                self.built, f"{host}:0", secret, max_message_bytes or DEFAULT_SERVER_MESSAGE_BYTES
            )
            self.address = f"{host}:{port}"
        return self.address

    async def followers_nodes(self) -> list[str]:
        """Node ids of this replica's follower ranks (tensor parallelism), for placement checks."""
        return [await actor.node_id.remote() for actor, _ in getattr(self, "followers", [])]

    def _tensor_parallel_runner(self, model: ModelConfig, pool: WorkerPoolConfig, vocab_size: int | None = None):
        """This replica is rank 0; ranks 1..N-1 are follower actors in the replica's placement group, which die with
        it."""
        import ray
        from ray.util.placement_group import get_current_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from specserve.workers.runtime.runner import ModelRunner
        from specserve.workers.runtime.threads import worker_threads
        from specserve.workers.service.local_processes import free_port
        from specserve.workers.service.tensor_parallel import (
            Rendezvous,
            TensorParallelRunner,
            check_replica,
            init_rank,
            load_sharded,
            run_follower,
        )

        n = pool.tensor_parallel_size
        device = check_replica(model, n)
        torch_threads = worker_threads(pool.threads, "target", device, pool.num_cpus, n)
        rendezvous = Rendezvous(_host(), free_port(""), n, timeout_s=300)
        follower = ray.remote(max_restarts=0, max_concurrency=2)(TensorParallelFollower)  # node_id while it runs
        pg = get_current_placement_group()
        self.followers = []
        for rank in range(1, n):
            options = {"num_cpus": pool.num_cpus, "num_gpus": pool.num_gpus or (1.0 if device == "cuda" else 0.0)}
            if pg is not None:
                options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=rank)
            actor = follower.options(**options).remote()
            call = actor.run.remote(run_follower, rank, rendezvous, model, pool.kv_cache, threads=torch_threads)
            self.followers.append((actor, call))
        init_rank(0, rendezvous, device)
        return TensorParallelRunner(ModelRunner(load_sharded(model), pool.kv_cache, vocab_size=vocab_size))


class DraftWorkerBody(WorkerBody):
    """A draft model behind a DraftWorker gRPC server; with `eagle_head`, that EAGLE-3 head (`model` is then the
    target, whose config and input embedding it reads)."""

    def __init__(
        self, model: ModelConfig, pool: WorkerPoolConfig, target_vocab_size: int, eagle_head: str | None = None
    ):
        self._build("draft", model, pool, target_vocab_size, eagle_head)


class TargetWorkerBody(WorkerBody):
    """A target model behind a TargetWorker gRPC server; with `eagle_head`, capturing the features that head reads."""

    def __init__(self, model: ModelConfig, pool: WorkerPoolConfig, eagle_head: str | None = None):
        self._build("target", model, pool, eagle_head=eagle_head)


class TensorParallelFollower:
    """A rank > 0 of a tensor-parallel target replica: runs `run_follower` until rank 0 stops or dies."""

    def run(self, fn, *args, threads: int | None = None) -> None:
        if threads is not None:
            from specserve.workers.runtime.threads import use_threads

            use_threads(threads)
        fn(*args)

    def node_id(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id()
