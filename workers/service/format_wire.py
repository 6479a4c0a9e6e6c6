"""A request's response_format (structured output) in its wire SamplingParams, both ways: the scheduler sends it with
every round (a few hundred bytes; the target worker's sampling cache validates it once per request), the target worker
keeps the request's grammar matcher next to its KV cache (workers/speculation/grammar.py)."""

from __future__ import annotations

from specserve.protos import specserve_pb2 as pb
from specserve.workers.config.request import ResponseFormat


def format_from_proto(msg: pb.SamplingParams) -> dict:
    """The SamplingParams fields a message's response_format sets (none when unset)."""
    if not msg.HasField("response_format"):
        return {}
    return {"response_format": {"type": msg.response_format.type, "json_schema": msg.response_format.json_schema}}


def format_to_proto(fmt: ResponseFormat | None, msg: pb.SamplingParams) -> None:
    if fmt is not None:
        msg.response_format.CopyFrom(pb.ResponseFormat(type=fmt.type, json_schema=fmt.json_schema))
