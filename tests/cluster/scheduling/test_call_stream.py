"""A round's calls multiplexed on one gRPC stream per worker (cluster/scheduling/call_stream.py, the servicers'
Proposes / Verifies), against real workers: replies matched to their calls, a call's error its own, a caller that
stops waiting, a worker that goes away and comes back, the call bound, the secret. Whole generations over the streams
are tests/cluster/scheduling/test_pipeline.py's."""

import asyncio
import contextlib
import time

import grpc
import pytest

from specserve.cluster.scheduling.calls import Call
from specserve.cluster.scheduling.worker_clients import (
    DraftClient,
    TargetClient,
    WorkerLostRequest,
    WorkerUnavailable,
    _verify_request,
)
from specserve.workers.config.request import SamplingParams
from specserve.workers.errors import InvalidRequestError
from specserve.workers.service.assembly import start_worker_server
from tests.helpers.workers import LocalWorkers, load_pair

GREEDY = SamplingParams(max_new_tokens=8)
PROMPTS = [[5, 6, 7, 8], [40, 41, 42], [100, 3, 100, 3, 100], [9, 9]]


@pytest.fixture(scope="module")
def models(models_dir, tiny_target, device):
    return load_pair(tiny_target, models_dir, device, "call_stream_draft")


def _streams_opened(servicer, method: str) -> list:
    """Counts the streams `servicer` serves on `method` (patched before its server starts)."""
    opened, serve = [], getattr(servicer, method)

    async def counted(requests, context):
        opened.append(time.perf_counter())
        await serve(requests, context)

    setattr(servicer, method, counted)
    return opened


def _slow_batches(worker, method: str, seconds: float) -> None:
    """Every batch of the worker's model thread takes `seconds` longer (its event loop stays free)."""
    run = getattr(worker, method)

    def slow(calls):
        time.sleep(seconds)
        return run(calls)

    setattr(worker, method, slow)


@contextlib.asynccontextmanager
async def _slow_target(models, seconds: float = 0.2):
    """(a client of the target, the call streams opened on it so far, the workers): local workers whose target
    verifies each batch `seconds` slower."""
    w = LocalWorkers(models[0], [models[1]])
    opened = _streams_opened(w.servicers["target-0"], "Verifies")
    _slow_batches(w.targets["target-0"], "verify_batch", seconds)
    async with w:
        yield TargetClient(w.target_addresses["target-0"]), opened, w


def _prefill(request_id: str, prompt: list[int]) -> Call:
    return Call("target-0", request_id, len(prompt), prompt)


def test_calls_in_flight_together_share_one_stream_and_each_gets_its_own_reply(models):
    async def main():
        w = LocalWorkers(models[0], [models[1]], n_targets=2)
        opened = _streams_opened(w.servicers["target-0"], "Verifies")
        async with w:
            streamed = TargetClient(w.target_addresses["target-0"])
            unary = TargetClient(w.target_addresses["target-1"], multiplexed=False)
            calls = [_prefill(f"r{i}", p) for i, p in enumerate(PROMPTS)]
            got = await asyncio.gather(*(streamed.verify(c, GREEDY) for c in calls))
            want = [await unary.verify(c, GREEDY) for c in calls]
            # each request's next round on the same stream, again all at once
            nxt = [Call("target-0", c.request_id, c.committed_len + 1, [r.next_token], drafted=[5, 6])
                   for c, r in zip(calls, want, strict=True)]  # fmt: skip
            got_next = await asyncio.gather(*(streamed.verify(c, GREEDY) for c in nxt))
            want_next = [await unary.verify(c, GREEDY) for c in nxt]
            await streamed.close()
            await unary.close()
            return got, want, got_next, want_next, len(opened), streamed.wire_bytes

    got, want, got_next, want_next, streams, wire_bytes = asyncio.run(main())
    assert [r.next_token for r in got] == [r.next_token for r in want]
    assert len({r.next_token for r in want}) > 1  # the prompts' replies differ: a mix-up would show
    assert [(r.accepted, r.next_token) for r in got_next] == [(r.accepted, r.next_token) for r in want_next]
    assert streams == 1 and wire_bytes > 0


def test_a_calls_error_is_its_own_and_the_stream_goes_on(models):
    async def main():
        w = LocalWorkers(models[0], [models[1]])
        opened = _streams_opened(w.servicers["draft-0"], "Proposes")
        async with w:
            client = DraftClient(w.draft_addresses["draft-0"])
            ok = await client.propose(Call("draft-0", "a", 3, [5, 6, 7], k=2), GREEDY)
            errors = []
            for call in (Call("draft-0", "a", 3, [], k=99), Call("draft-0", "b", 9, [5], k=2)):
                try:
                    await client.propose(call, GREEDY)
                except (InvalidRequestError, WorkerLostRequest) as e:
                    errors.append(e)
            again = await client.propose(Call("draft-0", "a", 4, [ok.drafted[0]], k=2), GREEDY)
            await client.close()
            return ok, errors, again, len(opened)

    ok, errors, again, streams = asyncio.run(main())
    assert len(ok.drafted) == 2 and len(again.drafted) == 2
    assert isinstance(errors[0], InvalidRequestError) and errors[0].field == "k"
    assert isinstance(errors[1], WorkerLostRequest) and "re-send" in str(errors[1])
    assert streams == 1


