"""Chat messages -> prompt token ids, with the served model's own chat template (a GGUF's `tokenizer.chat_template`
travels into the converted tokenizer). One function for every path (CLI, gRPC, HTTP, bench), so the same
conversation always becomes the same tokens: those `tokenizer.apply_chat_template(messages,
add_generation_prompt=True)` gives, which is what plain transformers decoding of the conversation starts from."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from specserve.workers.errors import InvalidRequestError

ROLES = ("system", "user", "assistant", "developer")
Role = Literal["system", "user", "assistant", "developer"]
TOOL_ROLE = "tool"  # a tool's result (OpenAI's chat history), for a template that renders them
_TOOL_ROLE_TEST = re.compile(r"""['"]tool['"]""")  # a template that tests a message's role against 'tool'


@dataclass(frozen=True)
class ToolCall:
    """A call an assistant turn made (OpenAI's `tool_calls[]`): arguments as the JSON text of an object."""

    id: str
    name: str
    arguments: str


@dataclass(frozen=True)
class ChatMessage:
    role: Role | Literal["tool"]
    content: str
    tool_calls: tuple[ToolCall, ...] = ()  # an assistant turn's calls
    tool_call_id: str | None = None  # a tool turn: the call whose result it is


@dataclass(frozen=True)
class ChatPrompt:
    """A prompt given as a conversation: rendered with the served model's template where the tokenizer is (the
    service's `prepare`), so every edge hands over the same typed value."""

    messages: tuple[ChatMessage, ...]
    tools: tuple[dict, ...] = ()  # OpenAI's tool definitions, for a template that takes them (takes_tools)
    template_kwargs: dict[str, Any] = field(default_factory=dict)  # to the template (vLLM's chat_template_kwargs)


def _template(tokenizer) -> str:
    """The chat template's text (every named template's, where the tokenizer has several)."""
    template = getattr(tokenizer, "chat_template", None) or ""
    return "\n".join(map(str, template.values())) if isinstance(template, dict) else str(template)


def takes_tools(tokenizer) -> bool:
    """Whether the tokenizer's chat template renders tool definitions (it reads the `tools` variable)."""
    return "tools" in _template(tokenizer)


def writes_hermes_calls(tokenizer) -> bool:
    """Whether the template has the model write its calls as Hermes' `<tool_call>{"name", "arguments"}</tool_call>`
    (Qwen2.5 / Qwen3, Hermes and others): the syntax `tool_choice: "auto"` parses."""
    return takes_tools(tokenizer) and "<tool_call>" in _template(tokenizer)


def check_tool_turns(tokenizer, messages: Sequence[ChatMessage], field: str = "messages") -> None:
    """InvalidRequestError naming the message when the template cannot render a turn of a tool loop: an assistant's
    calls (it reads no `tool_calls`) or a tool's result (it tests no role against 'tool'); SmolLM2's plain ChatML
    would print them as text it was never trained on."""
    template = _template(tokenizer)
    for i, m in enumerate(messages):
        if m.tool_calls and "tool_calls" not in template:
            raise InvalidRequestError(f"{field}[{i}].tool_calls", "this model's chat template renders no tool calls "
                                      "(send the conversation without tool turns, or serve a model whose template "
                                      "renders them)")  # fmt: skip
        if m.role == TOOL_ROLE and not _TOOL_ROLE_TEST.search(template):
            raise InvalidRequestError(f"{field}[{i}].role", "this model's chat template renders no tool results "
                                      "(send the conversation without tool turns, or serve a model whose template "
                                      "renders them)")  # fmt: skip


def check_messages(messages: Sequence[ChatMessage], field: str = "messages") -> None:
    """InvalidRequestError naming the bad message (`field[i].role` / `field[i].content`)."""
    if not messages:
        raise InvalidRequestError(field, "must be a non-empty list of {role, content} messages")
    for i, m in enumerate(messages):
        if m.role not in ROLES and m.role != TOOL_ROLE:
            raise InvalidRequestError(f"{field}[{i}].role", f"unsupported role {m.role!r} (use {', '.join(ROLES)})")
        if not isinstance(m.content, str):
            raise InvalidRequestError(f"{field}[{i}].content", "must be a string")


