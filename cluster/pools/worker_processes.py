"""Draft and target workers in their own local processes, each behind its own gRPC server: the disaggregated shape
on one machine without Ray, for the bench's disaggregated and tensor-parallel rows (separate processes, so the draft's
Python work never waits on the target's interpreter lock, as it would with both in one process)."""

from __future__ import annotations

import multiprocessing as mp

from specserve.workers.config import BatchingConfig, ModelConfig
from specserve.workers.service.assembly import WorkerSpec, serve_in_process
from specserve.workers.service.local_processes import wait_ready


def serve_worker(spec: WorkerSpec, ready, threads: int | None = None) -> None:
    """The whole life of one worker process: load, serve on a free localhost port ((role, port) sent through
    `ready`), forever. threads: torch's CPU threads in this process (None: torch's default, one per core)."""
    import threading

    import tqdm

    # tqdm's default write lock includes a multiprocessing lock, registered with the parent's resource tracker; this
    # process ends killed, never unregisters it, and the tracker warns of a leaked semaphore at exit. Its bars (the
    # weight loading's) are written from one thread: a thread lock is enough.
    tqdm.tqdm.set_lock(threading.RLock())
    if threads is not None:
        from specserve.workers.runtime.threads import use_threads

        use_threads(threads)
    serve_in_process(spec, ready)


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
        eagle_head: str | None = None,
    ):
        """target None: a draft worker only (the target lives elsewhere, e.g. a tensor-parallel replica). eagle_head:
        an EAGLE-3 head directory the draft worker drafts with (`draft` is then the target's config: the head reads
        its config and input embedding), whose features the target worker captures."""
        draft_spec = WorkerSpec("draft", draft, batching=batching, vocab_size=target_vocab, eagle_head=eagle_head)
        self.specs = [(draft_spec, draft_threads)]
        if target is not None:
            self.specs.insert(0, (WorkerSpec("target", target, batching=batching, eagle_head=eagle_head), None))

    def __enter__(self):
        ctx = mp.get_context("spawn")
        ready = ctx.Queue()
        self.processes = [
            ctx.Process(target=serve_worker, args=(spec, ready, threads), daemon=True) for spec, threads in self.specs
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
