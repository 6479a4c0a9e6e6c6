"""OpenAI's chat messages as clients send them, validated at the edge: text content (a string or text parts; other
parts refused naming their `type`), and the turns of a tool loop, an assistant's `tool_calls` (content null beside
them) and a `tool` message's result with its `tool_call_id`, which the model's chat template renders where it can
(workers/models/chat.py: check_tool_turns, a 400 naming the message where it cannot)."""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal, Union

from pydantic import AfterValidator, BaseModel, ConfigDict, Discriminator, Field, Tag, ValidationInfo, field_validator
from pydantic_core import PydanticCustomError

from specserve.cluster.serve.edge import EdgeModel, Text, json_type, one_of, shown, text
from specserve.workers.models.chat import ROLES, TOOL_ROLE, ChatMessage, ToolCall

MAX_MESSAGES = 4096
MAX_PARTS = 256  # content parts of one message
MAX_CALLS = 128  # tool calls of one assistant message
SHORT = 256  # characters of a user id, a message's author name, a metadata value, a tool call's id
MAX_ARGUMENT_CHARS = 2**20  # of a tool call's arguments


class TextPart(EdgeModel):
    type: Literal["text"]
    text: Text


class OtherPart(BaseModel):
    """A content part of another type (image_url, input_audio, file, ...): refused, naming its `type`."""

    model_config = ConfigDict(extra="allow", frozen=True)

    type: Any = Field(None, validate_default=True)

    @field_validator("type")
    @classmethod
    def _refuse(cls, value: Any) -> Any:
        if value is None:
            raise PydanticCustomError("part_type", "is required (specserve takes text parts: type 'text')")
        kind = repr(shown(value)) if isinstance(value, str) else f"a {json_type(value)}"
        raise PydanticCustomError("part_type", "{kind} content parts are not supported by specserve (it takes "
                                  "text parts only: type 'text')", {"kind": kind})  # fmt: skip


def _part_kind(value: Any) -> str | None:
    if not isinstance(value, dict):
        return None
    return "<text>" if value.get("type") == "text" else "<other>"


Part = Annotated[
    Union[Annotated[TextPart, Tag("<text>")], Annotated[OtherPart, Tag("<other>")]],  # noqa: UP007 - tagged members
    Discriminator(_part_kind, custom_error_type="type", custom_error_message="must be a content part object"),
]
Content = one_of(
    "must be a string or a list of text parts (or null, beside an assistant's tool_calls)",
    string=Text,
    array=Annotated[list[Part], Field(min_length=1, max_length=MAX_PARTS, fail_fast=True)],
    null=None,
)


def _json_object(arguments: str) -> str:
    """A call's arguments: the JSON text of an object ("" is {}, as vLLM reads it)."""
    if len(arguments) > MAX_ARGUMENT_CHARS:
        raise PydanticCustomError("arguments", "is longer than {n} characters", {"n": MAX_ARGUMENT_CHARS})
    try:
        value = json.loads(arguments) if arguments.strip() else {}
    except ValueError as e:
        raise PydanticCustomError("arguments", "is not valid JSON ({why})", {"why": str(e)}) from None
    if not isinstance(value, dict):
        raise PydanticCustomError("arguments", "must be a JSON object, not a {kind}", {"kind": json_type(value)})
    return arguments


class CalledFunction(EdgeModel):
    name: text(min_length=1, max_length=SHORT)
    arguments: Annotated[Text, AfterValidator(_json_object)]


class MessageToolCall(EdgeModel):
    id: text(max_length=SHORT)
    type: Literal["function"]
    function: CalledFunction


class Message(EdgeModel):
    role: Literal[(*ROLES, TOOL_ROLE)]
    tool_calls: Annotated[list[MessageToolCall], Field(max_length=MAX_CALLS, fail_fast=True)] | None = None
    tool_call_id: text(min_length=1, max_length=SHORT) | None = Field(None, validate_default=True)
    content: Content = Field(None, validate_default=True)
    name: text(max_length=SHORT) | None = None

    @field_validator("tool_calls")
    @classmethod
    def _assistant_calls(cls, value: Any, info: ValidationInfo) -> Any:
        if value is not None and info.data.get("role") != "assistant":
            raise PydanticCustomError("tool_calls", "only assistant messages carry tool_calls")
        return value

    @field_validator("tool_call_id")
    @classmethod
    def _answers_a_call(cls, value: Any, info: ValidationInfo) -> Any:
        tool = info.data.get("role") == TOOL_ROLE
        if tool and value is None:
            raise PydanticCustomError("tool_call_id", "is required in a tool message (the id of the call it answers)")
        if not tool and value is not None:
            raise PydanticCustomError("tool_call_id", "goes only with role 'tool'")
        return value

    @field_validator("content")
    @classmethod
    def _null_beside_calls(cls, value: Any, info: ValidationInfo) -> Any:
        if value is None and not info.data.get("tool_calls"):
            raise PydanticCustomError("null_content", "is required (null only beside an assistant's tool_calls)")
        return value

    def joined_text(self) -> str:
        """The message's text; text parts joined by newlines (as other OpenAI-compatible servers do); "" for null."""
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        return "\n".join(p.text for p in self.content)

    def chat(self) -> ChatMessage:
        calls = tuple(ToolCall(c.id, c.function.name, c.function.arguments) for c in self.tool_calls or ())
        return ChatMessage(self.role, self.joined_text(), calls, self.tool_call_id)


Messages = Annotated[list[Message], Field(min_length=1, max_length=MAX_MESSAGES, fail_fast=True)]
