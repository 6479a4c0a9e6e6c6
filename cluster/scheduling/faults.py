"""A model's worker faults, as its pipeline meets them.

A worker that fails a call (unreachable, or alive-checked and silent: worker_clients.py tells a slow call from a dead
worker) is replaced by its restarted replacement when `reconnect` names one, else marked unhealthy: its requests move
to the other workers and re-send their prefixes there. An unhealthy worker is not given up: it is probed until its
health check answers again (a process that was stopped, swapping or partitioned away), then rejoins its pool as a
worker told nothing, and the requests it held elsewhere are released on it. A request whose target worker failed
with no other healthy target left waits up to `worker_wait_s` for one (the failed one back, or a new replica).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from specserve.cluster.scheduling.sched_request import SchedRequest
from specserve.cluster.scheduling.scheduler import NoTargetWorker, Scheduler
from specserve.cluster.scheduling.worker_clients import DraftClient, TargetClient

log = logging.getLogger(__name__)

REJOIN_PROBE_S = 1.0  # how often an unhealthy worker's health check is asked


async def _poll(deadline: float) -> None:
    await asyncio.sleep(max(0.0, min(0.25, deadline - time.monotonic())))


class WorkerFaults:
    """Failures, rejoins and waits for one model's workers (the clients are the pipeline's, shared)."""

    def __init__(
        self,
        scheduler: Scheduler,
        drafts: dict[str, DraftClient],
        targets: dict[str, TargetClient],
        reconnect: Callable[[str], Awaitable[str | None]] | None = None,
        worker_wait_s: float = 600.0,
    ):
        """reconnect(worker) -> the address of the worker's restarted replacement, or None when it has none."""
        self.scheduler = scheduler
        self.drafts = drafts
        self.targets = targets
        self.reconnect = reconnect
        self.worker_wait_s = worker_wait_s
        # Set by the model's membership (serving.py): until membership changes or a deadline; a worker rejoined.
        self.wait_changed: Callable[[float], Awaitable[None]] = _poll
        self.on_rejoin: Callable[[], None] = lambda: None
        self.restarts = 0
        self.failures = 0  # workers marked unhealthy
        self.rejoins = 0  # of those, back after their health check answered again
        self._locks: dict[str, asyncio.Lock] = {}
        self._watching: set[asyncio.Task] = set()

    def _clients(self, worker: str) -> dict:
        return self.drafts if worker in self.drafts else self.targets

    async def failed(self, worker: str, client: DraftClient | TargetClient, error: Exception) -> None:
        """A call found `worker` down: connect to its restarted replacement (which holds no caches, so every request
        re-sends its prefix there), or mark it unhealthy so its requests move elsewhere. Once per failure."""
        async with self._locks.setdefault(worker, asyncio.Lock()):
            clients = self._clients(worker)
            if clients.get(worker) is not client or worker in self.scheduler.unhealthy:
                return  # another request already dealt with this failure
            log.warning("worker %s failed a call: %s", worker, error)
            address = await self.reconnect(worker) if self.reconnect is not None else None
            if address is None:
                held = [r.request_id for r in self.scheduler.requests.values() if worker in r.told]
                self.scheduler.mark_unhealthy(worker)
                self.failures += 1
                self._watch(worker, client, held)
                return
            clients[worker] = client.replacement(address)
            # The old channel is left open: other requests' in-flight calls on it fail as UNAVAILABLE and are
            # retried; closing it would cancel them instead.
            self.scheduler.forget_worker(worker)
            self.restarts += 1
            log.info("worker %s restarted at %s: its requests re-send their prefixes there", worker, address)

    def _watch(self, worker: str, client: DraftClient | TargetClient, held: list[str]) -> None:
        task = asyncio.get_running_loop().create_task(self._until_back(worker, client, held))
        self._watching.add(task)
        task.add_done_callback(self._watching.discard)

    async def _until_back(self, worker: str, client: DraftClient | TargetClient, held: list[str]) -> None:
        """Probe the unhealthy worker until it answers, then let it rejoin; stop if it leaves its pool meanwhile
        (the registry dropped it, or Serve replaced it under another id)."""
        kind = "draft" if worker in self.drafts else "target"
        clients = self._clients(worker)
        while True:
            await asyncio.sleep(REJOIN_PROBE_S)
            if clients.get(worker) is not client or worker not in self.scheduler.unhealthy:
                return
            if await client.alive():
                self.scheduler.add_worker(kind, worker)  # told nothing: its requests re-send their prefixes
                self.rejoins += 1
                log.warning("%s worker %s answers its health check again: it rejoins", kind, worker)
                self.on_rejoin()
                await self._release_moved(worker, client, held)
                return

    async def _release_moved(self, worker: str, client: DraftClient | TargetClient, held: list[str]) -> None:
        """Free what the rejoined worker still holds of the requests that moved away from it (those placed on it again
        since re-send their whole prefix, which replaces it)."""
        for request_id in held:
            req = self.scheduler.requests.get(request_id)
            if req is not None and worker in (req.draft_worker, req.target_worker):
                continue
            try:
                await client.release(request_id)
            except Exception as e:  # noqa: BLE001 - best effort: its cache evicts what is left for room anyway
                log.debug("releasing moved request %s on worker %s failed: %s", request_id, worker, e)

    async def await_target(self, req: SchedRequest) -> None:
        """The request's target worker failed and no healthy one was left: wait up to `worker_wait_s` for one (the
        failed worker rejoining, or another joining); NoTargetWorker when none came."""
        deadline = time.monotonic() + self.worker_wait_s
        failed = req.target_worker
        log.warning("request %s waits up to %.0f s for a healthy target worker", req.request_id, self.worker_wait_s)
        while not self.scheduler.rehome(req):
            if time.monotonic() >= deadline:
                raise NoTargetWorker(
                    f"target worker {failed} failed mid-request and no healthy target worker came back within "
                    f"{self.worker_wait_s:.0f} s; {len(req.state.generated)} tokens were generated before the failure"
                )
            await self.wait_changed(deadline)
        log.info("request %s goes on at target worker %s", req.request_id, req.target_worker)
