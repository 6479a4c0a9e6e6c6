"""A long prompt's prefill before its first round (the pipeline's), in chunks: each a short call to its target worker
that shares the worker's passes with other requests' rounds (`Scheduler.plan_prefill_chunk`; one prompt prefills at
a time on a worker, first come first served), and each fed on to its draft worker while the next chunk runs
(`Scheduler.plan_feed`): a head gets the chunk's features, a draft model caches its tokens. The drafter's catch-up
over the prompt is then spread over the chunks rather than one long call at the first draft that every other request
on the draft worker waits for, and a head reads the whole prompt, where one first draft call carries only the newest
positions' features (MAX_FEATURE_BYTES, 910 positions of SmolLM2-135M).

The next chunk goes to the worker while the one before it runs (one ahead), so it is queued there when that pass
ends. Sent only after the reply, it reached the worker ~37 ms after each pass on average beside four chat streams
stepping (15 ms alone), while the worker's batch waited for it: 4.5 s of a 4K prompt's 33 s
(results/2026-12-07-1153-smollm2-long-prompt-phases). Its size is planned from the chunks answered
before, one chunk staler. Every call names its committed length, so a chunk that reaches the worker before the one
ahead of it ran (it cannot: a request's calls join its worker's batches in order) would be re-sent whole, not
misapplied.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from specserve.cluster.scheduling.calls import Call
from specserve.cluster.scheduling.faults import WorkerFaults
from specserve.cluster.scheduling.sched_request import SchedRequest
from specserve.cluster.scheduling.scheduler import Scheduler
from specserve.cluster.scheduling.worker_clients import WorkerFull, WorkerUnavailable
from specserve.workers.service.results import ProposeResult, VerifyResult

log = logging.getLogger(__name__)

CallFn = Callable[[SchedRequest, Call], Awaitable]


class Prefill:
    def __init__(self, scheduler: Scheduler, faults: WorkerFaults, verify: CallFn, propose: CallFn,
                 chunking: dict[str, asyncio.Lock]):  # fmt: skip
        """verify / propose: the pipeline's calls (re-sent where the worker lost the request); chunking: a lock per
        target worker, held by the prompt prefilling there."""
        self.scheduler, self.faults = scheduler, faults
        self._verify: Callable[[SchedRequest, Call], Awaitable[VerifyResult]] = verify
        self._propose: Callable[[SchedRequest, Call], Awaitable[ProposeResult]] = propose
        self._chunking = chunking

    async def run(self, req: SchedRequest) -> None:
        """Every chunk of the request's prompt but what goes with its first round; returns once the last feed is in.
        A prompt holds its target worker's chunk lock from its first chunk to its last: prompts prefill there first
        come, first served (vLLM's FCFS). Taking turns chunk by chunk, both prompts of an overlap finish about when
        the second would; this way the first finishes sooner and the second no later."""
        feed: asyncio.Task | None = None
        lock: asyncio.Lock | None = None
        ahead: tuple[Call, asyncio.Task] | None = None  # the chunk sent and not yet answered
        sent: tuple[Call, asyncio.Task] | None = None  # the one sent after it, while it is awaited
        try:
            while True:
                if lock is not self._chunking[req.target_worker]:  # the first chunk, or the request moved
                    if ahead is not None:  # its worker's chunks end before the request takes another's turn
                        feed, _ = await self._chunk(req, *ahead, feed)
                        ahead = None
                        continue
                    if not self.scheduler.has_prefill_chunk(req):
                        break  # a short prompt never queues behind a long one
                    if lock is not None:
                        lock.release()
                        lock = None
                    await self._chunking[req.target_worker].acquire()
                    lock = self._chunking[req.target_worker]
                chunk = self.scheduler.plan_prefill_chunk(req)  # None: the rest goes with its first round
                sent = (chunk, asyncio.ensure_future(self._verify(req, chunk))) if chunk is not None else None
                if ahead is not None:
                    feed, answered = await self._chunk(req, *ahead, feed, after=sent)
                    if not answered:  # its worker failed, and the chunk after it is dropped: plan again from there
                        ahead = sent = None
                        continue
                ahead, sent = sent, None
                if ahead is None:
                    break
        finally:
            # The request was cancelled or failed with chunks in flight: they are dropped, their errors taken.
            in_flight = [pending[1] for pending in (ahead, sent) if pending is not None]
            for task in in_flight:
                task.cancel()
            await asyncio.gather(*in_flight, return_exceptions=True)
            if lock is not None:
                lock.release()
            if feed is not None:  # also when the request was cancelled: its release goes after the feed
                await asyncio.gather(feed, return_exceptions=True)

    async def _chunk(self, req: SchedRequest, call: Call, verify: asyncio.Future, feed: asyncio.Task | None,
                     after: tuple[Call, asyncio.Task] | None = None) -> tuple[asyncio.Task | None, bool]:  # fmt: skip
        """One chunk: a verify of no drafted tokens whose token is not committed (only the last chunk's round commits
        one); a failed target is handled as a round's, and the chunk sent `after` it is cancelled. Returns the
        chunk's feed, under way, and whether the chunk was answered."""
        try:
            reply = await verify
        except WorkerUnavailable as e:
            if after is not None:
                after[1].cancel()
                await asyncio.gather(after[1], return_exceptions=True)
            await self.faults.failed(call.worker, self.faults.targets[call.worker], e)
            if self.scheduler.stranded(req):
                await self.faults.await_target(req)
            return feed, False
        if feed is not None:
            await feed  # the previous chunk's features were taken: the request's relay holds this chunk's alone
        self.scheduler.prefilled(req, call, reply)
        fed = self.scheduler.plan_feed(req, call)
        return (asyncio.get_running_loop().create_task(self._feed(req, fed)) if fed is not None else None), True

    async def _feed(self, req: SchedRequest, call: Call) -> None:
        """The chunk on the request's draft worker; where that fails, its first draft call catches up as before."""
        try:
            await self._propose(req, call)
        except WorkerUnavailable as e:
            await self.faults.failed(call.worker, self.faults.drafts[call.worker], e)
        except WorkerFull:
            pass
        except Exception:  # noqa: BLE001 - the first draft call re-sends what the worker lacks
            log.warning("feeding request %s's prompt to draft worker %s failed", req.request_id, call.worker,
                        exc_info=True)  # fmt: skip
        else:
            self.scheduler.fed(req, call)