def test_a_caller_that_stops_waiting_leaves_the_other_calls_and_the_stream(models):
    """The caller's task is cancelled mid-call (its client went away): the others on the stream are answered, the
    stream stays open, and the dropped call still ran at the worker (what its scheduler told the worker holds)."""

    async def main():
        async with _slow_target(models) as (client, opened, w):
            dropped = asyncio.ensure_future(client.verify(_prefill("gone", PROMPTS[0]), GREEDY))
            kept = asyncio.ensure_future(client.verify(_prefill("kept", PROMPTS[1]), GREEDY))
            await asyncio.sleep(0.05)
            dropped.cancel()
            reply = await kept
            later = await client.verify(_prefill("later", PROMPTS[2]), GREEDY)
            await asyncio.sleep(0.3)  # the dropped call's batch is done by now
            held = w.targets["target-0"].health()["requests"]
            await client.close()
            return dropped.cancelled(), reply, later, len(opened), held

    cancelled, reply, later, streams, held = asyncio.run(main())
    assert cancelled and reply.accepted == 0 and later.accepted == 0
    assert streams == 1
    assert held == 3  # "gone" too: its call ran


def test_calls_in_flight_fail_when_the_worker_goes_away_and_the_next_call_opens_a_new_stream(models):
    async def main():
        w = LocalWorkers(models[0], [models[1]])
        opened = _streams_opened(w.servicers["target-0"], "Verifies")
        _slow_batches(w.targets["target-0"], "verify_batch", 0.3)
        async with w:
            address = w.target_addresses["target-0"]
            client = TargetClient(address, timeout_s=2.0)
            in_flight = [asyncio.ensure_future(client.verify(_prefill(f"r{i}", p), GREEDY))
                         for i, p in enumerate(PROMPTS[:2])]  # fmt: skip
            await asyncio.sleep(0.1)
            await w.stop("target-0")
            failed = await asyncio.gather(*in_flight, return_exceptions=True)
            w.servers["target-0"], _ = await start_worker_server(w.built["target-0"], address)
            after = await client.verify(_prefill("after", PROMPTS[3]), GREEDY)
            await client.close()
            return failed, after, len(opened)

    failed, after, streams = asyncio.run(main())
    assert all(isinstance(e, WorkerUnavailable) for e in failed), failed
    assert after.accepted == 0 and streams == 2


def test_closing_a_calls_stream_leaves_a_stream_opened_since(models):
    """A caller that finds the worker down closes the stream that carried its call: if another caller has opened a
    new stream meanwhile (the old one had ended), that one and its calls go on."""

    async def main():
        async with _slow_target(models) as (client, opened, _):
            old = client.calls.call(_verify_request(_prefill("old", PROMPTS[0]), GREEDY))
            await asyncio.sleep(0.05)
            await client.calls.close()  # the old stream ends under its call
            new = client.calls.call(_verify_request(_prefill("new", PROMPTS[1]), GREEDY))
            await client.calls.close(carrying=old)  # the old call's caller, late: its stream is gone already
            failed, answered = await asyncio.gather(old, new, return_exceptions=True)
            await client.close()
            return failed, answered, len(opened)

    failed, answered, streams = asyncio.run(main())
    assert isinstance(failed, Exception) and answered.next_token >= 0 and streams == 2


def test_a_stream_closed_as_soon_as_opened_fails_its_calls(models):
    """Closed before its reader first ran, a stream still fails the calls it carries: none is left waiting."""

    async def main():
        w = LocalWorkers(models[0], [models[1]])
        async with w:
            client = TargetClient(w.target_addresses["target-0"])
            reply = client.calls.call(_verify_request(_prefill("r", PROMPTS[0]), GREEDY))
            await client.calls.close()
            outcome = await asyncio.wait_for(asyncio.gather(reply, return_exceptions=True), 5.0)
            await client.close()
            return outcome[0]

    failed = asyncio.run(main())
    assert isinstance(failed, grpc.aio.AioRpcError) and failed.code() == grpc.StatusCode.UNAVAILABLE


def test_a_call_is_bounded_by_max_call_s_while_its_worker_answers(models):
    async def main():
        w = LocalWorkers(models[0], [models[1]])
        _slow_batches(w.targets["target-0"], "verify_batch", 1.5)
        async with w:
            client = TargetClient(w.target_addresses["target-0"], timeout_s=0.3, max_call_s=0.4)
            start = time.perf_counter()
            try:
                await client.verify(_prefill("slow", PROMPTS[0]), GREEDY)
                error = None
            except WorkerUnavailable as e:
                error = e
            waited = time.perf_counter() - start
            await client.close()
            return error, waited, client.slow_calls

    error, waited, slow_calls = asyncio.run(main())
    assert error is not None and "max_call_s" in str(error)
    assert 0.4 <= waited < 1.2 and slow_calls == 1  # its health check answered: slow, not down, until the bound


def test_a_stream_without_the_workers_secret_is_refused(models):
    async def main():
        w = LocalWorkers(models[0], [models[1]])
        server, port = await start_worker_server(w.built["target-0"], "127.0.0.1:0", secret="s3cret")
        try:
            refused = []
            for secret in (None, "wrong"):
                client = TargetClient(f"127.0.0.1:{port}", secret=secret)
                try:
                    await client.verify(_prefill("a", PROMPTS[0]), GREEDY)
                except WorkerUnavailable as e:
                    refused.append(str(e))
                await client.close()
            client = TargetClient(f"127.0.0.1:{port}", secret="s3cret")
            ok = await client.verify(_prefill("a", PROMPTS[0]), GREEDY)
            await client.close()
            return refused, ok
        finally:
            await server.stop(None)
            for servicer in w.servicers.values():
                servicer.close()

    refused, ok = asyncio.run(main())
    assert len(refused) == 2 and all("UNAUTHENTICATED" in e for e in refused), refused
    assert ok.accepted == 0
