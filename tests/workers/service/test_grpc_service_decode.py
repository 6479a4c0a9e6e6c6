"""The target worker's Decode stream (plain steps back to back in one call) behind a real gRPC server: its steps are
the steps of unary Verify calls, it ends at an end token or its step count, a caller that goes away stops it, and a
bad call gets a status code naming the field."""

import asyncio

import grpc
import pytest

from specserve.protos import specserve_pb2 as pb
from specserve.protos import specserve_pb2_grpc as pb_grpc
from tests.helpers.workers import LocalWorkers

PROMPT = [5, 6, 7, 8, 9]


def on_target(models, body):
    async def main():
        async with LocalWorkers(models[0], [models[1]]) as w:
            async with grpc.aio.insecure_channel(w.target_addresses["target-0"]) as channel:
                return await body(pb_grpc.TargetWorkerStub(channel))

    return asyncio.run(main())


async def unary_steps(stub, rid: str, steps: int) -> list[int]:
    """`steps` plain steps as one Verify call each: the tokens they sample."""
    tokens = list(PROMPT)
    reply = await stub.Verify(
        pb.VerifyRequest(request_id=rid, committed_len=len(tokens), new_tokens=tokens), timeout=10
    )
    out = [reply.next_token]
    for _ in range(steps - 1):
        tokens.append(out[-1])
        call = pb.VerifyRequest(request_id=rid, committed_len=len(tokens), new_tokens=[out[-1]])
        out.append((await stub.Verify(call, timeout=10)).next_token)
    return out


def decode_request(rid: str, steps: int, ends=(), **first) -> pb.DecodeRequest:
    first = {"request_id": rid, "committed_len": len(PROMPT), "new_tokens": PROMPT} | first
    return pb.DecodeRequest(first=pb.VerifyRequest(**first), steps=steps, end_token_ids=list(ends))


def test_a_decode_streams_the_tokens_of_one_verify_call_a_step_and_ends_at_an_end_token(models):
    async def body(stub):
        unary = await unary_steps(stub, "unary", 12)
        streamed = [r async for r in stub.Decode(decode_request("streamed", 12), timeout=30)]
        ended = [r.next_token async for r in stub.Decode(decode_request("ended", 12, ends=[unary[3]]), timeout=30)]
        return unary, streamed, ended

    unary, streamed, ended = on_target(models, body)
    assert [r.next_token for r in streamed] == unary
    assert all(r.accepted == 0 and r.bonus and r.batch_rows >= 1 for r in streamed)
    assert ended == unary[: unary.index(unary[3]) + 1]  # the step that sampled an end token is the last


def test_a_decode_whose_caller_goes_away_runs_no_more_steps(models):
    async def body(stub):
        stream = stub.Decode(decode_request("gone", 200), timeout=60)
        first = await stream.read()
        stream.cancel()
        await asyncio.sleep(0.5)  # time for steps that would still run
        health = await stub.Health(pb.HealthRequest(), timeout=10)
        again = await stub.Verify(pb.VerifyRequest(request_id="other", committed_len=2, new_tokens=[5, 6]), timeout=10)
        return first, health, again

    first, health, again = on_target(models, body)
    assert first.bonus
    # the prompt, the first step's token and at most the step queued when the caller went away
    assert len(PROMPT) + 1 <= health.kv_used_tokens <= len(PROMPT) + 2
    assert health.healthy and again.bonus


@pytest.mark.parametrize(
    "steps, first, status, text",
    [
        (0, {}, grpc.StatusCode.INVALID_ARGUMENT, "steps"),
        (4, {"drafted": [7]}, grpc.StatusCode.INVALID_ARGUMENT, "first.drafted"),
        (4, {"request_id": ""}, grpc.StatusCode.INVALID_ARGUMENT, "request_id"),
        (4, {"committed_len": 9, "new_tokens": [5]}, grpc.StatusCode.NOT_FOUND, "re-send"),
    ],
)  # fmt: skip
def test_a_bad_decode_gets_a_status_code_naming_its_field(models, steps, first, status, text):
    async def body(stub):
        try:
            async for _ in stub.Decode(decode_request("bad", steps, **first), timeout=10):
                pass
        except grpc.aio.AioRpcError as e:
            return e
        return None

    error = on_target(models, body)
    assert error is not None and error.code() == status, error
    assert text in error.details()


def test_a_request_goes_on_with_a_drafted_round_after_its_stream_is_closed_early(models):
    """The scheduler ends a stream where its next round drafts (a lookup matched): the step the worker had queued
    may have run, and the next call (committed_len, the last token, the drafts) says where the request stands."""

    async def body(stub):
        unary = await unary_steps(stub, "unary", 8)
        stream = stub.Decode(decode_request("closed", 8), timeout=30)
        taken = [(await stream.read()).next_token for _ in range(3)]
        stream.cancel()
        await asyncio.sleep(0.2)  # the step queued when it closed: run or dropped
        call = pb.VerifyRequest(request_id="closed", committed_len=len(PROMPT) + 3, new_tokens=[taken[-1]],
                                drafted=unary[3:6])  # fmt: skip
        return unary, taken, await stub.Verify(call, timeout=10)

    unary, taken, verified = on_target(models, body)
    assert taken == unary[:3]
    assert verified.accepted == 3 and verified.bonus and verified.next_token == unary[6]
