"""Executes the scheduler's plans over gRPC, pipelined two ways:

1. across requests: every request runs its own rounds concurrently, so while the target verifies request A the draft
   worker drafts for request B (each worker serialises its own model work; the overlap is between workers);
2. within a request (PEARL-style): while the target verifies round r, the draft worker already drafts round r + 1
   assuming all of round r is accepted; the pre-draft is used when that held, dropped otherwise. Not for an EAGLE-3
   head (methods "eagle", "eagle+ngram"), which drafts round r + 1 from round r's features: each verify reply
   carries them, and the next propose call hands them to the request's draft worker.

Each round is the scheduler's plan (`plan_round`: a RoundPlan), carried out here and handed back (`apply_round`):
prompt lookup's and suffix drafting's chains and prompt lookup's trees come drafted with the plan (no draft call;
a head gets those rounds' features with its next call); a head's or a draft model's are the draft worker's, a head's
tree pruned by the scheduler once drafted; a tree is verified in one forward, whose reply names the accepted path.

Faults: a worker that lost a request's cache (NOT_FOUND) gets the whole committed prefix again; a worker that cannot
be reached, or does not answer its health check while a call waits (a slow call of a live worker is waited for), is
marked unhealthy and its requests move to another worker (a draft failure falls back to target-only decoding until
another draft worker is available); it rejoins when its health check answers again (faults.py). A head's draft
worker that lost a request starts its cache again from the features it is handed (older positions are gone: drafts
may be worse for a while). Outputs never change.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import grpc

from specserve.cluster.scheduling.calls import Call, PreDraft
from specserve.cluster.scheduling.costs import measured_costs
from specserve.cluster.scheduling.faults import WorkerFaults
from specserve.cluster.scheduling.plain_steps import PlainSteps
from specserve.cluster.scheduling.prefill import Prefill
from specserve.cluster.scheduling.round_times import RoundClock, RoundTimes
from specserve.cluster.scheduling.sched_request import SchedRequest
from specserve.cluster.scheduling.scheduler import FALLBACK_K, Scheduler
from specserve.cluster.scheduling.worker_clients import (
    DraftClient,
    TargetClient,
    WorkerFull,
    WorkerLostRequest,
    WorkerUnavailable,
)
from specserve.workers.config.request import SamplingParams, SpecParams
from specserve.workers.config.settings import NgramConfig
from specserve.workers.errors import KVCapacityError
from specserve.workers.service.results import ProposeResult, VerifyResult
from specserve.workers.speculation.planner.round_plan import RoundPlan

log = logging.getLogger(__name__)


class Pipeline:
    """Runs one model's requests: the scheduler's plans, executed against its workers' gRPC clients."""

    def __init__(
        self,
        scheduler: Scheduler,
        drafts: dict[str, DraftClient],
        targets: dict[str, TargetClient],
        predraft: bool = True,
        reconnect: Callable[[str], Awaitable[str | None]] | None = None,
        worker_wait_s: float = 600.0,
    ):
        """reconnect(worker) -> the address of the worker's restarted replacement, or None when it has none;
        worker_wait_s: how long a request whose target failed waits for a healthy one."""
        self.scheduler = scheduler
        # Each call reports its batch's size, so a batch of n is reported n times: calls / sum(1/n) = batches' mean.
        self.verify_calls, self.inverse_batch_rows = 0, 0.0
        self.drafts = drafts
        self.targets = targets
        self.predraft = predraft
        self.faults = WorkerFaults(scheduler, drafts, targets, reconnect, worker_wait_s)
        self.preempted = 0  # requests a full worker cache made wait and re-send
        self.times = RoundTimes()
        self._releasing: set[asyncio.Task] = set()  # releases sent after the request's reply left
        self._costs_lock = asyncio.Lock()
        # One prompt's chunks in flight per target worker, as vLLM's step budget lets one chunk's tokens of prefill
        # into a step however many prompts wait: the other requests' rounds get the worker between chunks.
        self._chunking: dict[str, asyncio.Lock] = collections.defaultdict(asyncio.Lock)
        self.prefill = Prefill(scheduler, self.faults, self._verify, self._propose, self._chunking)
        self.plain = PlainSteps(scheduler, self.faults, self._verify_round, self._verified)
        self._costs_failed = False  # a worker could not report its costs: AdaptiveK stays in charge

    async def _call(self, req: SchedRequest, call: Call, fn, resends: int = 3):
        """A call; when the worker lost the request (restarted, or evicted it for room), the same call with the whole
        sequence, again if a full cache evicted the re-sent request too (a few times, then the error stands). When
        the worker's cache cannot hold it beside the requests running there, the request is preempted: what it holds
        there is released, it waits (backing off to a second) while they finish, and is re-sent whole, for up to
        `worker_wait_s`; then KVCapacityError (429, retry), never a lost request."""
        waited, pause = 0.0, 0.05
        while True:
            try:
                return await fn(call)
            except WorkerLostRequest as e:
                if resends == 0:
                    raise
                resends -= 1
                log.info("worker %s lost request %s (%s): re-sending its %d tokens", call.worker, req.request_id, e,
                         len(call.sequence))  # fmt: skip
            except WorkerFull as e:
                if call.worker in self.drafts:
                    raise  # a full draft worker: this round runs target-only
                if waited >= self.faults.worker_wait_s:
                    raise KVCapacityError(f"no KV cache room for request {req.request_id} in "
                                          f"{self.faults.worker_wait_s:.0f} s: {e}") from None  # fmt: skip
                if waited == 0:
                    log.info("worker %s is full (%s): request %s is preempted, waits and re-sends its %d tokens",
                             call.worker, e, req.request_id, len(call.sequence))  # fmt: skip
                    self.preempted += 1
                await self._release_one(req.request_id, call.worker)
                await asyncio.sleep(pause)
                waited, pause = waited + pause, min(1.0, 2 * pause)
            call = self.scheduler.resend(req, call)

    async def _propose(self, req: SchedRequest, call: Call) -> ProposeResult:
        return await self._call(req, call, lambda c: self.drafts[c.worker].propose(c, req.params))

    async def _verify(self, req: SchedRequest, call: Call) -> VerifyResult:
        return await self._call(req, call, lambda c: self.targets[c.worker].verify(c, req.params))

    async def rounds(self, req: SchedRequest) -> AsyncIterator[list[int]]:
        """Run the request's rounds; yields the tokens each round commits."""
        pre: PreDraft | None = None
        try:
            if self.scheduler.wants_costs(req):
                await self._fetch_costs(req)
            await self.prefill.run(req)
            while not req.state.finished:
                clock = RoundClock()
                plan = self.scheduler.plan_round(req)
                clock.planned(plan.k, plan.expected, plan.forecast_s)
                if (steps := self.scheduler.plain_steps(req, plan)) > 1:
                    async with contextlib.aclosing(self.plain.rounds(req, plan, steps, clock)) as decoded:
                        async for committed, clock in decoded:
                            sent = time.perf_counter()
                            yield committed
                            self.times.add(clock.record(time.perf_counter() - sent))
                    continue
                if req.method.tree:
                    committed = await self._tree_round(req, plan, clock)
                    if committed is not None:  # None: the target failed, the round is re-planned
                        sent = time.perf_counter()
                        yield committed
                        self.times.add(clock.record(time.perf_counter() - sent))
                    continue
                draft = await self._draft(req, plan, pre, clock)
                drafted = draft.drafted
                reply, pre_task = await self._verify_round(req, plan.k, drafted, draft.draft_probs, clock)
                if reply is None:
                    continue  # the round is re-planned on the restarted or another target: nothing was committed
                round_s = clock.verified(len(drafted), reply.accepted)
                committed = self.scheduler.apply_round(req, plan, reply, drafted, round_s=round_s)
                pre = await self._next_predraft(req, pre_task, reply.accepted == len(drafted), clock)
                sent = time.perf_counter()
                yield committed  # the round's tokens on their way to the client, until it asks for the next round's
                self.times.add(clock.record(time.perf_counter() - sent))
        finally:
            self.release_soon(req)

    async def _fetch_costs(self, req: SchedRequest | None = None) -> None:
        """Ask a target worker, then a draft worker if there is one, for their measured costs (costs.py), once per
        pipeline. `fetch_costs_soon` asks as soon as the model's workers are there, so that the first request is
        planned right; a request with k='auto' that comes earlier waits for them."""
        async with self._costs_lock:
            targets = [req.target_worker] if req is not None else self.scheduler.healthy("target")
            target = next((self.targets[w] for w in targets if w in self.targets), None)
            drafts = self.scheduler.healthy("draft")
            draft = self.drafts.get(drafts[0]) if drafts else None
            if self.scheduler.planner_costs is not None or self._costs_failed or target is None:
                return
            try:
                costs = await measured_costs(target, draft)
            except (WorkerUnavailable, grpc.aio.AioRpcError) as e:
                log.warning("k='auto' drafts k=%d: a worker did not report its costs (%s)", FALLBACK_K, e)
                self._costs_failed = True
                return
            if costs is None:
                log.warning("k='auto' drafts k=%d: the target worker reported no costs", FALLBACK_K)
                self._costs_failed = True
                return
            self.scheduler.planner_costs = costs
            surface = costs.verify.profile
            log.info("k='auto' costs: verify %s ms by width (1 request), %s ms (%d); drafting %.1f ms a call + %.1f ms "
                     "a drafted token", " ".join(f"{1e3 * t:.1f}" for t in surface.seconds[0][:9]),
                     " ".join(f"{1e3 * t:.1f}" for t in surface.seconds[-1][:9]), surface.rows[-1],
                     1e3 * costs.head.fixed_s, 1e3 * costs.head.step_s)  # fmt: skip

    async def measure_costs(self) -> None:
        """Until the workers' costs are measured (or could not be)."""
        await self._fetch_costs()

    def fetch_costs_soon(self) -> None:
        """Measure the workers' costs in the background (the model's workers have attached)."""
        if self.scheduler.planner_costs is None and not self._costs_failed:
            task = asyncio.get_running_loop().create_task(self._fetch_costs())
            self._releasing.add(task)
            task.add_done_callback(self._releasing.discard)

    async def _draft(self, req: SchedRequest, plan: RoundPlan, pre: PreDraft | None,
                     clock: RoundClock) -> ProposeResult:  # fmt: skip
        """This round's drafted tokens and their probabilities: the pre-draft when its assumption held, else what
        the plan drafted (prompt lookup's or suffix drafting's continuation) or the draft worker's (nothing for a
        plain step, or when the draft worker failed: this round is target-only)."""
        if not plan.k:
            return ProposeResult([])
        reused = req.predrafted(pre, plan.k)
        if reused is not None:
            req.pipelined_rounds += 1
            return reused
        if plan.drafted:
            return ProposeResult(list(plan.chain.tokens))
        call = self.scheduler.plan_draft(req, plan.k)
        client = self.drafts[call.worker]
        with clock.waiting("draft"):
            try:
                proposal = await self._propose(req, call)
            except WorkerUnavailable as e:  # this round: target-only; later: the restarted or another drafter
                await self.faults.failed(call.worker, client, e)
                return ProposeResult([])
            except WorkerFull:
                return ProposeResult([])
        clock.worker("draft", proposal)
        self.scheduler.drafted(req, call)
        return proposal

    async def _tree_round(self, req: SchedRequest, plan: RoundPlan, clock: RoundClock) -> list[int] | None:
        """Verify the round's tree, prompt lookup's (drafted with the plan) or the head's from the draft worker (none
        when the plan has no nodes or the worker failed: a plain step), and commit the accepted path. None when the
        target failed."""
        tree = plan.tree
        if plan.nodes and tree is None:
            call = self.scheduler.plan_draft(req, plan.nodes)
            client = self.drafts[call.worker]
            with clock.waiting("draft"):
                try:
                    proposal = await self._propose(req, call)
                except WorkerUnavailable as e:
                    await self.faults.failed(call.worker, client, e)
                    proposal = None
                except WorkerFull:
                    proposal = None
            if proposal is not None:
                clock.worker("draft", proposal)
                self.scheduler.drafted(req, call)
                tree = self.scheduler.prune_tree(req, proposal.tree())
        tokens, parents = (tree.tokens, tree.parents) if tree is not None else ([], None)
        reply, _ = await self._verify_round(req, 0, tokens, b"", clock, parents)
        if reply is None:
            return None
        round_s = clock.verified(len(tokens), len(reply.path or ()))
        return self.scheduler.apply_round(req, plan, reply, tree=tree, round_s=round_s)

    def _verified(self, reply: VerifyResult, clock: RoundClock) -> None:
        self.scheduler.verified(reply)
        self.verify_calls += 1
        self.inverse_batch_rows += 1.0 / max(1, reply.batch_rows)
        clock.worker("verify", reply)

    async def _verify_round(
        self,
        req: SchedRequest,
        k: int,
        drafted: list[int],
        probs: bytes,
        clock: RoundClock,
        parents: list[int] | None = None,
    ) -> tuple[VerifyResult | None, asyncio.Future | None]:
        """Verify the drafted tokens (with `parents`: a tree), pre-drafting the next round meanwhile (chains). (None,
        None) when the target failed and another (or its restarted replacement) can take the request; NoTargetWorker
        when none can."""
        call = self.scheduler.plan_verify(req, drafted, probs, parents)
        client = self.targets[call.worker]
        verify = asyncio.ensure_future(self._verify(req, call))
        pre_task = None
        if self.predraft and drafted and parents is None:
            pre_call = self.scheduler.plan_predraft(req, drafted, k)
            if pre_call is not None:
                pre_task = asyncio.ensure_future(self._propose(req, pre_call))
        with clock.waiting("verify"):
            try:
                reply = await verify
            except WorkerUnavailable as e:
                await _cancel(pre_task)
                await self.faults.failed(call.worker, client, e)
                if self.scheduler.stranded(req):
                    await self.faults.await_target(req)
                return None, None
        self._verified(reply, clock)
        if call.prompt_logprobs is not None and reply.prompt_logprobs is not None:  # the prompt's tokens 1..P-1's
            req.state.prompt_logprobs = reply.prompt_logprobs[: req.state.prompt_len - 1]
        return reply, pre_task

    async def _next_predraft(
        self, req: SchedRequest, pre_task: asyncio.Future | None, all_accepted: bool, clock: RoundClock
    ) -> PreDraft | None:
        """The pre-draft for the next round when this one accepted every drafted token (else it is dropped)."""
        if pre_task is None:
            return None
        if not all_accepted or req.state.finished:
            await _cancel(pre_task)
            return None
        with clock.waiting("draft"):
            try:
                draft = await pre_task
            except (WorkerUnavailable, WorkerLostRequest, WorkerFull) as e:
                log.debug("pre-draft for request %s failed (%s): the next round drafts afresh", req.request_id, e)
                return None
        return PreDraft(after=req.state.tokens[:-1], draft=draft)

    def wire_bytes(self) -> int:
        return sum(c.wire_bytes for c in (*self.drafts.values(), *self.targets.values()))

    @property
    def mean_target_batch(self) -> float:
        """Mean requests per target forward pass, over the verify calls this pipeline made."""
        return self.verify_calls / self.inverse_batch_rows if self.inverse_batch_rows else 0.0

    def release_soon(self, req: SchedRequest) -> None:
        """The request ended: the scheduler forgets it now; its workers free their state in the background, so the
        reply does not wait for two more worker round trips (`drain_releases` waits for them)."""
        workers = self.scheduler.release(req)
        if workers:
            task = asyncio.get_running_loop().create_task(self._release_on(req.request_id, workers))
            self._releasing.add(task)
            task.add_done_callback(self._releasing.discard)

    async def drain_releases(self) -> None:
        """Wait until every release sent in the background has been answered."""
        while self._releasing:
            await asyncio.wait(list(self._releasing))

    async def _release_on(self, request_id: str, workers: list[str]) -> None:
        await asyncio.gather(*(self._release_one(request_id, worker) for worker in workers))

    async def _release_one(self, request_id: str, worker: str) -> None:
        client = self.drafts.get(worker) or self.targets.get(worker)
        if client is None:
            return  # the worker left its pool: nothing to free there
        try:
            await client.release(request_id)
        except Exception as e:  # noqa: BLE001 - best effort: a dead worker holds nothing anyway
            log.debug("releasing request %s on worker %s failed: %s", request_id, worker, e)

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, spec: SpecParams, eos: frozenset[int]
    ) -> SchedRequest:
        req = self.scheduler.add(prompt_ids, params, spec, eos)
        async for _ in self.rounds(req):
            pass
        return req