def conversation(question: str, system: str | None = None) -> list[ChatMessage]:
    """One user turn, after an optional system message."""
    head = [ChatMessage("system", system)] if system else []
    return [*head, ChatMessage("user", question)]


def _row(m: ChatMessage, parsed_arguments: bool) -> dict:
    """A message as templates take it (vLLM's form): an assistant's calls with their arguments as an object, as
    Hugging Face's tool-use templates expect (or as the JSON text, for a template that concatenates it)."""
    row = {"role": m.role, "content": m.content}
    if m.tool_calls:
        row["tool_calls"] = [{"id": c.id, "type": "function", "function": {
            "name": c.name, "arguments": json.loads(c.arguments or "{}") if parsed_arguments else c.arguments}}
            for c in m.tool_calls]  # fmt: skip
    if m.tool_call_id is not None:
        row["tool_call_id"] = m.tool_call_id
    return row


def _template_kwargs(tokenizer, kwargs: dict[str, Any]) -> dict[str, Any]:
    """A request's chat_template_kwargs, the template's variables; InvalidRequestError naming one that is
    apply_chat_template's own argument (the conversation, tools, tokenizing, another template), which specserve
    sets."""
    import inspect

    own = inspect.signature(tokenizer.apply_chat_template).parameters
    for key in kwargs:
        if key in own and own[key].kind is not inspect.Parameter.VAR_KEYWORD:
            raise InvalidRequestError(f"chat_template_kwargs.{key}", "is an argument of apply_chat_template that "
                                      "specserve sets, not a template variable")  # fmt: skip
    return dict(kwargs)


def chat_text(tokenizer, messages: Sequence[ChatMessage], tools: Sequence[dict] = (),
              template_kwargs: dict[str, Any] | None = None) -> str:  # fmt: skip
    """The conversation rendered by the tokenizer's chat template, ending with the assistant's generation prompt (with
    `tools`, their definitions as the template writes them; `template_kwargs`, variables the template reads, as
    Qwen3's `enable_thinking`). A tokenizer without a template (the demo family's, tiny test models) gets a plain
    'role: content' transcript. A template that raises (its own checks: roles out of order, a turn it cannot render)
    refuses the messages."""
    from jinja2 import TemplateError

    if not getattr(tokenizer, "chat_template", None):
        return "\n".join(f"{m.role}: {m.content}" for m in messages) + "\nassistant:"
    extra = _template_kwargs(tokenizer, template_kwargs or {})
    if tools:
        extra["tools"] = list(tools)
    try:
        try:
            rows = [_row(m, parsed_arguments=True) for m in messages]
            return tokenizer.apply_chat_template(rows, tokenize=False, add_generation_prompt=True, **extra)
        except TypeError:  # a template that adds the arguments to a string: they are text there
            if not any(m.tool_calls for m in messages):
                raise
            rows = [_row(m, parsed_arguments=False) for m in messages]
            return tokenizer.apply_chat_template(rows, tokenize=False, add_generation_prompt=True, **extra)
    except TemplateError as e:
        raise InvalidRequestError("messages", f"the model's chat template refused them: {e}") from None


def chat_prompt_ids(tokenizer, messages: Sequence[ChatMessage], tools: Sequence[dict] = (),
                    template_kwargs: dict[str, Any] | None = None) -> list[int]:  # fmt: skip
    """Token ids of the rendered conversation. A template writes any special tokens itself (`<|im_start|>`, a BOS),
    so encoding adds none, as `apply_chat_template(tokenize=True)` does; a plain transcript is encoded like any text
    prompt."""
    check_messages(messages)
    check_tool_turns(tokenizer, messages)
    templated = bool(getattr(tokenizer, "chat_template", None))
    text = chat_text(tokenizer, messages, tools, template_kwargs)
    return list(tokenizer(text, add_special_tokens=not templated)["input_ids"])
