"""OpenAI-compatible request parsing and response shapes (completions, chat completions, models, errors). Pure
functions over dicts: the HTTP routes in cluster/serve_app.py call them, tests call them alone.

Extensions beyond OpenAI's fields: `top_k`, and `speculation: {"method": "draft"|"ngram"|"none", "k": 1..16|"auto"}`
(pass them with the openai package's `extra_body=`). Every response carries `specserve` stats (rounds, drafted,
accepted, acceptance_rate, mean_accepted_length).
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from typing import Any

from specserve.workers.chat import ROLES, ChatMessage, ChatPrompt
from specserve.workers.errors import InvalidRequestError

# OpenAI fields specserve accepts only at their neutral value (anything else would silently change the output).
_NEUTRAL = {
    "n": (1, None),
    "best_of": (1, None),
    "echo": (False, None),
    "logprobs": (None, False, 0),
    "top_logprobs": (None, 0),
    "frequency_penalty": (0, 0.0, None),
    "presence_penalty": (0, 0.0, None),
    "logit_bias": (None, {}),
    "stop": (None, [], ""),
    "suffix": (None, ""),
    "response_format": (None, {"type": "text"}),
    "tools": (None, []),
    "tool_choice": (None, "none"),
}
_IGNORED = {"user", "stream_options", "metadata", "store", "service_tier", "parallel_tool_calls"}
_COMMON = {"model", "stream", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "seed",
           "speculation"}  # fmt: skip


@dataclass
class ParsedRequest:
    model: str
    prompt: str | list[int] | ChatPrompt
    sampling: dict
    speculation: dict
    stream: bool
    include_usage: bool


def _type(name: str, value: Any, types: tuple, what: str) -> Any:
    # bool is an int subclass: reject it where a number is expected
    if value is not None and (not isinstance(value, types) or (isinstance(value, bool) and bool not in types)):
        raise InvalidRequestError(name, f"must be {what}, got {type(value).__name__}")
    return value


def _common(body: Any, allowed: set[str]) -> dict:
    if not isinstance(body, dict):
        raise InvalidRequestError("body", "must be a JSON object")
    unknown = sorted(set(body) - allowed - _COMMON - set(_NEUTRAL) - _IGNORED)
    if unknown:
        raise InvalidRequestError(unknown[0], "unknown field" + (f" (also: {', '.join(unknown[1:])})" if unknown[1:]
                                                                  else ""))  # fmt: skip
    for name, neutral in _NEUTRAL.items():
        if name in body and body[name] not in neutral:
            raise InvalidRequestError(name, f"{body[name]!r} is not supported by specserve (omit it)")
    model = _type("model", body.get("model", ""), (str,), "a string") or ""
    stream = _type("stream", body.get("stream", False), (bool,), "a boolean") or False
    opts = _type("stream_options", body.get("stream_options"), (dict,), "an object") or {}
    sampling: dict = {}
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is not None:
        sampling["max_new_tokens"] = _type("max_tokens", max_tokens, (int,), "an integer")
    # OpenAI's default temperature is 1 (sampling); send 0 for greedy decoding.
    sampling["temperature"] = _type("temperature", body.get("temperature", 1.0), (int, float), "a number")
    for name, types, what in (("top_p", (int, float), "a number"), ("top_k", (int,), "an integer"),
                              ("seed", (int,), "an integer")):  # fmt: skip
        if body.get(name) is not None:
            sampling[name] = _type(name, body[name], types, what)
    speculation = _type("speculation", body.get("speculation"), (dict,), "an object") or {}
    extra = sorted(set(speculation) - {"method", "k"})
    if extra:
        raise InvalidRequestError(f"speculation.{extra[0]}", "unknown field")
    return {"model": model, "stream": stream, "include_usage": bool(opts.get("include_usage")),
            "sampling": sampling, "speculation": dict(speculation)}  # fmt: skip


def parse_completion(body: Any) -> ParsedRequest:
    common = _common(body, {"prompt"})
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, list):
        if not prompt or not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            raise InvalidRequestError("prompt", "must be a string or a list of token ids (one prompt per request)")
    elif not isinstance(prompt, str):
        raise InvalidRequestError("prompt", "is required: a string or a list of token ids")
    if isinstance(prompt, str) and not prompt:
        raise InvalidRequestError("prompt", "must not be empty")
    return ParsedRequest(prompt=prompt, **common)


def parse_chat(body: Any) -> ParsedRequest:
    """The messages become a ChatPrompt, rendered with the served model's own chat template (workers/chat.py)."""
    common = _common(body, {"messages"})
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise InvalidRequestError("messages", "must be a non-empty list of {role, content} objects")
    typed = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or set(m) - {"role", "content", "name"}:
            raise InvalidRequestError(f"messages[{i}]", "must be an object with role and content")
        if m.get("role") not in ROLES:
            raise InvalidRequestError(f"messages[{i}].role", f"unsupported role {m.get('role')!r}")
        if not isinstance(m.get("content"), str):
            raise InvalidRequestError(f"messages[{i}].content", "must be a string")
        typed.append(ChatMessage(m["role"], m["content"]))
    return ParsedRequest(prompt=ChatPrompt(tuple(typed)), **common)


def _usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}  # fmt: skip


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def completion_response(rid: str, model: str, result: dict, chat: bool) -> dict:
    usage = _usage(result["usage"]["prompt_tokens"], result["usage"]["completion_tokens"])
    if chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": result["text"]},
                  "finish_reason": result["finish_reason"], "logprobs": None}  # fmt: skip
    else:
        choice = {"index": 0, "text": result["text"], "finish_reason": result["finish_reason"], "logprobs": None}
    return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
            "model": model, "choices": [choice], "usage": usage, "specserve": result["stats"]}  # fmt: skip


def stream_chunk(rid: str, model: str, text: str, finish_reason: str | None, chat: bool, first: bool) -> str:
    if chat:
        delta = {"content": text}
        if first:
            delta["role"] = "assistant"
        choice = {"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}
    else:
        choice = {"index": 0, "text": text, "finish_reason": finish_reason, "logprobs": None}
    obj = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": int(time.time()),
           "model": model, "choices": [choice]}  # fmt: skip
    return sse(obj)


def usage_chunk(rid: str, model: str, prompt_tokens: int, completion_tokens: int, stats: dict, chat: bool) -> str:
    obj = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": int(time.time()),
           "model": model, "choices": [], "usage": _usage(prompt_tokens, completion_tokens),
           "specserve": stats}  # fmt: skip
    return sse(obj)


def sse(obj: dict | str) -> str:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj)}\n\n"


def error_body(message: str, kind: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def models_list(names: list[str], created: int) -> dict:
    return {
        "object": "list",
        "data": [{"id": n, "object": "model", "created": created, "owned_by": "specserve"} for n in names],
    }
