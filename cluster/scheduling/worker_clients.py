"""Async gRPC clients of draft and target workers: they execute the scheduler's Calls and turn the KV state
protocol's NOT_FOUND into WorkerLostRequest, so the caller can re-send the whole prefix.

A slow call is not a dead worker. A call's length follows its work (a prompt near the context limit prefills for
minutes on a CPU), so no fixed deadline can tell the two apart. Instead, a call not answered within a third of
`timeout_s` makes the client ask the worker's health check, which the worker answers on its event loop, not behind
the model's work: a worker that answers keeps its calls running; one that does not answer within half of `timeout_s`
(stopped, hung, unreachable) fails them all with WorkerUnavailable, so a dead worker is known within `timeout_s`.
One probe at a time per worker, shared by every waiting call. `max_call_s` bounds a call whatever the probes say
(a model thread that is stuck while its process answers).

A round's calls (Propose, Verify) travel multiplexed on one long-lived stream per worker (call_stream.py), not as
an RPC each: the RPC's setup both ways was about half a millisecond of every hop."""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import AsyncIterator

import grpc

from specserve.cluster.scheduling.call_stream import CallStream
from specserve.cluster.scheduling.calls import Call
from specserve.protos import specserve_pb2 as pb
from specserve.protos import specserve_pb2_grpc as pb_grpc
from specserve.protos.wire import GRPC_OPTIONS, SECRET_METADATA
from specserve.workers.config.request import SamplingParams
from specserve.workers.errors import InvalidRequestError
from specserve.workers.service.results import ProposeResult, VerifyResult
from specserve.workers.service.sampling_wire import sampling_to_proto
from specserve.workers.service.verify_wire import verify_from_proto

MAX_CALL_S = 3600.0  # a call's bound while its worker answers: no forward pass of a served model takes an hour


class WorkerLostRequest(Exception):
    """The worker does not hold (enough of) the request: re-send the committed sequence."""


class WorkerUnavailable(Exception):
    """The worker cannot be reached or failed the call; its requests must move elsewhere."""


class WorkerFull(Exception):
    """The worker's KV cache cannot hold the call's rows now (every other request there is running): the request
    waits and is re-sent whole (preemption by recompute)."""


_LOST = {grpc.StatusCode.NOT_FOUND}
# UNAUTHENTICATED: the worker does not share our secret (a replica of another deployment): not usable either.
_DOWN = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED,
         grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN, grpc.StatusCode.UNAUTHENTICATED}  # fmt: skip


class _Client:
    def __init__(self, address: str, timeout_s: float, secret: str | None = None, max_call_s: float = MAX_CALL_S,
                 multiplexed: bool = True):  # fmt: skip
        """multiplexed: a round's calls on one stream (False: an RPC a call, as a worker before the stream takes)."""
        self.address = address
        self.multiplexed = multiplexed
        self.timeout_s = timeout_s  # within it, a worker that does not answer is known to be down
        self.max_call_s = max(max_call_s, timeout_s)
        self.secret = secret
        self.metadata = ((SECRET_METADATA, secret),) if secret else None
        self.channel = grpc.aio.insecure_channel(address, options=GRPC_OPTIONS)
        self.wire_bytes = 0  # serialized request + response bytes of every call
        self.slow_calls = 0  # calls that outlasted a probe interval while the worker answered its health check
        self._probe: asyncio.Future | None = None

    async def _invoke(self, method, message):
        response = await self._answered(_awaited(method(message, timeout=self.max_call_s, metadata=self.metadata)))
        self.wire_bytes += message.ByteSize() + response.ByteSize()
        return response

    async def _round_call(self, stream: CallStream, method, message):
        """A round's call: on the worker's call stream, bounded by `max_call_s` as a unary call's deadline would; a
        worker found down closes the stream that carried it, failing the calls on it at once."""
        if not self.multiplexed:
            return await self._invoke(method, message)
        reply = stream.call(message)
        try:
            response = await self._answered(reply, bound_s=self.max_call_s)
        except WorkerUnavailable:
            await stream.close(carrying=reply)
            raise
        self.wire_bytes += message.ByteSize() + response.ByteSize()
        return response

    async def _answered(self, awaitable, bound_s: float | None = None):
        """What `awaitable` (a call's reply, a stream's next message) gives, waited for as this module says, its
        status codes as this module's errors; cancelled (the worker told to drop the call) when the wait ends
        otherwise. bound_s: the most it is waited for whatever the probes say (a unary call's own deadline). A future
        is waited for as it is (no task around it: a call stream's reply)."""
        task = asyncio.ensure_future(awaitable)
        deadline = time.monotonic() + bound_s if bound_s is not None else math.inf
        try:
            slow = False
            while not (await asyncio.wait({task}, timeout=min(self.timeout_s / 3, deadline - time.monotonic())))[0]:
                if time.monotonic() >= deadline:
                    raise WorkerUnavailable(f"{self.address}: a call unanswered in {bound_s:.0f} s (max_call_s)")
                if not await self.alive():
                    raise WorkerUnavailable(f"{self.address}: a call unanswered and no answer to its health check "
                                            f"within {self.timeout_s / 2:.1f} s")  # fmt: skip
                if not slow:
                    slow = True
                    self.slow_calls += 1
            return task.result()
        except grpc.aio.AioRpcError as e:
            if e.code() in _LOST:
                raise WorkerLostRequest(e.details()) from None
            if e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                raise WorkerFull(f"{self.address}: {e.details()}") from None
            if e.code() == grpc.StatusCode.INVALID_ARGUMENT:  # the worker's InvalidRequestError: "invalid FIELD: ..."
                field, _, message = e.details().removeprefix("invalid ").partition(": ")
                raise InvalidRequestError(field, message) from None
            if e.code() in _DOWN:
                raise WorkerUnavailable(f"{self.address}: {e.code().name}: {e.details()}") from None
            raise
        finally:
            task.cancel()  # a no-op once answered

    async def alive(self) -> bool:
        """Whether the worker answers its health check, healthy, within half of `timeout_s`. Concurrent askers share
        one probe."""
        if self._probe is None or self._probe.done():
            self._probe = asyncio.ensure_future(self._health_probe())
        return await asyncio.shield(self._probe)

    async def _health_probe(self) -> bool:
        try:
            reply = await self.stub.Health(pb.HealthRequest(), timeout=self.timeout_s / 2, metadata=self.metadata)
        except grpc.aio.AioRpcError:
            return False
        return reply.healthy

    async def release(self, request_id: str) -> bool:
        """The request ended: the worker frees its state (False: it held none)."""
        return (await self._invoke(self.stub.Release, pb.ReleaseRequest(request_id=request_id))).released

    async def health(self, want_costs: bool = False) -> pb.HealthResponse:
        """Liveness and capacity; with want_costs also the worker's measured costs (the first time, the worker measures
        them on its model thread, after the work queued there: a long call of a live worker)."""
        return await self._invoke(self.stub.Health, pb.HealthRequest(want_costs=want_costs))

    def replacement(self, address: str) -> _Client:
        """A client of the same kind and settings for the worker's restarted replacement."""
        return type(self)(address, self.timeout_s, self.secret, self.max_call_s, self.multiplexed)

    async def close(self) -> None:
        await self.calls.close()
        await self.channel.close()


