"""Async gRPC clients of draft and target workers, with the KV state protocol's client side: send only the committed
tokens a worker has not seen, and re-send the whole committed sequence when it answers NOT_FOUND."""

from __future__ import annotations

from dataclasses import dataclass, field

import grpc

from specserve.protos import specserve_pb2 as pb
from specserve.protos import specserve_pb2_grpc as pb_grpc
from specserve.workers.config import SamplingParams
from specserve.workers.grpc_service import GRPC_OPTIONS, sampling_to_proto


@dataclass
class WorkerView:
    """How much of each request's committed sequence a worker has been sent."""

    sent: dict[str, int] = field(default_factory=dict)

    def tail(self, request_id: str, committed: list[int]) -> list[int]:
        return committed[self.sent.get(request_id, 0) :]


class _Client:
    def __init__(self, address: str, timeout_s: float):
        self.address = address
        self.timeout_s = timeout_s
        self.channel = grpc.aio.insecure_channel(address, options=GRPC_OPTIONS)
        self.view = WorkerView()
        self.resends = 0

    async def _with_resend(self, request_id: str, committed: list[int], call):
        """call(new_tokens) -> response; on NOT_FOUND the worker lost the request: send everything again."""
        try:
            response = await call(self.view.tail(request_id, committed))
        except grpc.aio.AioRpcError as e:
            if e.code() != grpc.StatusCode.NOT_FOUND:
                raise
            self.resends += 1
            response = await call(list(committed))
        self.view.sent[request_id] = len(committed)
        return response

    async def release(self, request_id: str) -> bool:
        self.view.sent.pop(request_id, None)
        return (await self.stub.Release(pb.ReleaseRequest(request_id=request_id), timeout=self.timeout_s)).released

    async def health(self) -> pb.HealthResponse:
        return await self.stub.Health(pb.HealthRequest(), timeout=self.timeout_s)

    async def close(self) -> None:
        await self.channel.close()


class DraftClient(_Client):
    def __init__(self, address: str, timeout_s: float = 30.0):
        super().__init__(address, timeout_s)
        self.stub = pb_grpc.DraftWorkerStub(self.channel)

    async def propose(self, request_id: str, committed: list[int], k: int, params: SamplingParams):
        """(drafted tokens, encoded draft weights, vocabulary size)."""

        async def call(new_tokens):
            return await self.stub.Propose(
                pb.ProposeRequest(
                    request_id=request_id,
                    committed_len=len(committed),
                    new_tokens=new_tokens,
                    k=k,
                    sampling=sampling_to_proto(params),
                ),
                timeout=self.timeout_s,
            )

        response = await self._with_resend(request_id, committed, call)
        return list(response.drafted), response.draft_probs, response.vocab_size


class TargetClient(_Client):
    def __init__(self, address: str, timeout_s: float = 30.0):
        super().__init__(address, timeout_s)
        self.stub = pb_grpc.TargetWorkerStub(self.channel)

    async def verify(
        self, request_id: str, committed: list[int], drafted: list[int], draft_probs: bytes, params: SamplingParams
    ) -> tuple[int, int]:
        async def call(new_tokens):
            return await self.stub.Verify(
                pb.VerifyRequest(
                    request_id=request_id,
                    committed_len=len(committed),
                    new_tokens=new_tokens,
                    drafted=drafted,
                    draft_probs=draft_probs,
                    sampling=sampling_to_proto(params),
                ),
                timeout=self.timeout_s,
            )

        response = await self._with_resend(request_id, committed, call)
        return response.accepted, response.next_token
