"""Admission of a scheduler replica's requests: at most `max_active` run; the rest wait in one bounded queue and start
in arrival order as running requests end, as vLLM's waiting queue does. Past the queue's bound a request is refused
at once (OverloadedError: RESOURCE_EXHAUSTED / 429 with Retry-After), and while the app drains (DrainingError: 503).
A request whose client leaves while it waits gives its place up."""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import itertools
import logging
import math
import statistics
from collections import deque
from collections.abc import AsyncIterator

from specserve.workers.errors import DrainingError, OverloadedError

log = logging.getLogger(__name__)

# Queue-time histogram bounds (seconds), cumulative counts as Prometheus keeps them: a reader diffs two readings and
# interpolates its percentiles (cluster/bench/burst.py), as histogram_quantile does.
QUEUE_BUCKETS_S = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 15.0,
                   20.0, 30.0, 45.0, 60.0, 90.0, 120.0, 180.0, 300.0, 600.0, math.inf)  # fmt: skip


class Admission:
    """Slots for running requests and the queue in front of them (asyncio, one event loop: no locks)."""

    def __init__(self, max_active: int, max_queued: int):
        self.max_active = max_active
        self.max_queued = max_queued
        self.running = 0
        self.draining = False  # the app is stopping: admit nothing new (queued requests still run)
        self._waiting: deque[asyncio.Future] = deque()
        self.queue_times = deque(maxlen=4096)  # seconds each admitted request waited here, recent ones
        self.queue_histogram = [0] * len(QUEUE_BUCKETS_S)  # every admitted request's, by bucket (not cumulative)
        self.refused = 0

    @property
    def queued(self) -> int:
        return sum(not w.done() for w in self._waiting)

    def check(self, what: str = "") -> None:
        """Refuse now what `slot` would refuse: DrainingError while draining, OverloadedError past the queue's bound.
        `what` names the request in log lines."""
        if self.draining:
            log.info("refused request %s: the server is draining", what)
            raise DrainingError()
        if self.running >= self.max_active and self.queued >= self.max_queued:
            self.refused += 1
            log.info("refused request %s: %d running, %d queued (max_queued_requests)", what, self.running,
                     self.queued)  # fmt: skip
            raise OverloadedError(f"{self.running} requests are running and {self.queued} are queued, the limit of "
                                  f"this replica's queue")  # fmt: skip

    @contextlib.asynccontextmanager
    async def slot(self, what: str = "") -> AsyncIterator[None]:
        """Hold a running slot for the body: at once when one is free and nobody waits, else after the requests
        queued before this one."""
        loop = asyncio.get_running_loop()
        start = loop.time()
        self.check(what)
        if self.running < self.max_active and not self.queued:
            self.running += 1
        else:
            turn = loop.create_future()
            self._waiting.append(turn)
            try:
                await turn  # the slot is handed over already counted in `running`
            except BaseException:  # cancelled, or the request's generator closed, while it waited
                if turn.done() and not turn.cancelled():
                    self._release()  # granted as the client left: pass it on
                else:
                    turn.cancel()
                with contextlib.suppress(ValueError):
                    self._waiting.remove(turn)
                raise
        waited = loop.time() - start
        self.queue_times.append(waited)
        self.queue_histogram[bisect.bisect_left(QUEUE_BUCKETS_S, waited)] += 1
        try:
            yield
        finally:
            self._release()

    def _release(self) -> None:
        while self._waiting:
            turn = self._waiting.popleft()
            if not turn.done():  # a waiter whose client left is skipped
                turn.set_result(None)
                return
        self.running -= 1

    def summary(self) -> dict:
        recent = list(self.queue_times)
        return {
            "running_requests": self.running,
            "queued_requests": self.queued,
            "max_active_requests": self.max_active,
            "max_queued_requests": self.max_queued,
            "refused_requests": self.refused,
            "queue_time_s_p50": statistics.median(recent) if recent else 0.0,
            "queue_time_s_max": max(recent, default=0.0),
            # Every admitted request's queue time: cumulative counts at each bound ("inf": all admitted)
            "queue_time_buckets": dict(
                zip(map(str, QUEUE_BUCKETS_S), itertools.accumulate(self.queue_histogram), strict=True)
            ),
        }
