"""Executes the scheduler's plans over gRPC, pipelined two ways:

1. across requests: every request runs its own rounds concurrently, so while the target verifies request A the draft
   worker drafts for request B (each worker serialises its own model work; the overlap is between workers);
2. within a request (PEARL-style): while the target verifies round r, the draft worker already drafts round r + 1
   assuming all of round r is accepted; the pre-draft is used when that held, dropped otherwise.

Faults: a worker that lost a request's cache (NOT_FOUND) gets the whole committed prefix again; a worker that cannot
be reached is marked unhealthy and its requests move to another worker (a draft failure falls back to target-only
decoding until another draft worker is available). Outputs do not change either way.
"""

from __future__ import annotations

import asyncio
import contextlib
import statistics
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

from specserve.cluster.scheduling.policies import VerifyCostModel
from specserve.cluster.scheduling.scheduler import Call, NoTargetWorker, PreDraft, SchedRequest, Scheduler
from specserve.cluster.scheduling.worker_clients import DraftClient, TargetClient, WorkerLostRequest, WorkerUnavailable
from specserve.workers.config import SamplingParams, SpecParams
from specserve.workers.speculation.drafters import NgramDrafter


@dataclass
class RoundTimes:
    orchestration_s: float = 0.0  # round wall time not spent awaiting workers: the scheduler's own overhead
    rounds: int = 0
    recent: deque = field(default_factory=lambda: deque(maxlen=4096))  # per-round orchestration seconds

    def p50_ms(self) -> float:
        return 1e3 * statistics.median(self.recent) if self.recent else 0.0


