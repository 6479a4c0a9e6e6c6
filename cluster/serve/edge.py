"""What both public edges (the OpenAI HTTP API and the SpecServe gRPC service) share: strict pydantic models for what a
client sends, errors that name the field the way the client wrote it, and the typed `Request` they hand to
`RequestPreparer.prepare` (cluster/serve/prepare.py).

Every value a client sends is checked here once (types, ranges, valid Unicode); what depends on the served model and
the app's limits (vocabulary, context, prompt length) is checked by `prepare`, which takes only the typed Request.
"""

from __future__ import annotations

import logging
import re
import uuid
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal, Union

from pydantic import (
    AfterValidator,
    BeforeValidator,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    ValidationError,
    ValidationInfo,
    model_validator,
)
from pydantic_core import PydanticCustomError

from specserve.workers.config.request import (
    MAX_LOGIT_BIAS,
    MAX_LOGIT_BIAS_VALUE,
    MAX_REPETITION_PENALTY,
    ResponseFormat,
    SpecMethod,
)
from specserve.workers.config.strict import StrictModel
from specserve.workers.errors import InvalidRequestError, SpecServeError
from specserve.workers.models.chat import ChatPrompt

log = logging.getLogger(__name__)

MAX_TEMPERATURE = 100.0  # SamplingParams' bound
UINT32_MAX = 2**32 - 1  # top_k travels to the workers as a uint32
SEED_LIMIT = 2**63  # SamplingParams' bound (torch generators take int64 seeds)
MAX_NAME_CHARS = 256  # a model name (served names are at most 128 characters)
MAX_N = 16  # choices per request (OpenAI's n)
_SHOWN_CHARS = 64  # of a client's own key or value, in an error message
_OTHERS_SHOWN = 3
_IGNORED_KEPT = 16  # names of ignored unknown fields collected per request (for the log)
_KNOWN_KEYS: dict[type, frozenset[str]] = {}  # an EdgeModel -> the keys it takes


class PayloadTooLargeError(InvalidRequestError):
    """A request body over the configured size (HTTP 413; gRPC's own message size limit answers
    RESOURCE_EXHAUSTED)."""


@dataclass(frozen=True)
class Request:
    """One generation request as an edge validated it: types and ranges checked, defaults not applied yet (a None
    sampling field: the model's default, applied by `prepare`). The
    `*_field` names are the client's own (HTTP `max_tokens`, gRPC `sampling.max_new_tokens`, ...), for the errors
    `prepare` may still raise; inside, the concept is `max_new_tokens` whatever the edge calls it."""

    model: str  # "" = the first served model
    prompt: str | tuple[int, ...] | ChatPrompt
    temperature: float | None  # None (here and below): the model's default (generation_defaults.py)
    top_p: float | None
    top_k: int | None  # 0 disables top-k
    seed: int | None
    max_new_tokens: int | None  # None: up to the context's end, within the limits (prepare.py)
    method: SpecMethod | None  # None: the model's default
    k: int | Literal["auto"] | None  # None: the model's default
    prompt_field: str = "prompt"
    max_new_tokens_field: str = "max_new_tokens"
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    include_stop_str_in_output: bool = False
    stop_field: str = "stop"
    ignore_eos: bool = False
    # logits controls (ranges checked: the types below; logit_bias's ids against the vocabulary by `prepare`)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float | None = 1.0
    min_p: float | None = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    min_tokens: int = 0
    controls_prefix: str = ""  # how the client names the controls' fields: "sampling." on gRPC
    logprobs: int | None = None  # the target's logprobs of every token and this many alternatives; None: not asked
    prompt_logprobs: int | None = None  # the prompt's tokens' too (vLLM's prompt_logprobs, echo), with as many
    response_format: ResponseFormat | None = None  # structured output, its schema checked by the grammar engine
    tool_calls: Any = None  # a chat request's forced tool call (openai_tools.ForcedCalls): its output parsed into calls
    n: int = 1  # choices, each its own request (cluster/serve/choices.py)


