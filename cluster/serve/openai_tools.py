"""OpenAI's `tools` / `tool_choice` on chat completions (issue 43 item 6): tool definitions rendered by a chat template
that takes them, and a call forced through the grammar: `tool_choice` naming a function (the output is its arguments,
valid against its `parameters`) or `"required"` (a JSON array of {"name", "parameters"} calls, vLLM's form), parsed
into the response's `tool_calls`. `"auto"` would need a parser of each model's own tool-call syntax: refused, naming
`tool_choice`; `"none"` (or no tools) leaves the request as it is. A model whose template takes no tools (SmolLM2's
plain ChatML) refuses `tools` (prepare.py)."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, replace
from typing import Annotated, Any, Literal

from pydantic import Field

from specserve.cluster.serve.edge import EdgeModel, Request, Text, one_of
from specserve.cluster.serve.response_formats import enforceable
from specserve.workers.config import ResponseFormat
from specserve.workers.errors import InvalidRequestError

MAX_TOOLS = 128
ANY_OBJECT = {"type": "object", "additionalProperties": True}  # a function without parameters takes any object


class FunctionSpec(EdgeModel):
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
    description: Text | None = None
    parameters: dict | None = None  # a JSON schema of the arguments
    strict: bool | None = None  # the arguments are always enforced


class Tool(EdgeModel):
    type: Literal["function"]
    function: FunctionSpec


class ChosenFunction(EdgeModel):
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]


class NamedChoice(EdgeModel):
    type: Literal["function"]
    function: ChosenFunction


Tools = Annotated[list[Tool], Field(max_length=MAX_TOOLS, fail_fast=True)]
ToolChoice = one_of('must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}}',
                    string=Literal["none", "auto", "required"], object=NamedChoice, null=None)  # fmt: skip


@dataclass(frozen=True)
class ForcedCalls:
    """How the output becomes tool calls: `name` set, the arguments of that function; else a list of calls. `auto`:
    the model would choose, which specserve cannot parse (refused by prepare, after the template's check)."""

    name: str | None
    auto: bool = False


def forced(tools: list[Tool] | None, choice: Any) -> tuple[tuple[dict, ...], ForcedCalls | None, ResponseFormat | None]:
    """(tool definitions for the template, how to parse the output, the grammar that forces it) of a chat body; an
    InvalidRequestError naming tool_choice when the choice cannot be honoured."""
    if not tools or choice == "none":
        if isinstance(choice, NamedChoice) or choice == "required":
            raise InvalidRequestError("tool_choice", "names a tool call, and the request has no tools")
        return (), None, None
    definitions = tuple(t.model_dump(exclude_none=True) for t in tools)
    if choice is None or choice == "auto":  # refused by prepare, once the model's template took the tools
        return definitions, ForcedCalls(None, auto=True), None
    params = {t.function.name: t.function.parameters or ANY_OBJECT for t in tools}
    if isinstance(choice, NamedChoice):
        if choice.function.name not in params:
            raise InvalidRequestError("tool_choice.function.name", f"{choice.function.name!r} is not among the tools")
        schema, calls = params[choice.function.name], ForcedCalls(choice.function.name)
    else:
        one = [{"type": "object", "properties": {"name": {"const": name}, "parameters": p},
                "required": ["name", "parameters"]} for name, p in params.items()]  # fmt: skip
        schema, calls = {"type": "array", "items": {"anyOf": one}, "minItems": 1}, ForcedCalls(None)
    try:
        fmt = enforceable(ResponseFormat(type="json_schema", json_schema=json.dumps(schema, separators=(",", ":"))))
    except ValueError as e:  # PydanticCustomError: a parameters schema the engine cannot enforce
        raise InvalidRequestError("tools", f"a function's parameters: {e}") from None
    return definitions, calls, fmt


def with_tool_calls(response: dict, calls: ForcedCalls) -> dict:
    """An OpenAI chat.completion whose whole outputs became `tool_calls` (content null, finish_reason
    "tool_calls"); an output cut short (finish_reason "length") stays text."""
    for choice in response["choices"]:
        message = choice["message"]
        if choice["finish_reason"] != "stop":
            continue
        try:
            parsed = json.loads(message["content"])
        except ValueError:
            continue
        made = [(calls.name, parsed)] if calls.name else [(c["name"], c["parameters"]) for c in parsed]
        message["tool_calls"] = [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                                  "function": {"name": name, "arguments": json.dumps(args)}}
                                 for name, args in made]  # fmt: skip
        message["content"], choice["finish_reason"] = None, "tool_calls"
    return response


def with_forced_call(request: Request, calls: ForcedCalls, fmt: ResponseFormat | None, stream: bool) -> Request:
    """The request answering with a forced tool call: the call's grammar as its response_format."""
    if calls.auto:
        return replace(request, tool_calls=calls)
    if request.response_format is not None:
        raise InvalidRequestError("response_format", "goes with free text: a forced tool call brings its own grammar")
    if stream:
        raise InvalidRequestError("stream", "a forced tool call is answered whole: send stream: false")
    return replace(request, response_format=fmt, tool_calls=calls)


def check_auto(request: Request) -> None:
    """`tool_choice: "auto"` (the default with tools), refused once the template took the tools."""
    if request.tool_calls is not None and request.tool_calls.auto:
        raise InvalidRequestError("tool_choice", 'specserve forces tool calls through the grammar: send "required" '
                                  'or {"type": "function", "function": {"name": ...}} (or "none")')  # fmt: skip
