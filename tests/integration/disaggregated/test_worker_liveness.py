"""A slow call is not a dead worker, and a worker that recovers rejoins (real gRPC workers in this process; the
SIGSTOP / SIGCONT of a served worker process is tests/integration/served/test_liveness.py): a call that outlasts the
client's `timeout_s` on a worker whose health check answers is waited for; a worker that went away is marked
unhealthy, probed, and rejoins when it answers again, with the requests that waited for it going on. Every output
stays identical to target-only decoding."""

import asyncio
import time

import pytest

from specserve.workers.config.request import SamplingParams, SpecParams
from specserve.workers.service.assembly import start_worker_server
from specserve.workers.speculation.engine import SpecEngine
from tests.helpers.pipelines import run_pipeline
from tests.helpers.workers import LocalWorkers, load_pair

PROMPTS = ["def add(a, b):\n    return", "class Stack:\n    def push(self, x):", "for i in range(3):"]
N = 24


@pytest.fixture(scope="module")
def models(models_dir, tiny_target, device):
    return load_pair(tiny_target, models_dir, device, "liveness_draft")


@pytest.fixture(scope="module")
def reference(models):
    engine = SpecEngine(models[0])
    return [engine.generate(p, SamplingParams(max_new_tokens=N), SpecParams(method="none")).token_ids for p in PROMPTS]


def _greedy():
    return SamplingParams(max_new_tokens=N), SpecParams(method="draft", k=3)


def _slow_first_batch(worker, seconds: float) -> list:
    """The worker's first verify batch takes `seconds` longer, on its model thread (the event loop, which answers
    health checks, stays free); returns the list its slow batches are recorded in."""
    verify_batch, slowed = worker.verify_batch, []

    def slow(calls):
        if not slowed:
            slowed.append(len(calls))
            time.sleep(seconds)
        return verify_batch(calls)

    worker.verify_batch = slow
    return slowed


def test_a_call_longer_than_the_timeout_on_a_live_worker_is_waited_for(models, reference):
    async def main():
        async with LocalWorkers(models[0], [models[1]]) as w:
            slowed = _slow_first_batch(w.targets["target-0"], 1.5)  # 2.5 timeouts, probed 7 times
            results, pipeline = await run_pipeline(w, [(p, *_greedy()) for p in PROMPTS], timeout_s=0.6)
            return results, pipeline, slowed

    results, pipeline, slowed = asyncio.run(main())
    assert slowed and [r.state.generated for r in results] == reference
    assert not pipeline.scheduler.unhealthy and pipeline.faults.failures == 0
    assert pipeline.targets["target-0"].slow_calls >= 1


def test_a_target_that_went_away_rejoins_at_its_address_and_the_waiting_requests_go_on(models, reference):
    """The only target worker's server stops mid-request: it is marked unhealthy and its requests wait; the server
    comes back at the same address: the probe finds it, it rejoins (told nothing: the requests re-send their
    prefixes) and every request finishes with target-only decoding's tokens."""
    seen = {}

    async def main():
        async with LocalWorkers(models[0], [models[1]]) as w:
            address = w.target_addresses["target-0"]

            async def outage(pipeline):
                while sum(len(r.state.generated) for r in pipeline.scheduler.requests.values()) < 6:
                    await asyncio.sleep(0.005)
                await w.stop("target-0")
                while "target-0" not in pipeline.scheduler.unhealthy:
                    await asyncio.sleep(0.01)
                seen["unhealthy_with_requests"] = len(pipeline.scheduler.requests)
                await asyncio.sleep(0.5)
                worker = w.built["target-0"].worker
                verify_batch, seen["whole"] = worker.verify_batch, set()

                def recorded(calls):  # the requests whose calls bring their whole sequence
                    seen["whole"].update(c.request_id for c in calls if len(c.new_tokens) == c.committed_len)
                    return verify_batch(calls)

                worker.verify_batch = recorded
                w.servers["target-0"], _ = await start_worker_server(w.built["target-0"], address)

            return await run_pipeline(w, [(p, *_greedy()) for p in PROMPTS], during=outage, timeout_s=2.0,
                                      worker_wait_s=30)  # fmt: skip

    results, pipeline = asyncio.run(main())
    assert [r.state.generated for r in results] == reference
    assert seen["unhealthy_with_requests"] >= 1  # requests were waiting while it was out
    assert pipeline.faults.failures == 1 and pipeline.faults.rejoins == 1 and not pipeline.scheduler.unhealthy
    assert len(seen["whole"]) == seen["unhealthy_with_requests"]  # told nothing: each waiting request re-sent it


def test_a_request_whose_target_never_comes_back_fails_after_worker_wait_s(models):
    from specserve.cluster.scheduling.scheduler import NoTargetWorker

    async def main():
        async with LocalWorkers(models[0], [models[1]]) as w:

            async def outage(pipeline):
                while not any(r.state.generated for r in pipeline.scheduler.requests.values()):
                    await asyncio.sleep(0.005)
                await w.stop("target-0")

            start = time.monotonic()
            with pytest.raises(NoTargetWorker, match="no healthy target worker came back within 1 s"):
                await run_pipeline(w, [(PROMPTS[0], *_greedy())], during=outage, timeout_s=2.0, worker_wait_s=1.0)
            return time.monotonic() - start

    assert asyncio.run(main()) < 10
