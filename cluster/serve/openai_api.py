"""OpenAI-compatible request parsing and response shapes (completions, chat completions, models, errors). Pure
functions over dicts: the HTTP routes in cluster/serve/ingress.py call them, tests call them alone.

Requests are validated once, here, by strict pydantic models of OpenAI's bodies (field names as OpenAI spells them,
so errors name `max_tokens` or `messages[1].content[0].type`), into the typed `Request` that `RequestPreparer.prepare`
takes (OpenAI's `max_tokens` and `max_completion_tokens` become its `max_new_tokens`; unset sampling fields stay None,
for the model's generation_config.json defaults). Unknown fields are ignored and named (vLLM's leniency), or refused
with `strict`. Extensions beyond OpenAI's fields: `top_k` (-1: off), `speculation: {"method": "draft"|"eagle"|
"eagle+ngram"|"eagle-tree"|"eagle-tree+ngram"|"ngram"|"ngram-tree"|"suffix"|"none", "k": 1..16|"auto"}` (pass them
with the openai package's `extra_body=`), and vLLM's `chat_template_kwargs`, `stream_options.continuous_usage_stats`,
completions' `echo` (with `logprobs` too, and `max_tokens: 0`: the prompt alone) and `prompt_logprobs` (not
streamed, as vLLM).
OpenAI fields that would change the output in ways specserve does not implement (best_of, suffix, tools on
completions) are accepted only at their neutral value (chat's tools: openai_tools.py); `logprobs` / `top_logprobs` /
`prompt_logprobs`: openai_logprobs.py, echo's shapes: openai_echo.py. The logits controls
(`presence_penalty`, `frequency_penalty`, `logit_bias`, and vLLM's `repetition_penalty`, `min_p`, `min_tokens`) apply
at every verified position (workers/speculation/logits_controls.py); `response_format` (json_object, json_schema)
through the grammar engine (response_formats.py, workers/speculation/grammar.py). Every response carries `specserve`
stats (rounds, drafted, accepted, acceptance_rate, mean_accepted_length).
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from typing import Annotated, Any, Literal, Union

from pydantic import AfterValidator, BeforeValidator, Discriminator, Field, Tag, field_validator
from pydantic_core import PydanticCustomError

from specserve.cluster.serve.edge import (
    MAX_N,
    MAX_NAME_CHARS,
    MAX_STOP_CHARS,
    MAX_STOPS,
    MAX_TEMPERATURE,
    SEED_LIMIT,
    UINT32_MAX,
    EdgeModel,
    MinP,
    MinTokens,
    PayloadTooLargeError,
    Penalty,
    RepetitionPenalty,
    Request,
    Text,
    TextKeyedBias,
    json_type,
    one_of,
    parse,
    text,
    unsupported,
)
from specserve.cluster.serve.openai_logprobs import MAX_COMPLETION_LOGPROBS, MAX_LOGPROBS, requested
from specserve.cluster.serve.openai_messages import SHORT, Messages
from specserve.cluster.serve.openai_tools import ToolChoice, Tools, forced, with_forced_call
from specserve.cluster.serve.response_formats import OpenAIResponseFormat, from_openai
from specserve.workers.config.request import MAX_K, SpecMethod
from specserve.workers.errors import InvalidRequestError
from specserve.workers.models.chat import ChatPrompt

TOKEN_ID_LIMIT = 2**31  # token ids travel to the workers as int32


def _token_ids(ids: list) -> tuple[int, ...]:
    # One pass that stops at the first bad element (pydantic would make an error per element).
    for i, t in enumerate(ids):
        if type(t) is not int or not 0 <= t < TOKEN_ID_LIMIT:
            raise PydanticCustomError(
                "token_id", "element {i} is not a token id (an integer, 0 <= id < 2^31)", {"i": i}
            )
    return tuple(ids)


def _single(prompts: list) -> list:
    if len(prompts) != 1:
        raise PydanticCustomError(
            "batch", "specserve takes one prompt per request, not a list of {n}", {"n": len(prompts)}
        )
    return prompts


def _prompt_list_kind(value: list) -> str:
    first = json_type(value[0]) if value else None
    return {"string": "<texts>", "array": "<id lists>"}.get(first, "<ids>")


NonEmptyText = text(min_length=1)
TokenIds = Annotated[list, Field(min_length=1), AfterValidator(_token_ids)]
_PromptList = Annotated[
    Union[  # noqa: UP007 - tagged members
        Annotated[TokenIds, Tag("<ids>")],
        Annotated[list[NonEmptyText], BeforeValidator(_single), AfterValidator(lambda v: v[0]), Tag("<texts>")],
        Annotated[list[TokenIds], BeforeValidator(_single), AfterValidator(lambda v: v[0]), Tag("<id lists>")],
    ],
    Discriminator(_prompt_list_kind),
]
Prompt = one_of("must be a string or a list of token ids", string=NonEmptyText, array=_PromptList)


class StreamOptions(EdgeModel):
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None  # vLLM's: with include_usage, usage on every chunk too
    include_obfuscation: bool | None = None  # no effect here


class Speculation(EdgeModel):
    method: SpecMethod | None = None
    k: one_of(f"must be 1..{MAX_K} or 'auto'", integer=Annotated[int, Field(ge=1, le=MAX_K)],
              string=Literal["auto"], null=None) = None  # fmt: skip


def _metadata(value: dict) -> dict:
    if len(value) > 16 or not all(isinstance(k, str) and isinstance(v, str) and len(k) <= 64 and len(v) <= 512
                                  for k, v in value.items()):  # fmt: skip
        raise PydanticCustomError("metadata", "must be at most 16 string keys (64 characters) and values (512)")
    return value


# Accepted only at these values (anything else would silently change the output): field -> (values, as shown).
_NEUTRAL: dict[str, tuple[tuple, str]] = {
    "best_of": ((1,), "1"),
    "suffix": (("",), '""'),
    "tools": (([],), "[]"),
    "tool_choice": (("none",), '"none"'),
}

StopText = text(min_length=1, max_length=MAX_STOP_CHARS)


class _Body(EdgeModel):
    """The fields completions and chat completions share."""

    model: text(max_length=MAX_NAME_CHARS) | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0, le=MAX_TEMPERATURE, allow_inf_nan=False)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1, allow_inf_nan=False)] | None = None
    top_k: Annotated[int, Field(ge=-1, le=UINT32_MAX)] | None = None  # -1: off (vLLM's)
    seed: Annotated[int, Field(ge=0, lt=SEED_LIMIT)] | None = None
    speculation: Speculation | None = None
    n: Annotated[int, Field(ge=1, le=MAX_N)] | None = None  # choices, each its own request (seeded: seed + index)
    # logits controls (OpenAI's, and vLLM's extras repetition_penalty, min_p, min_tokens)
    frequency_penalty: Penalty | None = None
    presence_penalty: Penalty | None = None
    repetition_penalty: RepetitionPenalty | None = None
    min_p: MinP | None = None
    min_tokens: MinTokens | None = None
    logit_bias: TextKeyedBias | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None  # chat's, with logprobs: true
    prompt_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None  # vLLM's: not streamed
    # neutral only (_NEUTRAL)
    stop: one_of("must be a string or a list of strings", string=text(max_length=MAX_STOP_CHARS), null=None,
                 array=Annotated[list[StopText], Field(max_length=MAX_STOPS, fail_fast=True)]) = None  # fmt: skip
    stop_token_ids: Annotated[list[int], Field(max_length=MAX_STOPS, fail_fast=True)] | None = None  # vLLM's
    include_stop_str_in_output: bool | None = None  # vLLM's
    ignore_eos: bool | None = None  # vLLM's
    response_format: OpenAIResponseFormat | None = None  # structured output (response_formats.py)
    # accepted and ignored
    user: text(max_length=SHORT) | None = None
    metadata: Annotated[dict, AfterValidator(_metadata)] | None = None
    store: bool | None = None
    service_tier: text(max_length=64) | None = None
    parallel_tool_calls: bool | None = None

    def request(self, prompt: str | tuple[int, ...] | ChatPrompt, prompt_field: str) -> Request:
        spec = self.speculation or Speculation()
        max_new = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        return Request(
            model=self.model or "",
            prompt=prompt,
            # Unset: the model's generation_config.json default, else OpenAI's (temperature 1: send 0 for greedy).
            temperature=None if self.temperature is None else float(self.temperature),
            top_p=None if self.top_p is None else float(self.top_p),
            top_k=None if self.top_k is None else max(self.top_k, 0),  # vLLM's -1: off, as 0
            seed=self.seed,
            max_new_tokens=max_new,
            method=spec.method,
            k=spec.k,
            prompt_field=prompt_field,
            max_new_tokens_field="max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens",
            stop=((self.stop,) if self.stop else ()) if isinstance(self.stop, str) else tuple(self.stop or ()),
            stop_token_ids=tuple(self.stop_token_ids or ()),
            include_stop_str_in_output=bool(self.include_stop_str_in_output),
            ignore_eos=bool(self.ignore_eos),
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=self.repetition_penalty,
            min_p=self.min_p,
            logit_bias=self.logit_bias or {},
            min_tokens=self.min_tokens or 0,
            logprobs=requested(self.logprobs, self.top_logprobs, chat=isinstance(self, ChatBody)),
            prompt_logprobs=self.prompt_logprobs,
            response_format=from_openai(self.response_format),
            n=self.n or 1,
        )


def _check_neutral(name: str, value: Any) -> Any:
    accepted, neutral = _NEUTRAL[name]
    if value is None or any(value == a and isinstance(value, bool) == isinstance(a, bool) for a in accepted):
        return value
    raise unsupported(neutral)


class CompletionBody(_Body):
    prompt: Prompt
    max_tokens: Annotated[int, Field(ge=0)] | None = None  # 0: with echo, the prompt alone (vLLM's)
    best_of: int | None = None
    echo: bool | None = None  # the prompt's text (and with logprobs its tokens' logprobs) before the output's
    logprobs: Annotated[int, Field(ge=0, le=MAX_COMPLETION_LOGPROBS)] | None = None
    suffix: Text | None = None
    tools: list | None = None  # chat's only
    tool_choice: one_of("must be a string or an object", string=Text, object=dict, null=None) = None

    @field_validator("best_of", "suffix", "tools", "tool_choice")
    @classmethod
    def _neutral_here(cls, value: Any, info) -> Any:
        return _check_neutral(info.field_name, value)


class ChatBody(_Body):
    messages: Messages  # text turns and a tool loop's (openai_messages.py)
    logprobs: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's: to the chat template (enable_thinking, ...)
    tools: Tools | None = None  # forced calls: openai_tools.py
    tool_choice: ToolChoice = None


@dataclass(frozen=True)
class ParsedRequest:
    request: Request
    stream: bool
    include_usage: bool
    continuous_usage: bool = False  # usage on every streamed chunk (vLLM's stream_options.continuous_usage_stats)
    echo: bool = False  # completions: the prompt's text before the output's (with logprobs, its tokens' too)
    echo_text: str = ""  # that text (the ingress's, from the prompt as it was sent)
    echo_only: bool = False  # completions' max_tokens 0 with echo: the prompt alone (one token is run, and dropped)
    prompt_logprobs: int | None = None  # vLLM's prompt_logprobs list with this many alternatives; None: not shown
    ignored: tuple[str, ...] = ()  # unknown fields ignored (not strict)

    @property
    def n(self) -> int:
        return self.request.n


def _parsed(body: _Body, prompt: str | tuple[int, ...] | ChatPrompt, prompt_field: str,
            ignored: list[str] | None) -> ParsedRequest:  # fmt: skip
    if body.prompt_logprobs is not None and body.stream:
        raise InvalidRequestError("prompt_logprobs", "is not streamed (as vLLM): send stream: false, or omit it")
    options = body.stream_options or StreamOptions()
    usage = bool(options.include_usage)
    return ParsedRequest(body.request(prompt, prompt_field), bool(body.stream), usage,
                         continuous_usage=usage and bool(options.continuous_usage_stats),
                         prompt_logprobs=body.prompt_logprobs, ignored=tuple(ignored or ()))  # fmt: skip


def parse_completion(body: Any, strict: bool = False) -> ParsedRequest:
    """A /v1/completions body (parsed JSON) -> the typed request; InvalidRequestError naming the bad field. Unknown
    fields are refused when `strict`, else ignored (ParsedRequest.ignored names them), as vLLM ignores them."""
    ignored = None if strict else []
    parsed: CompletionBody = parse(CompletionBody, body, ignored)
    only = parsed.max_tokens == 0 and parsed.max_completion_tokens is None
    if only and not parsed.echo:
        raise InvalidRequestError("max_tokens", "must be at least 1 (0 only with echo: the prompt alone)")
    out = _parsed(parsed.model_copy(update={"max_tokens": 1}) if only else parsed, parsed.prompt, "prompt", ignored)
    if parsed.echo and parsed.logprobs is not None:  # the prompt's tokens' logprobs too (vLLM's prompt_logprobs)
        shown = parsed.logprobs if parsed.prompt_logprobs is None else parsed.prompt_logprobs
        request = replace(out.request, prompt_logprobs=max(parsed.logprobs, shown))
        out = replace(out, request=request, prompt_logprobs=shown)
    return replace(out, echo=bool(parsed.echo), echo_only=only)


def parse_chat(body: Any, strict: bool = False) -> ParsedRequest:
    """A /v1/chat/completions body -> the typed request; the messages become a ChatPrompt, rendered with the served
    model's own chat template (and the request's chat_template_kwargs) by `RequestPreparer.prepare`
    (workers/models/chat.py). Unknown fields: as parse_completion."""
    ignored = None if strict else []
    parsed: ChatBody = parse(ChatBody, body, ignored)
    tools, calls, forced_format = forced(parsed.tools, parsed.tool_choice)
    prompt = ChatPrompt(tuple(m.chat() for m in parsed.messages), tools, dict(parsed.chat_template_kwargs or {}))
    out = _parsed(parsed, prompt, "messages", ignored)
    if calls is not None:
        out = replace(out, request=with_forced_call(out.request, calls, forced_format))
    return out


async def read_json(chunks: AsyncIterator[bytes], declared_length: str | None, max_bytes: int) -> Any:
    """A request body (its chunks, as the server receives them) parsed as JSON, read up to `max_bytes`: a
    PayloadTooLargeError (413) beyond, before reading when the declared Content-Length says so. Every malformed body
    is an InvalidRequestError naming `body`."""
    declared = declared_length or ""
    if declared.isascii() and declared.isdigit() and (len(declared) > 15 or int(declared) > max_bytes):
        raise PayloadTooLargeError("body", f"{declared[:16]} bytes exceed the limit of {max_bytes}")
    parts, size = [], 0
    async for chunk in chunks:
        size += len(chunk)
        if size > max_bytes:
            raise PayloadTooLargeError("body", f"is longer than the limit of {max_bytes} bytes")
        parts.append(chunk)
    try:
        text = b"".join(parts).decode("utf-8")
    except UnicodeDecodeError as e:
        raise InvalidRequestError("body", f"is not valid UTF-8 (at byte {e.start})") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise InvalidRequestError("body", f"is not valid JSON: {e.msg} at position {e.pos}") from None
    except RecursionError:
        raise InvalidRequestError("body", "nests arrays or objects too deeply") from None
    except ValueError:  # an integer of more than 4300 digits
        raise InvalidRequestError("body", "holds a number too long to read") from None


def _usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}  # fmt: skip


def completion_response(rid: str, model: str, result: dict | list[dict], chat: bool) -> dict:
    """One result, or a list of them for `n` choices (usage: the prompt once, every choice's tokens; `specserve`:
    one choice's stats, or a list); vLLM's `prompt_logprobs`, where a result has them: each completions choice's,
    the chat response's."""
    results = result if isinstance(result, list) else [result]
    usage = _usage(results[0]["usage"]["prompt_tokens"], sum(r["usage"]["completion_tokens"] for r in results))
    choices = []
    for i, r in enumerate(results):
        if chat:
            choices.append({"index": i, "message": {"role": "assistant", "content": r["text"]},
                            "finish_reason": r["finish_reason"], "logprobs": r.get("logprobs")})  # fmt: skip
        else:
            choices.append({"index": i, "text": r["text"], "finish_reason": r["finish_reason"],
                            "logprobs": r.get("logprobs")} | _prompt_logprobs(r))  # fmt: skip
    stats = result["stats"] if isinstance(result, dict) else [r["stats"] for r in results]
    return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
            "model": model, "choices": choices, "usage": usage, "specserve": stats,
            **(_prompt_logprobs(results[0]) if chat else {})}  # fmt: skip


