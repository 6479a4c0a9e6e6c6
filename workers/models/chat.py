"""Chat messages -> prompt token ids, with the served model's own chat template (a GGUF's `tokenizer.chat_template`
travels into the converted tokenizer). One function for every path (CLI, gRPC, HTTP, bench), so the same
conversation always becomes the same tokens: those `tokenizer.apply_chat_template(messages,
add_generation_prompt=True)` gives, which is what plain transformers decoding of the conversation starts from."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from specserve.workers.errors import InvalidRequestError

ROLES = ("system", "user", "assistant", "developer")
Role = Literal["system", "user", "assistant", "developer"]


@dataclass(frozen=True)
class ChatMessage:
    role: Role
    content: str


@dataclass(frozen=True)
class ChatPrompt:
    """A prompt given as a conversation: rendered with the served model's template where the tokenizer is (the
    service's `prepare`), so every edge hands over the same typed value."""

    messages: tuple[ChatMessage, ...]
    tools: tuple[dict, ...] = ()  # OpenAI's tool definitions, for a template that takes them (takes_tools)


def takes_tools(tokenizer) -> bool:
    """Whether the tokenizer's chat template renders tool definitions (it reads the `tools` variable)."""
    return "tools" in (getattr(tokenizer, "chat_template", None) or "")


def check_messages(messages: Sequence[ChatMessage], field: str = "messages") -> None:
    """InvalidRequestError naming the bad message (`field[i].role` / `field[i].content`)."""
    if not messages:
        raise InvalidRequestError(field, "must be a non-empty list of {role, content} messages")
    for i, m in enumerate(messages):
        if m.role not in ROLES:
            raise InvalidRequestError(f"{field}[{i}].role", f"unsupported role {m.role!r} (use {', '.join(ROLES)})")
        if not isinstance(m.content, str):
            raise InvalidRequestError(f"{field}[{i}].content", "must be a string")


def conversation(question: str, system: str | None = None) -> list[ChatMessage]:
    """One user turn, after an optional system message."""
    head = [ChatMessage("system", system)] if system else []
    return [*head, ChatMessage("user", question)]


def chat_text(tokenizer, messages: Sequence[ChatMessage], tools: Sequence[dict] = ()) -> str:
    """The conversation rendered by the tokenizer's chat template, ending with the assistant's generation prompt (with
    `tools`, their definitions as the template writes them). A tokenizer without a template (the demo family's, tiny
    test models) gets a plain 'role: content' transcript."""
    rows = [{"role": m.role, "content": m.content} for m in messages]
    if getattr(tokenizer, "chat_template", None):
        extra = {"tools": list(tools)} if tools else {}
        return tokenizer.apply_chat_template(rows, tokenize=False, add_generation_prompt=True, **extra)
    return "\n".join(f"{r['role']}: {r['content']}" for r in rows) + "\nassistant:"


def chat_prompt_ids(tokenizer, messages: Sequence[ChatMessage], tools: Sequence[dict] = ()) -> list[int]:
    """Token ids of the rendered conversation. A template writes any special tokens itself (`<|im_start|>`, a BOS),
    so encoding adds none, as `apply_chat_template(tokenize=True)` does; a plain transcript is encoded like any text
    prompt."""
    check_messages(messages)
    templated = bool(getattr(tokenizer, "chat_template", None))
    return list(tokenizer(chat_text(tokenizer, messages, tools), add_special_tokens=not templated)["input_ids"])
