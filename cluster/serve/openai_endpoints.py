"""vLLM's small endpoints beside the OpenAI API: POST /tokenize and POST /detokenize (the bodies, validated at the
edge like the rest)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field

from specserve.cluster.serve.edge import MAX_NAME_CHARS, EdgeModel, Text, parse, text
from specserve.cluster.serve.openai_messages import Messages
from specserve.cluster.serve.openai_tools import Tools
from specserve.workers.errors import InvalidRequestError
from specserve.workers.models.chat import ChatPrompt


class TokenizeBody(EdgeModel):
    """vLLM's POST /tokenize: a prompt, or chat messages rendered with the model's template (with its generation
    prompt, as a chat completion renders them)."""

    model: text(max_length=MAX_NAME_CHARS) | None = None
    prompt: Text | None = None
    messages: Messages | None = None
    tools: Tools | None = None  # rendered with the messages, as a chat completion's
    chat_template_kwargs: dict[str, Any] | None = None  # likewise
    add_generation_prompt: Literal[True] | None = None  # the chat completion's rendering, always


class DetokenizeBody(EdgeModel):
    """vLLM's POST /detokenize."""

    model: text(max_length=MAX_NAME_CHARS) | None = None
    tokens: Annotated[list[int], Field(fail_fast=True)]


def parse_tokenize(body: Any, ignored: list[str] | None = None) -> tuple[str, str | ChatPrompt]:
    """(model, the prompt or conversation); exactly one of prompt and messages. Unknown fields are refused, or
    ignored into `ignored` when it is a list."""
    parsed: TokenizeBody = parse(TokenizeBody, body, ignored)
    if (parsed.prompt is None) == (parsed.messages is None):
        raise InvalidRequestError("prompt", "send exactly one of prompt and messages")
    if parsed.tools and parsed.messages is None:
        raise InvalidRequestError("tools", "go with messages")
    if parsed.messages is not None:
        tools = tuple(t.model_dump(exclude_none=True) for t in parsed.tools or ())
        kwargs = dict(parsed.chat_template_kwargs or {})
        return parsed.model or "", ChatPrompt(tuple(m.chat() for m in parsed.messages), tools, kwargs)
    return parsed.model or "", parsed.prompt


def parse_detokenize(body: Any, ignored: list[str] | None = None) -> tuple[str, list[int]]:
    parsed: DetokenizeBody = parse(DetokenizeBody, body, ignored)
    return parsed.model or "", parsed.tokens
