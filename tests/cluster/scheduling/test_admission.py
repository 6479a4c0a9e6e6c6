"""A scheduler replica's admission: at most max_active run, the rest queue in arrival order up to max_queued, past that
OverloadedError at once; a waiter that leaves frees its place (and a slot granted as it leaves passes on)."""

import asyncio

import pytest

from specserve.cluster.scheduling.admission import Admission
from specserve.workers.errors import DrainingError, OverloadedError


async def _hold(admission: Admission, name: str, order: list, release: asyncio.Event):
    async with admission.slot(name):
        order.append(name)
        await release.wait()


def test_requests_beyond_the_slots_start_in_arrival_order_and_past_the_queue_are_refused():
    async def main():
        admission, order, release = Admission(max_active=2, max_queued=3), [], asyncio.Event()
        tasks = []
        for i in range(5):
            tasks.append(asyncio.create_task(_hold(admission, f"r{i}", order, release)))
            await asyncio.sleep(0)  # arrival order is creation order
        await asyncio.sleep(0.01)
        assert order == ["r0", "r1"] and admission.running == 2 and admission.queued == 3
        with pytest.raises(OverloadedError, match="2 requests are running and 3 are queued"):
            admission.check("r5")
        assert admission.refused == 1
        release.set()
        await asyncio.gather(*tasks)
        return order, admission

    order, admission = asyncio.run(main())
    assert order == ["r0", "r1", "r2", "r3", "r4"]
    assert admission.running == 0 and admission.queued == 0
    assert len(admission.queue_times) == 5 and max(admission.queue_times) > 0


def test_a_waiter_that_leaves_frees_its_place_and_the_next_one_runs():
    async def main():
        admission, order, release = Admission(max_active=1, max_queued=2), [], asyncio.Event()
        first = asyncio.create_task(_hold(admission, "a", order, release))
        await asyncio.sleep(0)
        leaving = asyncio.create_task(_hold(admission, "b", order, release))
        await asyncio.sleep(0)
        staying = asyncio.create_task(_hold(admission, "c", order, release))
        await asyncio.sleep(0.01)
        assert admission.queued == 2
        leaving.cancel()
        await asyncio.sleep(0.01)
        assert admission.queued == 1  # its place is free: one more may queue
        admission.check("d")
        release.set()
        await asyncio.gather(first, staying)
        return order, admission, leaving

    order, admission, leaving = asyncio.run(main())
    assert leaving.cancelled() and order == ["a", "c"] and admission.running == 0


def test_a_slot_granted_as_its_waiter_leaves_passes_on():
    async def main():
        admission, order = Admission(max_active=1, max_queued=2), []
        async with admission.slot("a"):
            second = asyncio.create_task(_hold(admission, "b", order, asyncio.Event()))
            await asyncio.sleep(0)
            third = asyncio.create_task(_hold(admission, "c", order, asyncio.Event()))
            await asyncio.sleep(0.01)
        second.cancel()  # granted its slot as "a" left, it leaves before it runs: "c" gets the slot
        await asyncio.sleep(0.01)
        assert second.cancelled() and order == ["c"] and admission.running == 1 and admission.queued == 0
        third.cancel()
        await asyncio.gather(third, return_exceptions=True)
        return admission

    assert asyncio.run(main()).running == 0


def test_a_draining_replica_admits_nothing_new():
    admission = Admission(max_active=4, max_queued=4)
    admission.draining = True
    with pytest.raises(DrainingError):
        admission.check("x")