async def _awaited(call):
    return await call


class DraftClient(_Client):
    def __init__(self, address: str, timeout_s: float = 30.0, secret: str | None = None,
                 max_call_s: float = MAX_CALL_S, multiplexed: bool = True):  # fmt: skip
        super().__init__(address, timeout_s, secret, max_call_s, multiplexed)
        self.stub = pb_grpc.DraftWorkerStub(self.channel)
        self.calls = CallStream(lambda: self.stub.Proposes(metadata=self.metadata), pb.ProposeStreamRequest)

    async def propose(self, call: Call, params: SamplingParams) -> ProposeResult:
        """A chain call's drafted tokens and their encoded draft probs, or a tree call's (`call.tree`) tree: its nodes,
        parents and scores (no nodes: the head had no features to draft from)."""
        response = await self._round_call(
            self.calls,
            self.stub.Propose,
            pb.ProposeRequest(
                request_id=call.request_id,
                committed_len=call.committed_len,
                new_tokens=call.new_tokens,
                k=call.k,
                sampling=sampling_to_proto(params),
                features=call.features,
                tree=call.tree,
                prompt_len=params.prompt_len,
                end_token_ids=params.end_token_ids,
            ),
        )
        drafted = list(response.drafted)
        if not call.tree:
            return ProposeResult(drafted, response.draft_probs, response.batch_seconds, response.queued_seconds)
        if len(response.parents) != len(drafted) or len(response.scores) != len(drafted):
            raise WorkerUnavailable(f"{self.address}: a tree reply of {len(drafted)} tokens, "
                                    f"{len(response.parents)} parents, {len(response.scores)} scores")  # fmt: skip
        return ProposeResult(drafted, response.draft_probs, response.batch_seconds, response.queued_seconds,
                             list(response.parents), list(response.scores))  # fmt: skip


class TargetClient(_Client):
    def __init__(self, address: str, timeout_s: float = 30.0, secret: str | None = None,
                 max_call_s: float = MAX_CALL_S, multiplexed: bool = True):  # fmt: skip
        super().__init__(address, timeout_s, secret, max_call_s, multiplexed)
        self.stub = pb_grpc.TargetWorkerStub(self.channel)
        self.calls = CallStream(lambda: self.stub.Verifies(metadata=self.metadata), pb.VerifyStreamRequest)

    async def verify(self, call: Call, params: SamplingParams) -> VerifyResult:
        return verify_from_proto(await self._round_call(self.calls, self.stub.Verify, _verify_request(call, params)))

    async def decode(self, call: Call, params: SamplingParams, steps: int,
                     ends: frozenset[int]) -> AsyncIterator[VerifyResult]:  # fmt: skip
        """Up to `steps` plain decoding steps from `call` (a plain verify call), run by the worker back to back until
        one samples a token of `ends`: each step's result as it comes (pb.DecodeRequest). Closing the iterator cancels
        the steps not yet run."""
        request = pb.DecodeRequest(first=_verify_request(call, params), steps=steps, end_token_ids=sorted(ends))
        stream = self.stub.Decode(request, timeout=self.max_call_s * steps, metadata=self.metadata)  # max_call_s a step
        self.wire_bytes += request.ByteSize()
        try:
            while (response := await self._answered(stream.read())) is not grpc.aio.EOF:
                self.wire_bytes += response.ByteSize()
                yield verify_from_proto(response)
        finally:
            stream.cancel()  # a no-op once the stream ended


def _verify_request(call: Call, params: SamplingParams) -> pb.VerifyRequest:
    return pb.VerifyRequest(
        request_id=call.request_id,
        committed_len=call.committed_len,
        new_tokens=call.new_tokens,
        drafted=call.drafted,
        draft_probs=call.draft_probs,
        sampling=sampling_to_proto(params),
        want_features=call.want_features,
        parents=call.parents or [],
        prompt_len=min(params.prompt_len, call.committed_len),  # a prefill chunk holds part of the prompt
        end_token_ids=params.end_token_ids,
        prompt_logprobs=call.prompt_logprobs,
        prefix_at_most=call.prefix_at_most,
        expected_len=call.expected_len,
    )