# The logits controls' ranges (vLLM's), for both edges.
Penalty = Annotated[float, Field(ge=-2, le=2, allow_inf_nan=False)]  # presence_penalty, frequency_penalty
RepetitionPenalty = Annotated[float, Field(gt=0, le=MAX_REPETITION_PENALTY, allow_inf_nan=False)]
MinP = Annotated[float, Field(ge=0, le=1, allow_inf_nan=False)]
Bias = Annotated[float, Field(ge=-MAX_LOGIT_BIAS_VALUE, le=MAX_LOGIT_BIAS_VALUE, allow_inf_nan=False)]
MinTokens = Annotated[int, Field(ge=0, le=UINT32_MAX)]


def _few_biases(value: Any) -> Any:
    # before pydantic makes an error per bad entry of a huge map
    if isinstance(value, dict) and len(value) > MAX_LOGIT_BIAS:
        raise PydanticCustomError("too_long", "at most {n} entries", {"n": MAX_LOGIT_BIAS})
    return value


def _token_keys(value: dict[str, float]) -> dict[int, float]:
    out = {}
    for key, bias in value.items():
        if not (key.isascii() and key.isdigit() and len(key) <= 10):
            raise PydanticCustomError("token_id", "keys must be token ids (decimal integers), got {key!r}",
                                      {"key": shown(key)})  # fmt: skip
        out[int(key)] = bias
    return out


# OpenAI's logit_bias: a JSON object, token ids as its keys
TextKeyedBias = Annotated[dict[str, Bias], BeforeValidator(_few_biases), AfterValidator(_token_keys)]
IdKeyedBias = Annotated[dict[Annotated[int, Field(ge=0)], Bias], BeforeValidator(_few_biases)]  # gRPC's map


class EdgeModel(StrictModel):
    """What a client sent: strict types (no "5" for 5, no true for 1, no 1.0 for an integer), no unknown fields.
    Lists in these models are `fail_fast` and objects refuse many unknown keys at once: pydantic's errors cost
    hundreds of bytes each, and a 4 MB body of bad elements would otherwise make a million of them.

    Parsed leniently (`parse(..., ignored=[...])`, vLLM's behaviour), unknown keys at any depth are dropped before
    validation and their names collected instead."""

    model_config = ConfigDict(strict=True)  # and StrictModel's: no unknown fields, frozen

    @model_validator(mode="before")
    @classmethod
    def _few_unknown_keys(cls, data: Any, info: ValidationInfo) -> Any:
        ignored = info.context.get("ignored") if isinstance(info.context, dict) else None
        if ignored is not None and isinstance(data, dict):
            known = cls._known_keys()
            if any(k not in known for k in data):
                for key in data:
                    if key not in known and len(ignored) < _IGNORED_KEPT:
                        ignored.append(shown(str(key)))
                return {k: v for k, v in data.items() if k in known}
        if isinstance(data, dict) and len(data) > len(cls.model_fields):
            unknown = [k for k in data if k not in cls.model_fields]
            if len(unknown) > _OTHERS_SHOWN:
                names = ", ".join(shown(str(k)) for k in unknown[:_OTHERS_SHOWN])
                raise PydanticCustomError("unknown_fields", "{n} unknown fields ({names}, ...): specserve does not "
                                          "take them", {"n": len(unknown), "names": names})  # fmt: skip
        return data

    @classmethod
    def _known_keys(cls) -> frozenset[str]:
        """The keys a client may send: the fields' names, as aliased."""
        known = _KNOWN_KEYS.get(cls)
        if known is None:
            known = _KNOWN_KEYS[cls] = frozenset(f.alias or name for name, f in cls.model_fields.items())
        return known


def _valid_unicode(text: str) -> str:
    # JSON's "\ud800" escapes decode to lone surrogates: no tokenizer, template or UTF-8 encoder takes them.
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise PydanticCustomError(
            "unicode", "is not valid Unicode (a lone UTF-16 surrogate at character {pos})", {"pos": e.start}
        ) from None
    return text


def text(min_length: int = 0, max_length: int | None = None) -> Any:
    """A string of valid Unicode (no lone surrogates) of a bounded length."""
    return Annotated[str, Field(min_length=min_length, max_length=max_length), AfterValidator(_valid_unicode)]


Text = text()


