"""The one place a worker is put together: model -> runner -> draft or target worker -> gRPC servicer -> server.
Ray actors, the bench's local worker processes, a tensor-parallel replica's rank 0 and the tests' in-process workers
all build theirs here, so they serve alike."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Literal

import grpc

from specserve.workers.config.settings import BatchingConfig, KVCacheConfig, ModelConfig
from specserve.workers.errors import ModelLoadError
from specserve.workers.runtime.loading import LoadedModel, load_model
from specserve.workers.runtime.memory_budget import GIB
from specserve.workers.runtime.runner import ModelRunner
from specserve.workers.service.draft_worker import DraftWorker
from specserve.workers.service.grpc_service import (
    DEFAULT_SERVER_MESSAGE_BYTES,
    DraftWorkerServicer,
    TargetWorkerServicer,
    create_server,
)
from specserve.workers.service.target_worker import TargetWorker
from specserve.workers.speculation.draft_model import ModelDrafter
from specserve.workers.speculation.eagle.config import head_feature_layers
from specserve.workers.speculation.eagle.loading import load_head_drafter
from specserve.workers.speculation.target import TargetVerifier

log = logging.getLogger(__name__)

Role = Literal["draft", "target"]


@dataclass(frozen=True)
class WorkerSpec:
    """What one worker serves and how."""

    role: Role
    model: ModelConfig
    kv_cache: KVCacheConfig = field(default_factory=KVCacheConfig)
    batching: BatchingConfig = field(default_factory=BatchingConfig)
    # A draft's: the target's vocabulary size (its logits are cut or padded to it). None: the model's own.
    vocab_size: int | None = None
    # An EAGLE-3 head directory. A draft worker drafts with it (`model` is then the target, whose config and input
    # embedding it reads; the target itself is not loaded); a target worker captures the features it reads.
    eagle_head: str | None = None


@dataclass
class BuiltWorker:
    """A worker ready to serve: its runner (a ModelRunner, or a TensorParallelRunner on rank 0; None for an EAGLE-3
    head's draft worker), the plain worker object and the servicer a gRPC server hosts."""

    spec: WorkerSpec
    runner: ModelRunner | None
    worker: DraftWorker | TargetWorker
    servicer: DraftWorkerServicer | TargetWorkerServicer

    @property
    def device(self):
        return self.runner.device if self.runner is not None else self.worker.drafter.device


def build_worker(spec: WorkerSpec, loaded: LoadedModel | None = None, runner: ModelRunner | None = None) -> BuiltWorker:
    """model -> runner -> worker -> servicer. `runner`: one made already (a tensor-parallel rank 0's); `loaded`: a
    model already in memory (tests share one among several workers); neither: load `spec.model`."""
    if spec.role == "draft" and spec.eagle_head is not None:
        model = spec.model
        drafter = load_head_drafter(spec.eagle_head, model.path, model.dtype, model.device,
                                    packed_linears=model.packed_linears, enforce_eager=model.enforce_eager)  # fmt: skip
        worker = DraftWorker(drafter, drafter.head.config.vocab_size, spec.eagle_head)
        return BuiltWorker(spec, None, worker, DraftWorkerServicer(worker, spec.batching))
    if runner is None:
        runner = ModelRunner(loaded or load_model(spec.model), spec.kv_cache, vocab_size=spec.vocab_size)
    name = spec.model.path
    if spec.role == "draft":
        worker = DraftWorker(ModelDrafter(runner), runner.vocab_size, name, runner.store)
        servicer = DraftWorkerServicer(worker, spec.batching)
    else:
        if spec.eagle_head is not None:
            _capture_head_features(runner, spec.eagle_head)
        worker = TargetWorker(TargetVerifier(runner), name)
        servicer = TargetWorkerServicer(worker, spec.batching)
    return BuiltWorker(spec, runner, worker, servicer)


def _capture_head_features(runner: ModelRunner, head_dir: str) -> None:
    """A target serving a head captures the features it reads (in the verify passes that ask for them)."""
    if not isinstance(runner, ModelRunner):
        raise ModelLoadError("a tensor-parallel target cannot serve an EAGLE-3 head yet (no rank captures features)")
    layers = head_feature_layers(head_dir, runner.model.config.get_text_config().num_hidden_layers)
    runner.capture_features(layers)
    log.info("target %s captures the features of layers %s for the EAGLE-3 head %s", runner.loaded.path,
             list(layers), head_dir)  # fmt: skip


async def start_worker_server(
    built: BuiltWorker,
    address: str = "127.0.0.1:0",
    secret: str | None = None,
    max_message_bytes: int = DEFAULT_SERVER_MESSAGE_BYTES,
) -> tuple[grpc.aio.Server, int]:
    """Serve `built` over gRPC at `address` (port 0: a free one) in the running event loop; returns (server, port)."""
    server, port = await create_server(built.servicer, address, secret, max_message_bytes)
    host = address.rpartition(":")[0]
    budget = getattr(built.runner, "budget", None)
    log.info(
        "%s worker serving %s on %s at %s:%d%s",
        built.spec.role,
        built.spec.model.path if built.runner is not None else built.spec.eagle_head,  # a head's draft worker
        built.device,
        host,
        port,
        f"; KV cache {budget.capacity_bytes / GIB:.2f} GiB, {budget.capacity_tokens} positions ({budget.source})"
        if budget is not None else "",
    )  # fmt: skip
    if built.runner is not None and not getattr(built.runner, "lean", True):
        # transformers' own forward: its wrappers cost a launch-bound GPU step milliseconds (lean_forward.py)
        log.info("%s worker runs transformers' own forward, not the lean one: its probe disagreed or the "
                 "architecture is not one it knows", built.spec.role)  # fmt: skip
    return server, port


def serve_in_process(spec: WorkerSpec, ready, runner: ModelRunner | None = None, secret: str | None = None) -> None:
    """The whole life of a worker process: build, serve on a free localhost port, put (role, port) in `ready` (a
    multiprocessing queue), serve until terminated."""
    built = build_worker(spec, runner=runner)

    async def main():
        server, port = await start_worker_server(built, "127.0.0.1:0", secret)
        ready.put((spec.role, port))
        await server.wait_for_termination()

    asyncio.run(main())
