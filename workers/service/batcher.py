"""Continuous batching for a worker's model thread: calls queue up while a batch runs and the next batch takes as
many as fit (batch size, token budget; little padding where the worker's forward pads its rows), oldest first.
Requests join and leave between forward passes; a request never appears twice in one batch.

A batch waits briefly (`max_wait_ms`, at most the previous batch's run time) for the requests that are expected
back with their next round before that time is up. Without that, requests that once fell out of step (one went
through a slower draft, one started later) split into two batches that alternate for good, each paying a whole
forward pass: on a target whose step cost is mostly per pass, half the throughput. Each request's return time (from
its answer to its next call) is measured, so a batch waits for a request on its way back from a plain step (a few
ms) or a draft call (tens of ms on a CPU), and not for one that will not be back in time: a draft worker, whose
requests come back only after a verify, does not hold every draft call for requests a forward pass away.

A prompt's prefill (a chunk of a long one, a new request's whole prompt, a chunk fed to a draft worker) makes a long
pass, and a decoding request that misses it waits all of it out: a batch holding a prefill waits longer
(`prefill_wait_ms`) for the decoding requests expected back, so that their rows ride in its pass (vLLM's mixed
prefill-decode step). Without it a long prompt's chunks split the streams beside it into groups that ride in every
other chunk's pass, each stream's round paying two. Where a worker pads its rows (a head's drafting), decoding rows
are taken before a prefill that would not fit beside them; that prefill goes first in the next batch. There a
request's entries are padded too (each row attends over the longest row's): a request deep in a long prompt drafts in
a batch of its own, not beside chat requests a few dozen entries long, whose drafting it made 5x slower."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any

from specserve.workers.config.settings import BatchingConfig

log = logging.getLogger(__name__)

STALE_AFTER_KEYS = 1024  # requests remembered before the ones not served for STALE_AFTER_S are dropped
STALE_AFTER_S = 60.0


@dataclass
class _Job:
    key: str  # the request id
    item: Any
    cost: int  # new positions it feeds
    future: asyncio.Future = field(repr=False)
    prefill: bool = False  # a prompt's positions, no decoding round waits on it
    context: int = 0  # positions it holds before them (what a padded worker's attention pads to the longest)
    passed: bool = False  # left out of a batch once: first in the next
    arrived: float = field(default_factory=time.perf_counter)


class Batcher:
    """`await submit(key, item, cost)` -> that item's result from `run(items)`, which runs on `executor` and returns
    one result or exception per item, in order. A `run` that raises fails every item of its batch with that error."""

    def __init__(
        self,
        executor: Executor,
        run: Callable[[Sequence[Any]], list[Any]],
        config: BatchingConfig,
        on_batch: Callable[[int, float], None] | None = None,
        pads_rows: bool = True,
    ):
        """pads_rows: the worker's forward pads every row to the batch's widest (the padding limit applies)."""
        self._executor = executor
        self.pads_rows = pads_rows
        self._run = run
        self.config = config
        self._on_batch = on_batch  # (rows, seconds) after each batch
        self._queue: list[_Job] = []
        self._drainer: asyncio.Task | None = None
        self._served_at: dict[str, float] = {}  # request -> when the batch that last served it ended (not released)
        self._return_s: dict[str, float] = {}  # request -> its decayed mean time from an answer to its next call
        self._arrived: asyncio.Event | None = None
        self._last_run_s = 0.0
        self.batches = 0
        self.rows = 0
        self.largest = 0  # most rows one batch held

    @property
    def queued(self) -> int:
        return len(self._queue)

    async def submit(self, key: str, item: Any, cost: int, prefill: bool = False, context: int = 0) -> Any:
        """prefill: the call feeds a prompt's positions (its own or a chunk), with no decoding round waiting on it;
        context: the positions its request holds before the call's (a padded worker pads them to the longest row's)."""
        served = self._served_at.get(key)
        if served is not None:
            gap = time.perf_counter() - served
            self._return_s[key] = (self._return_s.get(key, gap) + gap) / 2
        future = asyncio.get_running_loop().create_future()
        self._queue.append(_Job(key, item, cost, future, prefill, context=context))
        if self._arrived is not None:
            self._arrived.set()
        if self._drainer is None or self._drainer.done():
            self._drainer = asyncio.create_task(self._drain())
        result = await future
        if isinstance(result, Exception):
            raise result
        return result

    def forget(self, key: str) -> None:
        """The request was released: do not wait for its next call."""
        self._served_at.pop(key, None)
        self._return_s.pop(key, None)

    def _coming(self, now: float, deadline: float) -> set[str]:
        """The requests served before and expected back by `deadline` (a request never measured is expected at
        once); one more than a forward pass late is not waited for (it moved, or went quiet)."""
        coming = set()
        for key, served in self._served_at.items():
            expected = served + self._return_s.get(key, 0.0)
            if now - self._last_run_s <= expected <= deadline:
                coming.add(key)
        return coming

    async def _gather(self) -> None:
        """Wait (bounded) until every request expected back within the wait budget is queued again; once the queue
        holds a prefill (also one that arrives during the wait), the budget is the longer one: a request that misses
        a prompt's pass waits all of it out."""
        start = time.perf_counter()
        while len(self._queue) < self.config.max_batch_size:
            budget_ms = self.config.max_wait_ms
            if any(job.prefill for job in self._queue):
                budget_ms = max(budget_ms, self.config.prefill_wait_ms)
            deadline = start + min(budget_ms / 1e3, self._last_run_s)
            if not self._coming(start, deadline) - {job.key for job in self._queue}:
                return
            left = deadline - time.perf_counter()
            if left <= 0:
                return
            self._arrived = asyncio.Event()
            try:
                await asyncio.wait_for(self._arrived.wait(), left)
            except TimeoutError:  # the wait budget is spent: run what is queued
                return
            finally:
                self._arrived = None

    def _pads_little(self, rows: int, longest: int, real: int, per_row: int) -> bool:
        """Whether `rows` rows of `real` units in all (new positions, or the entries they attend over), padded to the
        longest row's `longest` where the worker pads every row (an EAGLE-3 head's drafting), waste at most `per_row`
        units a row or half the real ones; a packed forward (ModelRunner's, runtime/ragged.py) pads nothing, so a
        prompt's chunk joins decoding rows, and rows of any depth mix."""
        return not self.pads_rows or rows * longest - real <= max(per_row * rows, real // 2)

    def _take(self) -> list[_Job]:
        batch, keys, tokens, widest, rest = [], set(), 0, 0, []
        longest, held = 0, 0
        # Oldest first, but a prefill not yet passed over after the decoding rows (stable: arrival order kept).
        for job in sorted(self._queue, key=lambda j: j.prefill and not j.passed):
            if job.future.done():  # the caller gave up (deadline, cancellation)
                continue
            fits = len(batch) < self.config.max_batch_size and (
                not batch
                or tokens + job.cost <= self.config.max_batch_tokens
                and self._pads_little(
                    len(batch) + 1, max(widest, job.cost), tokens + job.cost, self.config.max_padding_per_row
                )
                and self._pads_little(
                    len(batch) + 1,
                    max(longest, job.context),
                    held + job.context,
                    self.config.max_context_padding_per_row,
                )
                # a fed chunk's rows on a padded worker (a head's) lengthen every draft beside them, while their
                # target waits for those drafts: it runs next, while the target verifies them
                and not (self.pads_rows and job.prefill and not job.passed)
            )
            if fits and job.key not in keys:
                batch.append(job)
                keys.add(job.key)
                tokens += job.cost
                widest = max(widest, job.cost)
                held += job.context
                longest = max(longest, job.context)
            else:
                job.passed = True
                rest.append(job)
        self._queue = sorted(rest, key=lambda j: j.arrived)
        return batch

    async def _drain(self) -> None:
        batch: list[_Job] = []
        try:
            while True:
                if self._served_at and (self.config.max_wait_ms > 0 or self.config.prefill_wait_ms > 0):
                    await self._gather()
                batch = self._take()
                if not batch:
                    return
                await self._run_one(batch)
        except asyncio.CancelledError:
            # The loop is shutting down (server stopped): no caller may wait forever on a batch that will not run.
            for job in batch + self._queue:
                job.future.cancel()
            self._queue = []
            raise

    async def _run_one(self, batch: list[_Job]) -> None:
        start = time.perf_counter()
        try:
            run = asyncio.get_running_loop().run_in_executor(self._executor, self._run, [job.item for job in batch])
            results = await run
        except Exception as e:  # a failed batch fails its rows, never the drainer
            log.error("a batch of %d rows failed", len(batch), exc_info=e)
            results = [e] * len(batch)
        end = time.perf_counter()
        self._last_run_s = end - start
        for job, result in zip(batch, results, strict=True):
            if not isinstance(result, Exception):
                self._served_at[job.key] = end
        if len(self._served_at) > STALE_AFTER_KEYS:  # requests never released (their caller vanished): forget them
            for key in [k for k, t in self._served_at.items() if end - t > STALE_AFTER_S]:
                self.forget(key)
        self.batches += 1
        self.rows += len(batch)
        self.largest = max(self.largest, len(batch))
        if self._on_batch is not None:
            self._on_batch(len(batch), time.perf_counter() - start)
        for job, result in zip(batch, results, strict=True):
            if not job.future.done():
                job.future.set_result(_queued(result, start - job.arrived))


def _queued(result: Any, seconds: float) -> Any:
    """A result stamped with the time its call waited for its batch (the round accounting's queue share), where its
    type has room for it (workers/service/results.py)."""
    if dataclasses.is_dataclass(result) and hasattr(result, "queued_seconds"):
        return dataclasses.replace(result, queued_seconds=seconds)
    return result