class Pipeline:
    def __init__(
        self,
        scheduler: Scheduler,
        drafts: dict[str, DraftClient],
        targets: dict[str, TargetClient],
        predraft: bool = True,
        reconnect: Callable[[str], Awaitable[str | None]] | None = None,
        verify_costs: VerifyCostModel | None = None,
    ):
        """reconnect(worker) -> the address of the worker's restarted replacement, or None when it has none.
        verify_costs: the target's batched step cost, fitted from verify replies for the speculation policy (pass
        one to keep what was learnt across pipelines)."""
        self.scheduler = scheduler
        self.verify_costs = verify_costs or VerifyCostModel()
        # Each call reports its batch's size, so a batch of n is reported n times: calls / sum(1/n) = batches' mean.
        self.verify_calls, self.inverse_batch_rows = 0, 0.0
        self.drafts = drafts
        self.targets = targets
        self.predraft = predraft
        self.reconnect = reconnect
        self.restarts = 0
        self._failure_locks: dict[str, asyncio.Lock] = {}
        self.ngram = NgramDrafter()  # prompt lookup needs no model: it runs here, next to the committed tokens
        self.times = RoundTimes()

    async def _worker_failed(self, worker: str, failed_client) -> None:
        """A call found `worker` down: connect to its restarted replacement (which holds no caches, so every request
        re-sends its prefix there), or mark it unhealthy so its requests move elsewhere. Once per failure."""
        lock = self._failure_locks.setdefault(worker, asyncio.Lock())
        async with lock:
            clients = self.drafts if worker in self.drafts else self.targets
            if clients.get(worker) is not failed_client or worker in self.scheduler.unhealthy:
                return  # another request already dealt with this failure
            address = await self.reconnect(worker) if self.reconnect is not None else None
            if address is None:
                self.scheduler.mark_unhealthy(worker)
                return
            clients[worker] = type(failed_client)(address, failed_client.timeout_s, failed_client.secret)
            # The old channel is left open: other requests' in-flight calls on it fail as UNAVAILABLE and are
            # retried; closing it would cancel them instead.
            self.scheduler.forget_worker(worker)
            self.restarts += 1

    async def _call(self, req: SchedRequest, call: Call, fn, resends: int = 3):
        """A call; when the worker lost the request (restarted, or evicted it for room), the same call with the whole
        sequence, again if a full cache evicted the re-sent request too (a few times, then the error stands)."""
        for _ in range(resends):
            try:
                return await fn(call)
            except WorkerLostRequest:
                call = self.scheduler.resend(req, call)
        return await fn(call)

    async def _propose(self, req: SchedRequest, call: Call) -> tuple[list[int], bytes]:
        return await self._call(req, call, lambda c: self.drafts[c.worker].propose(c, req.params))

    async def _verify(self, req: SchedRequest, call: Call) -> tuple[int, int]:
        return await self._call(req, call, lambda c: self.targets[c.worker].verify(c, req.params))

    async def rounds(self, req: SchedRequest) -> AsyncIterator[list[int]]:
        """Run the request's rounds; yields the tokens each round commits."""
        sched = self.scheduler
        pre: PreDraft | None = None
        try:
            while not req.state.finished:
                round_start, waited = time.perf_counter(), 0.0
                k = sched.k_for(req)
                reused = sched.use_predraft(req, pre) if k else None
                drafted, probs = [], b""
                if reused is not None:
                    drafted, probs = reused
                    req.pipelined_rounds += 1
                elif k and req.spec.method == "ngram":
                    drafted = self.ngram.propose(req.request_id, req.state.tokens, k, req.params).tokens  # no model
                elif k:
                    w0 = time.perf_counter()
                    draft_call = sched.plan_draft(req, k)
                    client = self.drafts[draft_call.worker]
                    try:
                        drafted, probs = await self._propose(req, draft_call)
                    except WorkerUnavailable:  # this round: target-only; later: the restarted or another drafter
                        await self._worker_failed(draft_call.worker, client)
                    waited += time.perf_counter() - w0
                verify_call = sched.plan_verify(req, drafted, probs)
                client = self.targets[verify_call.worker]
                verify = asyncio.ensure_future(self._verify(req, verify_call))
                pre_task = None
                if self.predraft and drafted:
                    pre_call = sched.plan_predraft(req, drafted, k)
                    if pre_call is not None:
                        pre_task = asyncio.ensure_future(self._propose(req, pre_call))
                w0 = time.perf_counter()
                try:
                    reply = await verify
                    accepted, next_token = reply.accepted, reply.next_token
                    self.verify_costs.observe(reply.batch_tokens, reply.batch_seconds)
                    self.verify_calls += 1
                    self.inverse_batch_rows += 1.0 / max(1, reply.batch_rows)
                except WorkerUnavailable:
                    await _cancel(pre_task)
                    await self._worker_failed(verify_call.worker, client)
                    if sched.stranded(req):
                        raise NoTargetWorker(
                            f"target worker {verify_call.worker} failed mid-request and no healthy target worker "
                            f"is left; {len(req.state.generated)} tokens were generated before the failure"
                        ) from None
                    continue  # the round is re-planned on the restarted or another target: nothing was committed
                finally:
                    waited += time.perf_counter() - w0
                committed = sched.apply_verify(req, drafted, accepted, next_token)
                pre = None
                if pre_task is not None:
                    if accepted == len(drafted) and not req.state.finished:
                        w0 = time.perf_counter()
                        try:
                            pre_drafted, pre_probs = await pre_task
                            pre = PreDraft(after=req.state.tokens[:-1], drafted=pre_drafted, draft_probs=pre_probs)
                        except (WorkerUnavailable, WorkerLostRequest):
                            pre = None
                        waited += time.perf_counter() - w0
                    else:
                        await _cancel(pre_task)
                overhead = time.perf_counter() - round_start - waited
                self.times.orchestration_s += overhead
                self.times.recent.append(overhead)
                self.times.rounds += 1
                yield committed
        finally:
            await self.release(req)

    def wire_bytes(self) -> int:
        return sum(c.wire_bytes for c in (*self.drafts.values(), *self.targets.values()))

    @property
    def mean_target_batch(self) -> float:
        """Mean requests per target forward pass, over the verify calls this pipeline made."""
        return self.verify_calls / self.inverse_batch_rows if self.inverse_batch_rows else 0.0

    async def release(self, req: SchedRequest) -> None:
        for worker in self.scheduler.finish(req):
            client = self.drafts.get(worker) or self.targets.get(worker)
            with contextlib.suppress(Exception):  # best effort: a dead worker holds nothing anyway
                await client.release(req.request_id)

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, spec: SpecParams, eos: frozenset[int]
    ) -> SchedRequest:
        req = self.scheduler.add(prompt_ids, params, spec, eos)
        async for _ in self.rounds(req):
            pass
        return req


async def _cancel(task: asyncio.Future | None) -> None:
    if task is None:
        return
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, WorkerUnavailable, WorkerLostRequest):
        await task
