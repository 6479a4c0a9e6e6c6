"""Draft and target workers in their own local processes, each behind its own gRPC server: the disaggregated shape
on one machine without Ray, for the bench's concurrency sweep (separate processes, so the draft's Python work never
waits on the target's interpreter lock, as it would with both in one process)."""

from __future__ import annotations

import multiprocessing as mp

from specserve.workers.config import BatchingConfig, KVCacheConfig, ModelConfig
from specserve.workers.service.local_processes import wait_ready


def serve_worker(
    kind: str, model: ModelConfig, target_vocab: int, batching: BatchingConfig, ready, threads: int | None = None
) -> None:
    """The whole life of one worker process: load, serve on a free localhost port (sent through `ready`), forever.
    threads: torch's CPU threads in this process (None: torch's default, one per core)."""
    import asyncio

    import torch

    if threads is not None:
        torch.set_num_threads(threads)

    from specserve.workers.service.grpc_service import DraftWorkerServicer, TargetWorkerServicer, create_server
    from specserve.workers.runtime.loading import load_model
    from specserve.workers.runtime.runner import ModelRunner

    loaded = load_model(model)
    if kind == "target":
        from specserve.workers.speculation.target import TargetVerifier
        from specserve.workers.service.target_worker import TargetWorker

        servicer = TargetWorkerServicer(
            TargetWorker(TargetVerifier(ModelRunner(loaded, KVCacheConfig())), model.path), batching
        )
    else:
        from specserve.workers.service.draft_worker import DraftWorker
        from specserve.workers.speculation.drafters import ModelDrafter

        runner = ModelRunner(loaded, KVCacheConfig(), vocab_size=target_vocab)
        servicer = DraftWorkerServicer(
            DraftWorker(ModelDrafter(runner), target_vocab, model.path, runner.store), batching
        )

    async def main():
        server, port = await create_server(servicer, "127.0.0.1:0")
        ready.put((kind, port))
        await server.wait_for_termination()

    asyncio.run(main())


class WorkerProcesses:
    """`with WorkerProcesses(target, draft, vocab) as w:` starts a target and a draft worker process; w.target_addresses
    and w.draft_addresses name them as the scheduler's clients expect.

    The draft process runs `draft_threads` torch threads (the target keeps torch's default, one per core), as a Ray
    draft actor with num_cpus < 2 would (Ray sets an actor's OpenMP threads to its CPUs): on CPU a draft pass is too
    small to gain from more, and the idle ones spin on cores the target needs. In a diagnostic run on 2 shared cores
    (k = 4, two alternating pairs): speculating streams ran 2.2x faster with a 1-thread draft at 4 streams, 1.6-2.4x
    at 16; plain decoding, which never calls the draft, the same."""

    def __init__(
        self,
        target: ModelConfig | None,
        draft: ModelConfig,
        target_vocab: int,
        batching: BatchingConfig,
        draft_threads: int | None = 1,
    ):
        """target None: a draft worker only (the target lives elsewhere, e.g. a tensor-parallel replica)."""
        self.specs = ([("target", target, None)] if target is not None else []) + [("draft", draft, draft_threads)]
        self.target_vocab, self.batching = target_vocab, batching

    def __enter__(self):
        ctx = mp.get_context("spawn")
        ready = ctx.Queue()
        self.processes = [
            ctx.Process(
                target=serve_worker, args=(kind, model, self.target_vocab, self.batching, ready, threads), daemon=True
            )
            for kind, model, threads in self.specs
        ]
        for p in self.processes:
            p.start()
        try:
            ports = dict(wait_ready(ready, self.processes, len(self.processes)))
        except RuntimeError:
            self.__exit__()
            raise
        self.target_addresses = {"target-0": f"127.0.0.1:{ports['target']}"} if "target" in ports else {}
        self.draft_addresses = {"draft-0": f"127.0.0.1:{ports['draft']}"}
        return self

    def __exit__(self, *exc):
        for p in self.processes:
            p.kill()
            p.join(10)
