"""What the goodput planner weighs, as the workers report it: a target worker's verify cost surface and a draft
worker's drafting cost (`Health(want_costs)`), plus the draft call's round trip, timed here."""

from __future__ import annotations

import time

from specserve.cluster.scheduling.worker_clients import DraftClient, TargetClient
from specserve.protos import specserve_pb2 as pb
from specserve.workers.speculation.planner.costs import DraftCost, PlannerCosts, VerifySurface, VerifyTimings


def verify_surface(reply: pb.HealthResponse) -> VerifySurface | None:
    """A target worker's Health(want_costs) reply as a verify cost surface (None when it reported none)."""
    single = tuple(reply.verify_seconds_by_width)
    if not single:
        return None
    rows, flat = list(reply.verify_profile_rows), list(reply.verify_seconds_by_rows)
    width = len(flat) // len(rows) if rows else 0
    batched = [tuple(flat[i * width : (i + 1) * width]) for i in range(len(rows))]
    return VerifySurface((1, *rows), (single, *batched))


async def measured_costs(target: TargetClient, draft: DraftClient | None) -> PlannerCosts | None:
    """Ask the target worker, then the draft worker (one after the other: on one host, measuring both at once would
    time each under the other's load). None when the target reported no costs. Raises the clients' errors."""
    surface = verify_surface(await target.health(want_costs=True))
    if surface is None:
        return None
    drafter = DraftCost()
    if draft is not None:
        reply = await draft.health(want_costs=True)
        trips = []
        for _ in range(3):
            t0 = time.perf_counter()
            await draft.health()
            trips.append(time.perf_counter() - t0)
        if reply.draft_step_seconds > 0:
            drafter = DraftCost(reply.draft_step_seconds, reply.draft_fixed_seconds + min(trips))
    return PlannerCosts(VerifyTimings(surface), head=drafter, draft=drafter)  # a model's drafts are one kind