def json_type(value: Any) -> str:
    """The JSON type of a parsed value (bool apart from number: Python's bool is an int)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int | float):
        return "integer" if isinstance(value, int) else "number"
    return {str: "string", list: "array", dict: "object"}.get(type(value), type(value).__name__)


def one_of(expected: str, **members: Any) -> Any:
    """A union chosen by the JSON type of the value (members keyed by json_type), so that an error names the field
    and not pydantic's union members; `expected` is the message for any other type."""

    def kind(value: Any) -> str | None:
        t = json_type(value)
        return f"<{t}>" if t in members else None

    union = Union[tuple(Annotated[tp, Tag(f"<{t}>")] for t, tp in members.items())]  # noqa: UP007 - from a tuple
    return Annotated[union, Discriminator(kind, custom_error_type="type", custom_error_message=expected)]


def shown(value: str) -> str:
    """A client's string, made safe to put in an error message: cut to a few dozen characters, escapes for what is
    not printable (lone surrogates would break the JSON encoder of the error response)."""
    cut = value[:_SHOWN_CHARS] + ("..." if len(value) > _SHOWN_CHARS else "")
    return cut if cut.isprintable() else repr(cut)[1:-1]


def field_name(loc: tuple, kind: str) -> str:
    """pydantic's error location as the client wrote it: `messages[0].content[1].type`. Tags of `one_of` unions
    ('<string>') and dict-key markers are pydantic's, not the client's; an unknown key is always shown."""
    out = ""
    for i, part in enumerate(loc):
        last = i == len(loc) - 1
        if isinstance(part, int):
            out += f"[{part}]"
        elif last and kind == "extra_forbidden":
            out += ("." if out else "") + shown(part)
        elif part.startswith("<") or part == "[key]":
            continue
        else:
            out += ("." if out else "") + part
    return out or "body"


_MESSAGES = {
    "extra_forbidden": "unknown field (specserve does not take it)",
    "missing": "is required",
    "string_unicode": "is not valid Unicode (a lone UTF-16 surrogate)",
    "model_type": "must be an object",
    "model_attributes_type": "must be an object",
}


def parse(model: type[EdgeModel], data: Any, ignored: list[str] | None = None) -> Any:
    """Validate what a client sent into `model`; an InvalidRequestError naming the first bad field as the client
    wrote it (a few others after it). With `ignored` (a list), unknown fields are not errors: they are dropped and
    their names appended to it (the first few)."""
    try:
        return model.model_validate(data, context=None if ignored is None else {"ignored": ignored})
    except ValidationError as e:
        by_field: dict[str, list[str]] = {}
        for err in e.errors(include_url=False, include_input=False):
            msg = _MESSAGES.get(err["type"], err["msg"])
            by_field.setdefault(field_name(err["loc"], err["type"]), []).append(msg)
        (first, msgs), *others = by_field.items()
        message = "; ".join(dict.fromkeys(msgs))
        if others:
            more = len(others) - _OTHERS_SHOWN
            message += " (also: " + "; ".join(f"{f}: {m[0]}" for f, m in others[:_OTHERS_SHOWN])
            message += f"; and {more} more)" if more > 0 else ")"
        raise InvalidRequestError(first, message) from None


def unsupported(neutral: str) -> PydanticCustomError:
    """The error for an OpenAI field that specserve takes only at its neutral value (anything else would silently
    change the output)."""
    return PydanticCustomError("unsupported", "is not supported by specserve: omit it (or send {neutral})",
                               {"neutral": neutral})  # fmt: skip


# Hard caps on stop sequences at the edge (before anything is built of them); the app's limits may be lower.
MAX_STOPS = 64
MAX_STOP_CHARS = 1024

REQUEST_ID_HEADER = "x-request-id"
_REQUEST_ID = re.compile(r"[A-Za-z0-9._:=+/-]{1,128}")


def request_id(sent: str | None) -> str:
    """The request's id: the client's `x-request-id` (HTTP header or gRPC metadata), checked because it reaches logs
    and other systems, or a fresh one. It names the request in every log line, its responses and its stream."""
    if not sent:
        return uuid.uuid4().hex
    if not _REQUEST_ID.fullmatch(sent):
        raise InvalidRequestError(REQUEST_ID_HEADER, "must be 1 to 128 letters, digits or . _ : = + / - (leave it out "
                                  "and one is made)")  # fmt: skip
    return sent


def client_message(error: BaseException) -> str:
    """What a client is told of an error: a specserve error's own message; anything else is a bug, logged here with
    its traceback and reported without internals (no exception class names, no reprs)."""
    if isinstance(error, SpecServeError):
        return str(error)
    log.error("internal error answering a request", exc_info=error)
    return "internal error (the server's log has the details)"
