"""Async gRPC clients of draft and target workers: they execute the scheduler's Calls with explicit deadlines and
turn the KV state protocol's NOT_FOUND into WorkerLostRequest, so the caller can re-send the whole prefix."""

from __future__ import annotations

import grpc

from specserve.cluster.scheduling.scheduler import Call
from specserve.protos import specserve_pb2 as pb
from specserve.protos import specserve_pb2_grpc as pb_grpc
from specserve.protos.wire import GRPC_OPTIONS, SECRET_METADATA
from specserve.workers.config import SamplingParams
from specserve.workers.service.results import ProposeResult, VerifyResult
from specserve.workers.service.sampling_wire import sampling_to_proto
from specserve.workers.speculation.logprobs import from_proto

COSTS_TIMEOUT_S = 120.0  # a first cost measurement: a few dozen forward passes, on a busy CPU worker too


class WorkerLostRequest(Exception):
    """The worker does not hold (enough of) the request: re-send the committed sequence."""


class WorkerUnavailable(Exception):
    """The worker cannot be reached or failed the call; its requests must move elsewhere."""


_LOST = {grpc.StatusCode.NOT_FOUND}
# UNAUTHENTICATED: the worker does not share our secret (a replica of another deployment): not usable either.
_DOWN = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED,
         grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN, grpc.StatusCode.UNAUTHENTICATED}  # fmt: skip


class _Client:
    def __init__(self, address: str, timeout_s: float, secret: str | None = None):
        self.address = address
        self.timeout_s = timeout_s
        self.secret = secret
        self.metadata = ((SECRET_METADATA, secret),) if secret else None
        self.channel = grpc.aio.insecure_channel(address, options=GRPC_OPTIONS)
        self.wire_bytes = 0  # serialized request + response bytes of every call

    async def _invoke(self, method, message, timeout_s: float | None = None):
        try:
            response = await method(message, timeout=timeout_s or self.timeout_s, metadata=self.metadata)
            self.wire_bytes += message.ByteSize() + response.ByteSize()
            return response
        except grpc.aio.AioRpcError as e:
            if e.code() in _LOST:
                raise WorkerLostRequest(e.details()) from None
            if e.code() in _DOWN:
                raise WorkerUnavailable(f"{self.address}: {e.code().name}: {e.details()}") from None
            raise

    async def release(self, request_id: str) -> bool:
        """The request ended: the worker frees its state (False: it held none)."""
        return (await self._invoke(self.stub.Release, pb.ReleaseRequest(request_id=request_id))).released

    async def health(self, want_costs: bool = False) -> pb.HealthResponse:
        """Liveness and capacity; with want_costs also the worker's measured costs (the first time, the worker measures
        them after the work queued on it, so the deadline is longer)."""
        if not want_costs:
            return await self._invoke(self.stub.Health, pb.HealthRequest())
        request = pb.HealthRequest(want_costs=True)
        return await self._invoke(self.stub.Health, request, max(self.timeout_s, COSTS_TIMEOUT_S))

    async def close(self) -> None:
        await self.channel.close()


class DraftClient(_Client):
    def __init__(self, address: str, timeout_s: float = 30.0, secret: str | None = None):
        super().__init__(address, timeout_s, secret)
        self.stub = pb_grpc.DraftWorkerStub(self.channel)

    async def propose(self, call: Call, params: SamplingParams) -> ProposeResult:
        """A chain call's drafted tokens and their encoded draft probs, or a tree call's (`call.tree`) tree: its nodes,
        parents and scores (no nodes: the head had no features to draft from)."""
        response = await self._invoke(
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
            return ProposeResult(drafted, response.draft_probs, response.batch_seconds)
        if len(response.parents) != len(drafted) or len(response.scores) != len(drafted):
            raise WorkerUnavailable(f"{self.address}: a tree reply of {len(drafted)} tokens, "
                                    f"{len(response.parents)} parents, {len(response.scores)} scores")  # fmt: skip
        return ProposeResult(drafted, response.draft_probs, response.batch_seconds, list(response.parents),
                             list(response.scores))  # fmt: skip


class TargetClient(_Client):
    def __init__(self, address: str, timeout_s: float = 30.0, secret: str | None = None):
        super().__init__(address, timeout_s, secret)
        self.stub = pb_grpc.TargetWorkerStub(self.channel)

    async def verify(self, call: Call, params: SamplingParams) -> VerifyResult:
        response = await self._invoke(
            self.stub.Verify,
            pb.VerifyRequest(
                request_id=call.request_id,
                committed_len=call.committed_len,
                new_tokens=call.new_tokens,
                drafted=call.drafted,
                draft_probs=call.draft_probs,
                sampling=sampling_to_proto(params),
                want_features=call.want_features,
                parents=call.parents or [],
                prompt_len=params.prompt_len,
                end_token_ids=params.end_token_ids,
            ),
        )
        return VerifyResult(
            accepted=response.accepted,
            next_token=response.next_token,
            batch_seconds=response.batch_seconds,
            batch_rows=response.batch_rows,
            batch_tokens=response.batch_tokens,
            features=response.features,
            path=list(response.path),
            logprobs=list(from_proto(response.logprobs)) if response.HasField("logprobs") else None,
        )
