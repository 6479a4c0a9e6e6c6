"""The scheduler's placement half (`Scheduler` inherits it): which draft and target workers a model has, which of
them are healthy, and which holds each request: least loaded, or the one holding most of a new request's prompt
where that draws it (prefixes.py); a failed or departed worker's requests move to the others and re-send their
committed prefix there."""

from __future__ import annotations

import logging

from specserve.cluster.scheduling.prefixes import PrefixRecords
from specserve.cluster.scheduling.sched_request import SchedRequest

log = logging.getLogger("specserve.cluster.scheduling.scheduler")  # its records are the scheduler's


class WorkerPlacement:
    """Expects the scheduler's draft_workers, target_workers, requests, unhealthy, prefixes, batches and chunks."""

    draft_workers: list[str]
    target_workers: list[str]
    requests: dict[str, SchedRequest]
    unhealthy: set[str]
    prefixes: PrefixRecords

    def _least_loaded(self, workers: list[str], attr: str, prompt: list[int] | None = None) -> str | None:
        """The healthy worker running fewest requests; with `prompt`, the one holding most of it where that draws
        the request (affinity.py)."""
        healthy = [w for w in workers if w not in self.unhealthy]
        if not healthy:
            return None
        load = {w: 0 for w in healthy}
        for req in self.requests.values():
            w = getattr(req, attr)
            if w in load:
                load[w] += 1
        if prompt is not None and len(healthy) > 1:
            held = self.prefixes.affinity["target" if attr == "target_worker" else "draft"].place(prompt, load)
            if held is not None:
                return held
        return min(healthy, key=lambda w: (load[w], healthy.index(w)))

    def mark_unhealthy(self, worker: str) -> None:
        """Move the worker's requests elsewhere; they re-send their committed prefix to the new worker."""
        moved = sum(worker in (req.draft_worker, req.target_worker) for req in self.requests.values())
        log.warning("worker %s failed: its %d requests move to other workers", worker, moved)
        self._move_requests(worker)

    def _move_requests(self, worker: str) -> None:
        self.unhealthy.add(worker)
        for req in self.requests.values():
            if req.draft_worker == worker:
                req.draft_worker = self._least_loaded(self.draft_workers, "draft_worker")  # None: target-only
                if req.draft_worker is None and req.features is not None:
                    req.features.drop()
            if req.target_worker == worker:
                # No replacement: the request stays stranded on the failed worker and its driver fails it.
                req.target_worker = self._least_loaded(self.target_workers, "target_worker") or worker
            req.told.pop(worker, None)
            req.recorded.discard(worker)

    def add_worker(self, kind: str, worker: str) -> None:
        """A new worker joined its pool (or a replaced one came back under the same name)."""
        workers = self.draft_workers if kind == "draft" else self.target_workers
        if worker not in workers:
            workers.append(worker)
        log.info("%s worker %s attached%s", kind, worker, " (back from unhealthy)" if worker in self.unhealthy else "")
        self.unhealthy.discard(worker)
        self.forget_worker(worker)

    def remove_worker(self, worker: str) -> None:
        """The worker left its pool: its requests move to the others, as for a failure."""
        log.info("worker %s detached", worker)
        if worker in self.draft_workers or worker in self.target_workers:
            self._move_requests(worker)
        for workers in (self.draft_workers, self.target_workers):
            if worker in workers:
                workers.remove(worker)
        self.unhealthy.discard(worker)
        self.batches.pop(worker, None)
        self.forget_worker(worker)

    def healthy(self, kind: str) -> list[str]:
        workers = self.draft_workers if kind == "draft" else self.target_workers
        return [w for w in workers if w not in self.unhealthy]

    def forget_worker(self, worker: str) -> None:
        """The worker was replaced by a fresh process: it has been told nothing, and holds no prefix."""
        for req in self.requests.values():
            req.told.pop(worker, None)
            req.recorded.discard(worker)
        self.prefixes.forget(worker)
        self.chunks.forget(worker)

    def stranded(self, req: SchedRequest) -> bool:
        """The request's target worker failed and no healthy one was left to take it."""
        return req.target_worker in self.unhealthy

    def rehome(self, req: SchedRequest) -> bool:
        """A stranded request onto a healthy target worker if one is there now; whether it has one."""
        req.target_worker = self._least_loaded(self.target_workers, "target_worker") or req.target_worker
        return not self.stranded(req)
