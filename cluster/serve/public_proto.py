"""The public SpecServe gRPC service's edge: GenerateRequest messages -> the typed `Request` (ranges checked by a
pydantic model, fields named by their proto path), responses, errors -> gRPC and HTTP status codes, and the servicer
registration Serve's gRPC proxy uses (a request deserializer that never raises)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Literal

import grpc
from google.protobuf.message import DecodeError
from pydantic import Field

from specserve.cluster.serve.edge import (
    MAX_N,
    MAX_NAME_CHARS,
    MAX_STOP_CHARS,
    MAX_STOPS,
    MAX_TEMPERATURE,
    SEED_LIMIT,
    EdgeModel,
    IdKeyedBias,
    MinP,
    MinTokens,
    PayloadTooLargeError,
    Penalty,
    Request,
    parse,
    text,
)
from specserve.cluster.serve.response_formats import GrpcResponseFormat
from specserve.protos import specserve_pb2 as pb
from specserve.protos.wire import SERVICE_NAME
from specserve.workers.config.request import MAX_K, MAX_REPETITION_PENALTY
from specserve.workers.errors import (
    InvalidRequestError,
    KVCapacityError,
    OverloadedError,
    UnauthenticatedError,
    UnavailableError,
)
from specserve.workers.models.chat import ChatMessage, ChatPrompt, Role
from specserve.workers.speculation.logprobs import MAX_LOGPROBS, TokenLogprob, to_proto
from specserve.workers.speculation.methods import NAMES

SERVICE = SERVICE_NAME
MAX_MESSAGES = 4096


@dataclass(frozen=True)
class Undecodable:
    """Bytes that are no GenerateRequest (a string field with invalid UTF-8, a corrupt wire format). Serve's gRPC
    proxy hands it to the ingress like a request, which answers INVALID_ARGUMENT; a deserializer that raised would
    make gRPC answer UNKNOWN."""

    reason: str


def decode_request(raw: bytes) -> pb.GenerateRequest | Undecodable:
    try:
        return pb.GenerateRequest.FromString(raw)
    except DecodeError as e:
        return Undecodable(str(e).rsplit(": ", 1)[-1])


def add_servicer_to_server(servicer, server) -> None:
    """Serve's `grpc_servicer_functions` entry for the public service: the generated
    `add_SpecServeServicer_to_server`, with `decode_request` as the request deserializer."""
    out = pb.GenerateResponse.SerializeToString
    handlers = {
        "Generate": grpc.unary_unary_rpc_method_handler(
            servicer.Generate, request_deserializer=decode_request, response_serializer=out
        ),
        "GenerateStream": grpc.unary_stream_rpc_method_handler(
            servicer.GenerateStream, request_deserializer=decode_request, response_serializer=out
        ),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
    server.add_registered_method_handlers(SERVICE, handlers)


class GrpcSampling(EdgeModel):
    temperature: Annotated[float, Field(ge=0, le=MAX_TEMPERATURE, allow_inf_nan=False)]
    top_k: int  # a uint32 (clamped to the vocabulary by `prepare`)
    top_p: Annotated[float, Field(ge=0, le=1, allow_inf_nan=False)]  # 0 = unset
    max_new_tokens: int  # a uint32, 0 = unset
    seed: Annotated[int, Field(ge=0, lt=SEED_LIMIT)] | None
    presence_penalty: Penalty
    frequency_penalty: Penalty
    repetition_penalty: Annotated[float, Field(ge=0, le=MAX_REPETITION_PENALTY, allow_inf_nan=False)]  # 0 = unset
    min_p: MinP
    logit_bias: IdKeyedBias
    min_tokens: MinTokens
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None
    response_format: GrpcResponseFormat | None


class GrpcSpeculation(EdgeModel):
    method: Literal[("", *NAMES)]  # "": the model's default
    k: Annotated[int, Field(ge=0, le=MAX_K)]  # 0 = auto


class GrpcMessage(EdgeModel):
    role: Role
    content: str  # protobuf checked its UTF-8


class GrpcRequest(EdgeModel):
    """The ranges of a GenerateRequest's fields (protobuf checked their types)."""

    model: text(max_length=MAX_NAME_CHARS)
    sampling: GrpcSampling
    speculation: GrpcSpeculation | None
    messages: Annotated[list[GrpcMessage], Field(fail_fast=True)]
    stop: Annotated[list[text(min_length=1, max_length=MAX_STOP_CHARS)], Field(max_length=MAX_STOPS, fail_fast=True)]
    stop_token_ids: Annotated[list[int], Field(max_length=MAX_STOPS, fail_fast=True)]
    n: Annotated[int, Field(ge=0, le=MAX_N)]  # 0 = unset (1)


