"""One replica of a draft or target pool deployment: loads its model, serves it over its own gRPC server (the
scheduler replicas call it directly, per request, with the KV state protocol) and keeps its address registered in the
app's registry actor."""

from __future__ import annotations

import asyncio
import logging
import time

from ray import serve

from specserve.cluster.app_config import ModelPairConfig
from specserve.cluster.serve.metrics import GAUGE_REFRESH_S, WorkerMetrics
from specserve.cluster.serve.registry import registry_actor
from specserve.cluster.serve.replica_env import app_name, every, resolve_paths

log = logging.getLogger(__name__)

HEARTBEAT_S = 5.0


class PoolWorker:
    """Loads the model, serves it over its own gRPC server and keeps its address registered (a heartbeat, so a
    restarted registry relearns it)."""

    async def __init__(self, model: dict, kind: str, max_message_bytes: int | None = None):
        import ray

        cfg = ModelPairConfig.model_validate(model)
        self.body = _worker_body(cfg, kind)
        self.store = self.body.worker.verifier.runner.store if kind == "target" else self.body.worker.store
        self.registry = registry_actor(app_name())
        self.address = await self.body.start(await self.registry.secret.remote(), max_message_bytes)
        self.model, self.kind = cfg.name, kind
        self.worker_id = f"{kind}-{cfg.name}-{serve.get_replica_context().replica_id.unique_id}"
        self.node = ray.get_runtime_context().get_node_id()
        self.metrics = WorkerMetrics()
        await self._register()
        loop = asyncio.get_running_loop()
        self._beat = loop.create_task(
            every(HEARTBEAT_S, self._register, f"worker {self.worker_id}'s heartbeat to the registry")
        )
        self._gauges = loop.create_task(every(GAUGE_REFRESH_S, self._report, f"worker {self.worker_id}'s metrics"))
        log.info("%s worker %s of model %r serving at %s", kind, self.worker_id, cfg.name, self.address)

    async def _register(self) -> None:
        store = self.store
        await self.registry.register.remote(self.model, self.kind, self.worker_id, self.address,
                                            store.capacity_tokens if store is not None else 0,
                                            store.capacity_bytes if store is not None else 0)  # fmt: skip

    async def _report(self) -> None:
        if self.store is not None:
            self.metrics.report(self.model, self.kind, self.worker_id, self.store)

    async def info(self) -> dict:
        """Who and where this replica is: its worker id, gRPC address, node, kind, torch's CPU threads, and the nodes
        of its follower ranks (a tensor-parallel replica; empty otherwise)."""
        import torch

        return {"worker_id": self.worker_id, "address": self.address, "node_id": self.node, "kind": self.kind,
                "threads": torch.get_num_threads(), "followers": await self.body.followers_nodes()}  # fmt: skip

    def record_autoscaling_stats(self) -> dict[str, float]:
        """Custom autoscaling metrics (Serve sees no handle traffic to pools: requests come over gRPC)."""
        now, busy = time.monotonic(), self.body.servicer.busy_s
        last_t, last_busy = getattr(self, "_last_stats", (now, busy))
        self._last_stats = (now, busy)
        fraction = (busy - last_busy) / (now - last_t) if now > last_t else 0.0
        return {
            "busy_fraction": min(1.0, max(0.0, fraction)),
            "requests": float(len(self.store) if self.store is not None else 0),
        }

    async def check_health(self) -> None:
        if self._beat.done():
            raise RuntimeError("the worker's heartbeat stopped")
        failed = getattr(self.body.runner, "failed", None)
        if failed:  # a tensor-parallel rank died: Serve replaces the whole replica (its ranks die with it)
            log.error("worker %s: %s", self.worker_id, failed)
            raise RuntimeError(failed)

    async def __del__(self):
        self._beat.cancel()
        self._gauges.cancel()
        try:
            await self.registry.unregister.remote(self.worker_id)
            await self.body.server.stop(grace=2.0)
        except Exception as e:  # noqa: BLE001 - shutting down: the registry forgets it within its TTL anyway
            log.info("worker %s: unclean shutdown (%s)", self.worker_id, e)
        log.info("worker %s stopped", self.worker_id)


def _worker_body(cfg: ModelPairConfig, kind: str):
    """The draft or target worker's body, loaded in this replica. With an EAGLE-3 head as the model's draft, draft
    workers draft with the head (reading only the target's config and input embedding) and target workers capture the
    features it reads."""
    from specserve.cluster.serve.worker_body import DraftWorkerBody, TargetWorkerBody
    from specserve.workers.config.settings import ModelConfig
    from specserve.workers.speculation.eagle.config import resolve_eagle_head

    target_path, draft_path = resolve_paths(cfg)
    head = resolve_eagle_head(draft_path)
    pool = cfg.target_pool if kind == "target" else cfg.draft_pool
    path = target_path if kind == "target" or head is not None else draft_path
    model = ModelConfig(path=path, dtype=cfg.dtype, device=cfg.device, enforce_eager=cfg.enforce_eager)
    if kind == "target":
        return TargetWorkerBody(model, pool, eagle_head=head)
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(target_path, local_files_only=True).get_text_config().vocab_size
    return DraftWorkerBody(model, pool, vocab, eagle_head=head)
