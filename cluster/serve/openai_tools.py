"""OpenAI's `tools` / `tool_choice` on chat completions (issue 43 item 6): tool definitions rendered by a chat template
that takes them, and how the output becomes `tool_calls`. A call forced through the grammar: `tool_choice` naming a
function (the output is its arguments, valid against its `parameters`) or `"required"` (a JSON array of {"name",
"parameters"} calls, vLLM's form). `"auto"` (the default with tools): the model answers freely, and an output that
writes its calls in the template's syntax is parsed into them (Hermes' `<tool_call>{"name", "arguments"}</tool_call>`,
as vLLM's hermes parser reads it: Qwen and Hermes templates); a template with another syntax refuses it,
naming `tool_choice`. Streamed, the calls go out whole at the end (ToolStream). `"none"` (or no tools) leaves the
request as it is. A model whose template takes no tools (SmolLM2's plain ChatML) refuses `tools` (prepare.py)."""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, replace
from typing import Annotated, Any, Literal

from pydantic import Field

from specserve.cluster.serve.edge import EdgeModel, Request, Text, one_of
from specserve.cluster.serve.response_formats import enforceable
from specserve.workers.config.request import ResponseFormat
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
    the model chooses, and calls it writes in Hermes' syntax are parsed (hermes_calls)."""

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
    if choice is None or choice == "auto":  # prepare checks the template writes calls that hermes_calls parses
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
    """An OpenAI chat.completion whose outputs became `tool_calls` (finish_reason "tool_calls"): a forced call's whole
    output (content null), or the calls an `auto` output wrote (content what came before them, or null); an output
    cut short (finish_reason "length") or without calls stays text."""
    for choice in response["choices"]:
        message = choice["message"]
        found = parsed_calls(calls, message["content"]) if choice["finish_reason"] == "stop" else None
        if found is not None:
            message["content"], made = found
            message["tool_calls"], choice["finish_reason"] = [_call(*call) for call in made], "tool_calls"
    return response


def parsed_calls(calls: ForcedCalls, text: str) -> tuple[str | None, list[tuple[str, str]]] | None:
    """(content, [(name, arguments as JSON text)]) of a whole output that made calls: `auto`'s Hermes calls
    (hermes_calls), a forced call's arguments or list of calls (content None); None: it stays text."""
    if calls.auto:
        return hermes_calls(text)
    try:
        parsed = json.loads(text)
    except ValueError:
        return None
    made = [(calls.name, parsed)] if calls.name else [(c["name"], c["parameters"]) for c in parsed]
    return None, [(name, json.dumps(args)) for name, args in made]


def _call(name: str, arguments: str) -> dict:
    function = {"name": name, "arguments": arguments}
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": function}


_TAG = "<tool_call>"
_HERMES_CALL = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)


def hermes_calls(text: str) -> tuple[str | None, list[tuple[str, str]]] | None:
    """(the text before the first call, or None where it is blank; [(name, arguments as JSON text)]) of an output
    that writes Hermes' `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` calls, as vLLM's hermes parser
    reads them (the last one may lack its closing tag; what follows the calls is dropped); None when it writes none,
    or one that is no such JSON object: the output stays text."""
    if "<tool_call>" not in text:
        return None
    made = []
    for closed, unclosed in _HERMES_CALL.findall(text):
        try:
            call = json.loads(closed or unclosed)
        except ValueError:
            return None
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return None
        made.append((call["name"], json.dumps(call.get("arguments", {}), ensure_ascii=False)))
    content = text[: text.index("<tool_call>")]
    return (content if content.strip() else None), made


class ToolStream:
    """One choice of a streamed answer that may call tools. `auto`: its text sent as it comes, but held back while it
    could still begin `<tool_call>`; from the first call on, kept to the end. A forced call: all kept to the end. At
    the end the whole output's calls are parsed (parsed_calls, as unstreamed) and sent as one delta of whole
    `tool_calls` with finish_reason "tool_calls"; an output whose calls do not parse (or cut at max_tokens) sends what
    was kept as text, with its own finish_reason."""

    def __init__(self, calls: ForcedCalls) -> None:
        self.calls = calls
        self.output = ""  # everything so far
        self.held = ""  # not sent yet
        self.calling = not calls.auto  # a call has begun: the rest is held to the end

    def step(self, text: str, finish_reason: str | None) -> tuple[str, str | None, list[dict] | None]:
        """A chunk's (text, finish_reason) -> (the text to send, its finish_reason, tool_calls deltas or None)."""
        self.output += text
        out = self._release(text)
        if finish_reason is None:
            return out, None, None
        found = parsed_calls(self.calls, self.output) if self.calling and finish_reason == "stop" else None
        if found is None:
            out, self.held = out + self.held, ""
            return out, finish_reason, None
        return out, "tool_calls", [{"index": i, **_call(name, args)} for i, (name, args) in enumerate(found[1])]

    def _release(self, text: str) -> str:
        if self.calling:
            self.held += text
            return ""
        held = self.held + text
        start = held.find(_TAG)
        if start >= 0:
            self.calling, self.held = True, held[start:]
            return held[:start]
        keep = next((n for n in range(min(len(_TAG) - 1, len(held)), 0, -1) if held.endswith(_TAG[:n])), 0)
        self.held = held[len(held) - keep :]
        return held[: len(held) - keep]


def with_forced_call(request: Request, calls: ForcedCalls, fmt: ResponseFormat | None) -> Request:
    """The request answering with tool calls (streamed or not: ToolStream): a forced call's grammar as its
    response_format; `auto` as it is."""
    if request.response_format is not None:
        raise InvalidRequestError("response_format", "goes with free text: a tool call brings its own syntax")
    return replace(request, tool_calls=calls) if calls.auto else replace(request, response_format=fmt, tool_calls=calls)


def check_auto(request: Request, parses_calls: bool) -> None:
    """`tool_choice: "auto"` (the default with tools), once the template took the tools: refused where the template's
    call syntax is not one specserve parses (parses_calls: it writes Hermes' <tool_call>)."""
    calls = request.tool_calls
    if calls is not None and calls.auto and not parses_calls:
        raise InvalidRequestError("tool_choice", "this model's chat template writes tool calls in a syntax specserve "
                                  "does not parse (it parses Hermes' <tool_call>): send \"required\" or a named "
                                  "function (forced through the grammar), or \"none\"")  # fmt: skip