async def _cancel(task: asyncio.Future | None) -> None:
    """Cancel a pre-draft no longer wanted, and wait for it: its worker's failure does not matter any more."""
    if task is None:
        return
    task.cancel()
    await asyncio.wait([task])
    error = None if task.cancelled() else task.exception()
    if isinstance(error, WorkerUnavailable | WorkerLostRequest | WorkerFull):
        log.debug("a dropped pre-draft had failed: %s", error)
    elif error is not None:
        raise error


def build_pipeline(
    drafts: dict[str, DraftClient],
    targets: dict[str, TargetClient],
    head: str | None = None,
    predraft: bool = True,
    reconnect: Callable[[str], Awaitable[str | None]] | None = None,
    max_k: int | None = None,
    ngram: NgramConfig | None = None,
    worker_wait_s: float = 600.0,
    prefill_chunk: int | None = None,
    decode_steps: int = 1,
) -> Pipeline:
    """A model's scheduler and pipelined driver over its workers' clients, for every caller (the Serve app's scheduler
    replica, the plain-actor path, the bench). head: the EAGLE-3 head directory the draft workers run, whose recorded
    acceptance is where the planner starts; max_k: the most k='auto' drafts a round; ngram: prompt lookup's sizes."""
    from specserve.workers.speculation.eagle.config import head_acceptance

    prior = head_acceptance(head) if head is not None else None
    scheduler = Scheduler(list(drafts), list(targets), prior, max_k, ngram, prefill_chunk, decode_steps)
    return Pipeline(scheduler, drafts, targets, predraft, reconnect, worker_wait_s)
