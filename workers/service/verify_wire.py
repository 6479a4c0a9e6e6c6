"""A verify call's reply on the wire (`specserve.v1.VerifyResponse`), both ways, its fields mapped in one place: the
target worker's servicer sends a `VerifyResult` (`verify_to_proto`, for a Verify call and each step of a Decode
stream), the scheduler's client reads it back (`verify_from_proto`). Protos only, no torch."""

from __future__ import annotations

from specserve.protos import specserve_pb2 as pb
from specserve.workers.service.results import VerifyResult
from specserve.workers.speculation.logprobs import from_proto, to_proto


def verify_to_proto(result: VerifyResult, bonus: bool) -> pb.VerifyResponse:
    """bonus: whether next_token is the bonus token (every drafted token, or the deepest accepted node, accepted)."""
    return pb.VerifyResponse(
        accepted=result.accepted,
        next_token=result.next_token,
        bonus=bonus,
        batch_seconds=result.batch_seconds,
        batch_rows=result.batch_rows,
        batch_tokens=result.batch_tokens,
        queued_seconds=result.queued_seconds,
        batch_forward_seconds=result.batch_forward_seconds,
        features=result.features,
        path=result.path or [],
        logprobs=to_proto(result.logprobs) if result.logprobs is not None else None,
        prompt_logprobs=to_proto(result.prompt_logprobs) if result.prompt_logprobs is not None else None,
    )


def verify_from_proto(response: pb.VerifyResponse) -> VerifyResult:
    return VerifyResult(
        accepted=response.accepted,
        next_token=response.next_token,
        batch_seconds=response.batch_seconds,
        batch_rows=response.batch_rows,
        batch_tokens=response.batch_tokens,
        queued_seconds=response.queued_seconds,
        batch_forward_seconds=response.batch_forward_seconds,
        features=response.features,
        path=list(response.path),
        logprobs=list(from_proto(response.logprobs)) if response.HasField("logprobs") else None,
        prompt_logprobs=from_proto(response.prompt_logprobs) if response.HasField("prompt_logprobs") else None,
    )
