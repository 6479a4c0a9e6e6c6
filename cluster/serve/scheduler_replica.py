"""The scheduler deployment: one replica tracks the pools' workers (from the app's registry) and runs the requests
an ingress prepared, their draft/verify rounds going straight to the workers over gRPC."""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator
from typing import Any

from specserve.cluster.app_config import AppConfig, app_config
from specserve.cluster.scheduling.prepared import Chunk, Prepared
from specserve.cluster.serve.health import Readiness
from specserve.cluster.serve.metrics import GAUGE_REFRESH_S, SchedulerMetrics
from specserve.cluster.serve.pool_worker import HEARTBEAT_S
from specserve.cluster.serve.registry import registry_actor
from specserve.cluster.serve.replica_env import app_name, every, resolve_paths, use_serve_log_files

log = logging.getLogger(__name__)

POLL_S = 1.0
MERGE_SLICE = 64  # other replicas' prefix records merged between two turns of the event loop
# A restarted registry knows only the workers that re-registered since: within this long of its restart, pollers keep
# the workers they knew (every live one re-registers within a heartbeat).
REJOIN_S = 2 * HEARTBEAT_S + POLL_S


class SchedulerReplica:
    """A replica of the Serve deployment "scheduler": feeds the registry's workers to the app's `ModelServing`
    (cluster/scheduling/model_serving.py: requests, admission, each model's workers), which runs each served model's
    rounds through its `Pipeline` and `Scheduler` state machine. The ingress calls it through a deployment handle, so
    when a scheduler replica dies the ingress sees it and answers UNAVAILABLE (Serve's proxy would report a dead
    replica as INTERNAL). Pool handles are passed in only so Serve deploys the pools with the app; requests go to the
    workers over their own gRPC servers."""

    def __init__(self, app_args: dict, *pools: Any):
        from specserve.cluster.scheduling.model_serving import ModelServing

        use_serve_log_files()
        self.config: AppConfig = app_config(app_args)
        paths = {m.name: resolve_paths(m) for m in self.config.models}
        self.serving = ModelServing(self.config, paths, metrics=SchedulerMetrics([m.name for m in self.config.models]))
        self._poller: asyncio.Task | None = None
        self._gauges: asyncio.Task | None = None
        self._seen: tuple[str, int] | None = None  # (registry incarnation, version) last applied
        self._rows: list[dict] = []
        self.replica = uuid.uuid4().hex  # how the registry counts this replica's running requests while draining
        self._prefix_cursor: tuple[str, int] = ("", 0)  # (registry incarnation, the newest prefix record taken)
        log.info("scheduler replica started: models %s", ", ".join(self.serving.models))

    # -- worker membership ---------------------------------------------------------------------------------------

    async def _ensure_polling(self) -> None:
        if self._poller is None or self._poller.done():
            self.registry = registry_actor(app_name())
            self.serving.secret = await self.registry.secret.remote()
            await self._poll_once()
            self._poller = asyncio.get_running_loop().create_task(every(POLL_S, self._poll_once, "registry poll"))
        if self.serving.metrics is not None and (self._gauges is None or self._gauges.done()):
            self._gauges = asyncio.get_running_loop().create_task(
                every(GAUGE_REFRESH_S, self._refresh_metrics, "metrics refresh")
            )

    async def _refresh_metrics(self) -> None:
        self.serving.metrics.refresh()

    async def _poll_once(self) -> None:
        snap = await self.registry.snapshot.remote(self.replica, self.serving.active)
        if snap["draining"] != self.serving.draining:
            log.info("the app is %s", "draining: no new requests" if snap["draining"] else "admitting requests again")
            self.serving.draining = snap["draining"]
        rows, seen = snap["members"], (snap["incarnation"], snap["version"])
        if snap["uptime_s"] < REJOIN_S:  # a restarted registry: workers it has not heard from yet are still there
            known = {r["worker_id"] for r in rows}
            rows = rows + [r for r in self._rows if r["worker_id"] not in known]
            seen = None  # merged, not the registry's own: apply again next time
        if seen is None or seen != self._seen:
            self.serving.sync_workers(rows)
        self._seen, self._rows = seen, rows
        await self._share_prefixes(snap)

    async def _share_prefixes(self, snap: dict) -> None:
        """Pass this replica's prefix records to the others and take theirs (prefixes.py), where there are others."""
        records = self.serving.take_prefix_records()
        if snap.get("scheduler_replicas", 1) <= 1:
            return
        incarnation, since = self._prefix_cursor
        since = since if incarnation == snap["incarnation"] else 0  # a restarted registry numbers them from 0 again
        newest, theirs = await self.registry.share_prefixes.remote(self.replica, records, since)
        for model, rows in theirs.items():  # in slices: 2,048 records of 100 blocks took 0.2 s here, the rounds waiting
            for start in range(0, len(rows), MERGE_SLICE):
                self.serving.merge_prefix_records({model: rows[start : start + MERGE_SLICE]})
                await asyncio.sleep(0)
        self._prefix_cursor = (snap["incarnation"], newest)

    async def check_health(self) -> None:
        await self._ensure_polling()

    async def status(self) -> dict:
        await self._ensure_polling()
        return self.serving.status()

    async def readiness(self) -> Readiness:
        """Whether this replica takes requests: not draining, and every served model has a healthy target worker."""
        await self._ensure_polling()
        return Readiness.of(self.serving.status(accounting=False), self.serving.draining)

    async def wait_ready(self, timeout_s: float | None = None, model: str | None = None) -> None:
        await self._ensure_polling()
        for m in self.config.models:
            if model is None or m.name == model:
                await self.serving.wait_ready(m.name, timeout_s, costs=True)

    # -- requests, as the ingress prepared them ----------------------------------------------------------------------

    async def generate(self, prepared: Prepared) -> dict:
        await self._ensure_polling()
        return await self.serving.generate(prepared)

    async def run(self, prepared: Prepared) -> AsyncIterator[Chunk]:
        """The request's chunks, one per round (a streaming handle method)."""
        await self._ensure_polling()
        async for chunk in self.serving.run(prepared):
            yield chunk
