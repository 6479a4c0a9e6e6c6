"""A request's SamplingParams on the wire (`specserve.v1.SamplingParams`), both ways: the scheduler's worker clients
send them (`sampling_to_proto`), the workers' servicers validate them once per request (`sampling_from_proto`). Protos
and pydantic only, so a client imports it without the servers (or torch)."""

from __future__ import annotations

from specserve.protos import specserve_pb2 as pb
from specserve.workers.config.request import SamplingParams
from specserve.workers.config.strict import validate
from specserve.workers.service.format_wire import format_from_proto, format_to_proto


def sampling_from_proto(msg: pb.SamplingParams) -> SamplingParams:
    data = {"temperature": msg.temperature, "top_k": msg.top_k, "top_p": msg.top_p or 1.0}
    if msg.max_new_tokens:
        data["max_new_tokens"] = msg.max_new_tokens
    if msg.HasField("seed"):
        data["seed"] = msg.seed
    if msg.HasField("logprobs"):
        data["logprobs"] = msg.logprobs
    data.update(_controls_from_proto(msg))
    data.update(format_from_proto(msg))
    return validate(SamplingParams, data)


def _controls_from_proto(msg: pb.SamplingParams) -> dict:
    """The logits controls a message sets (unset fields: the defaults; repetition_penalty 0 is unset)."""
    data = {
        "presence_penalty": msg.presence_penalty,
        "frequency_penalty": msg.frequency_penalty,
        "repetition_penalty": msg.repetition_penalty or 1.0,
        "min_p": msg.min_p,
        "min_tokens": msg.min_tokens,
    }
    if msg.logit_bias:
        data["logit_bias"] = dict(msg.logit_bias)
    return {name: value for name, value in data.items() if value}  # fmt: skip


def sampling_to_proto(params: SamplingParams) -> pb.SamplingParams:
    msg = pb.SamplingParams(
        temperature=params.temperature, top_k=params.top_k, top_p=params.top_p, max_new_tokens=params.max_new_tokens
    )
    if params.seed is not None:
        msg.seed = params.seed
    if params.logprobs is not None:
        msg.logprobs = params.logprobs
    msg.presence_penalty, msg.frequency_penalty = params.presence_penalty, params.frequency_penalty
    msg.repetition_penalty, msg.min_p, msg.min_tokens = params.repetition_penalty, params.min_p, params.min_tokens
    msg.logit_bias.update(params.logit_bias)
    format_to_proto(params.response_format, msg)
    return msg
