"""The public SpecServe gRPC messages <-> the service's plain request and chunk values, and errors -> status codes."""

from __future__ import annotations

import grpc

from specserve.protos import specserve_pb2 as pb
from specserve.workers.chat import ChatMessage, ChatPrompt
from specserve.workers.errors import (
    InvalidRequestError,
    KVCapacityError,
    OverloadedError,
    UnauthenticatedError,
    UnavailableError,
)


def request_fields(request: pb.GenerateRequest) -> tuple[str, str | list[int] | ChatPrompt, dict, dict]:
    """(model, prompt, sampling, speculation) as the service's `prepare` takes them. Zero/empty fields mean "unset"
    as the proto documents."""
    given = [bool(request.prompt), len(request.prompt_token_ids) > 0, len(request.messages) > 0]
    if sum(given) != 1:
        raise InvalidRequestError("prompt", "set exactly one of prompt, prompt_token_ids and messages")
    if given[0]:
        prompt = request.prompt
    elif given[1]:
        prompt = list(request.prompt_token_ids)
    else:
        prompt = ChatPrompt(tuple(ChatMessage(m.role, m.content) for m in request.messages))
    s = request.sampling
    sampling: dict = {"temperature": s.temperature, "top_k": s.top_k, "top_p": s.top_p or 1.0}
    if s.max_new_tokens:
        sampling["max_new_tokens"] = s.max_new_tokens
    if s.HasField("seed"):
        sampling["seed"] = s.seed
    speculation: dict = {}
    if request.HasField("speculation"):
        if request.speculation.method:
            speculation["method"] = request.speculation.method
        speculation["k"] = request.speculation.k or "auto"
    return request.model, prompt, sampling, speculation


def stats_proto(stats: dict) -> pb.RequestStats:
    return pb.RequestStats(**stats)


def response(text: str, token_ids: list[int], finish_reason: str | None, stats: dict) -> pb.GenerateResponse:
    return pb.GenerateResponse(text=text, token_ids=token_ids, finish_reason=finish_reason or "",
                               stats=stats_proto(stats))  # fmt: skip


def status_for(error: BaseException) -> grpc.StatusCode:
    if isinstance(error, InvalidRequestError):
        return grpc.StatusCode.INVALID_ARGUMENT
    if isinstance(error, UnavailableError):
        return grpc.StatusCode.UNAVAILABLE
    if isinstance(error, UnauthenticatedError):
        return grpc.StatusCode.UNAUTHENTICATED
    if isinstance(error, KVCapacityError | OverloadedError):
        return grpc.StatusCode.RESOURCE_EXHAUSTED
    return grpc.StatusCode.INTERNAL


def http_status_for(error: BaseException) -> tuple[int, str]:
    """(HTTP status, OpenAI error type)."""
    if isinstance(error, InvalidRequestError):
        return 400, "invalid_request_error"
    if isinstance(error, UnavailableError):
        return 503, "service_unavailable"
    if isinstance(error, UnauthenticatedError):
        return 401, "authentication_error"
    if isinstance(error, KVCapacityError | OverloadedError):
        return 429, "rate_limit_exceeded"
    return 500, "internal_error"