def _prompt_logprobs(result: dict) -> dict:
    return {"prompt_logprobs": result["prompt_logprobs"]} if "prompt_logprobs" in result else {}


def stream_chunk(rid: str, model: str, text: str, finish_reason: str | None, chat: bool, first: bool,
                 index: int = 0, logprobs: dict | None = None, tool_calls: list[dict] | None = None,
                 usage: tuple[int, int] | None = None) -> str:  # fmt: skip
    """logprobs: the chunk's tokens' in OpenAI's shape (openai_logprobs.LogprobsShaper), or None; tool_calls: chat's
    deltas of calls (openai_tools.ToolStream); usage: (prompt tokens, the choice's tokens so far) on every chunk
    (vLLM's continuous_usage_stats), or None."""
    if chat:
        delta = {"content": text or None} if tool_calls else {"content": text}
        if tool_calls:
            delta["tool_calls"] = tool_calls
        if first:
            delta["role"] = "assistant"
        choice = {"index": index, "delta": delta, "finish_reason": finish_reason, "logprobs": logprobs}
    else:
        choice = {"index": index, "text": text, "finish_reason": finish_reason, "logprobs": logprobs}
    obj = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": int(time.time()),
           "model": model, "choices": [choice]}  # fmt: skip
    if usage is not None:
        obj["usage"] = _usage(*usage)
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


def model_card(name: str, created: int) -> dict:
    return {"id": name, "object": "model", "created": created, "owned_by": "specserve"}


def models_list(names: list[str], created: int) -> dict:
    return {
        "object": "list",
        "data": [model_card(n, created) for n in names],
    }