def request_from_proto(request: pb.GenerateRequest | Undecodable) -> Request:
    """The typed request; InvalidRequestError naming the bad field by its proto path (`sampling.top_p`). Zero/empty
    fields mean "unset" as the proto documents."""
    if isinstance(request, Undecodable):
        raise InvalidRequestError("request", f"is not a specserve.v1.GenerateRequest message ({request.reason})")
    given = [bool(request.prompt), len(request.prompt_token_ids) > 0, len(request.messages) > 0]
    if sum(given) != 1:
        raise InvalidRequestError("prompt", "set exactly one of prompt, prompt_token_ids and messages")
    if len(request.messages) > MAX_MESSAGES:  # before making a dict of each
        raise InvalidRequestError("messages", f"{len(request.messages)} messages, the limit is {MAX_MESSAGES}")
    s, spec = request.sampling, request.speculation
    edge: GrpcRequest = parse(GrpcRequest, {
        "model": request.model,
        "sampling": {"temperature": s.temperature, "top_k": s.top_k, "top_p": s.top_p,
                     "max_new_tokens": s.max_new_tokens, "seed": s.seed if s.HasField("seed") else None,
                     "presence_penalty": s.presence_penalty, "frequency_penalty": s.frequency_penalty,
                     "repetition_penalty": s.repetition_penalty, "min_p": s.min_p, "min_tokens": s.min_tokens,
                     "logit_bias": dict(s.logit_bias), "logprobs": s.logprobs if s.HasField("logprobs") else None,
                     "response_format": {"type": s.response_format.type, "json_schema": s.response_format.json_schema}
                     if s.HasField("response_format") else None},
        "speculation": {"method": spec.method, "k": spec.k} if request.HasField("speculation") else None,
        "messages": [{"role": m.role, "content": m.content} for m in request.messages],
        "stop": list(request.stop[: MAX_STOPS + 1]),
        "stop_token_ids": list(request.stop_token_ids[: MAX_STOPS + 1]),
        "n": request.n,
    })  # fmt: skip
    prompt, field = _prompt(request, edge)
    sp, sampling = edge.speculation, edge.sampling
    return Request(
        model=edge.model,
        prompt=prompt,
        temperature=sampling.temperature,
        top_p=sampling.top_p or 1.0,
        top_k=sampling.top_k,
        seed=sampling.seed,
        max_new_tokens=sampling.max_new_tokens or None,
        method=(sp.method or None) if sp else None,
        k=(sp.k or "auto") if sp else None,
        prompt_field=field,
        max_new_tokens_field="sampling.max_new_tokens",
        stop=tuple(edge.stop),
        stop_token_ids=tuple(edge.stop_token_ids),
        include_stop_str_in_output=request.include_stop_str_in_output,
        ignore_eos=request.sampling.ignore_eos,
        presence_penalty=sampling.presence_penalty,
        frequency_penalty=sampling.frequency_penalty,
        repetition_penalty=sampling.repetition_penalty or 1.0,
        min_p=sampling.min_p,
        logit_bias=sampling.logit_bias,
        min_tokens=sampling.min_tokens,
        controls_prefix="sampling.",
        logprobs=sampling.logprobs,
        response_format=sampling.response_format.internal() if sampling.response_format else None,
        n=edge.n or 1,
    )


def _prompt(request: pb.GenerateRequest, edge: GrpcRequest) -> tuple[str | tuple[int, ...] | ChatPrompt, str]:
    """(the prompt, its field): the one of prompt, prompt_token_ids and messages that is set."""
    if request.prompt:
        return request.prompt, "prompt"
    if request.prompt_token_ids:
        return tuple(request.prompt_token_ids), "prompt_token_ids"
    return ChatPrompt(tuple(ChatMessage(m.role, m.content) for m in edge.messages)), "messages"


def stats_proto(stats: dict) -> pb.RequestStats:
    return pb.RequestStats(**stats)


def response(text: str, token_ids: list[int], finish_reason: str | None, stats: dict,
             logprobs: list[TokenLogprob] | None = None, index: int = 0) -> pb.GenerateResponse:  # fmt: skip
    """logprobs: those of token_ids, when the request asked (sampling.logprobs); index: the choice's (n > 1)."""
    return pb.GenerateResponse(text=text, token_ids=token_ids, finish_reason=finish_reason or "",
                               stats=stats_proto(stats), index=index,
                               logprobs=to_proto(logprobs) if logprobs is not None else None)  # fmt: skip


def result_response(out: dict, index: int = 0) -> pb.GenerateResponse:
    """A scheduler's whole result as the unary answer (or one of its choices)."""
    return response(out["text"], out["token_ids"], out["finish_reason"], out["stats"], out.get("logprobs"), index)


def choices_response(outs: list[dict]) -> pb.GenerateResponse:
    """Generate's answer with n > 1: every choice in `choices`, by index; the message's own fields unset."""
    return pb.GenerateResponse(choices=[result_response(out, i) for i, out in enumerate(outs)])


def status_for(error: BaseException) -> grpc.StatusCode:
    if isinstance(error, PayloadTooLargeError):
        return grpc.StatusCode.RESOURCE_EXHAUSTED
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
    if isinstance(error, PayloadTooLargeError):
        return 413, "invalid_request_error"
    if isinstance(error, InvalidRequestError):
        return 400, "invalid_request_error"
    if isinstance(error, UnavailableError):
        return 503, "service_unavailable"
    if isinstance(error, UnauthenticatedError):
        return 401, "authentication_error"
    if isinstance(error, KVCapacityError | OverloadedError):
        return 429, "rate_limit_exceeded"
    return 500, "internal_error"


REFUSED_GRPC = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAUTHENTICATED)


def refused_status(error: BaseException, http: bool) -> str | None:
    """The status label of a refused request (the client's doing: bad input, no key, too large, over capacity) for
    the refused-requests counter; None for the server's failures (5xx, UNAVAILABLE, INTERNAL)."""
    if http:
        status, _ = http_status_for(error)
        return str(status) if status < 500 else None
    code = status_for(error)
    return code.name if code in REFUSED_GRPC else None
