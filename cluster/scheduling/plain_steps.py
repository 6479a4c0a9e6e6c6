"""Plain rounds run by a request's target worker back to back in one streaming call (`TargetClient.decode`, vLLM
V0's num_scheduler_steps): a request that never drafts, or a head's trees backed off for plain rounds
(`Scheduler.plain_steps`). The worker queues each next step before it writes a step's reply, so the reply's trip to
the scheduler and the scheduler's bookkeeping overlap the next forward instead of sitting between forwards. Each
step's reply is applied as a round of its own, exactly as a one-step call's would be, and each next round is planned
as ever: where it drafts (a lookup's continuation matched, the backoff ended), the stream ends there and that round
runs as its own calls. A step the worker ran past the stream's end is overwritten by the next call (its
committed_len says where the request stands).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable

from specserve.cluster.scheduling.faults import WorkerFaults
from specserve.cluster.scheduling.round_times import RoundClock
from specserve.cluster.scheduling.sched_request import SchedRequest
from specserve.cluster.scheduling.scheduler import Scheduler
from specserve.cluster.scheduling.worker_clients import WorkerFull, WorkerLostRequest, WorkerUnavailable
from specserve.workers.service.results import VerifyResult
from specserve.workers.speculation.planner.round_plan import RoundPlan

# The pipeline's one-round verify (its re-sends and preemption): (request, k, drafted, draft_probs, clock) -> reply
VerifyRound = Callable[[SchedRequest, int, list[int], bytes, RoundClock], Awaitable[tuple[VerifyResult | None, object]]]


class PlainSteps:
    def __init__(self, scheduler: Scheduler, faults: WorkerFaults, verify_round: VerifyRound,
                 verified: Callable[[VerifyResult, RoundClock], None]):  # fmt: skip
        """verify_round: where a stream cannot go on, the round as one call; verified: a reply's accounting."""
        self.scheduler, self.faults = scheduler, faults
        self._verify_round, self._verified = verify_round, verified

    async def rounds(self, req: SchedRequest, plan: RoundPlan, steps: int,
                     clock: RoundClock) -> AsyncIterator[tuple[list[int], RoundClock]]:  # fmt: skip
        """Up to `steps` rounds (`Scheduler.plain_steps`) from the planned one: each round's committed tokens and its
        clock. Where the worker lost the request or is full, the round falls back to a verify call (its re-sends and
        preemption); where it failed, the round is re-planned by the caller. Closing the iterator ends the call."""
        call = self.scheduler.plan_verify(req, [], b"")
        client = self.faults.targets[call.worker]
        async with contextlib.aclosing(client.decode(call, req.params, steps, req.state.eos_token_ids)) as replies:
            for step in range(steps):
                with clock.waiting("verify"):
                    try:
                        reply = await anext(replies, None)
                    except WorkerUnavailable as e:
                        await self.faults.failed(call.worker, client, e)
                        if self.scheduler.stranded(req):
                            await self.faults.await_target(req)
                        return
                    except (WorkerLostRequest, WorkerFull):
                        reply = None
                if reply is None:  # not a step the worker ran: this round as one call, the next ones planned anew
                    reply, _ = await self._verify_round(req, 0, [], b"", clock)
                    if reply is not None:
                        yield self.scheduler.apply_round(req, plan, reply, round_s=clock.verified(0, 0)), clock
                    return
                if step:  # the worker's own call for this step: the previous step's token fed
                    self.scheduler.plan_verify(req, [], b"")
                self._verified(reply, clock)
                yield self.scheduler.apply_round(req, plan, reply, round_s=clock.verified(0, 0)), clock
                if req.state.finished:
                    return
                clock = RoundClock()
                plan = self.scheduler.plan_round(req)
                if plan.k or plan.drafted:  # a lookup's round, or the head's tree again: the caller plans it anew
                    return
                clock.planned(plan.k, plan.expected, plan.forecast_s)
