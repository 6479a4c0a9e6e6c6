"""Structured output at the edges: OpenAI's `response_format` ({"type": "text"}, {"type": "json_object"}, {"type":
"json_schema", "json_schema": {"name", "schema", ...}}) and gRPC's `sampling.response_format`, validated once into the
internal ResponseFormat, whose schema the grammar engine has compiled once (workers/speculation/grammar.py): a schema it
cannot enforce is a 400 / INVALID_ARGUMENT naming the field, never a failure on a worker."""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal, Union

from pydantic import AfterValidator, Discriminator, Field, Tag, model_validator
from pydantic_core import PydanticCustomError

from specserve.cluster.serve.edge import EdgeModel, Text, text
from specserve.workers.config.request import MAX_SCHEMA_CHARS, ResponseFormat
from specserve.workers.errors import InvalidRequestError
from specserve.workers.speculation.grammar_formats import check_format

TYPES = (
    '{"type": "text"}, {"type": "json_object"} or {"type": "json_schema", "json_schema": {"name": ..., "schema": ...}}'
)


def enforceable(fmt: ResponseFormat | None) -> ResponseFormat | None:
    """`fmt` once the grammar engine took it (a PydanticCustomError otherwise, which the edge names)."""
    if fmt is None:
        return None
    if len(fmt.json_schema) > MAX_SCHEMA_CHARS:
        raise PydanticCustomError("schema", "is longer than {n} characters as JSON", {"n": MAX_SCHEMA_CHARS})
    try:
        check_format(fmt)
    except InvalidRequestError as e:
        raise PydanticCustomError("schema", "{why}", {"why": e.message}) from None
    return fmt


def _schema(value: dict) -> ResponseFormat:
    return enforceable(ResponseFormat(type="json_schema", json_schema=json.dumps(value, separators=(",", ":"))))


class JsonSchemaSpec(EdgeModel):
    name: text(min_length=1, max_length=64)  # OpenAI's: required, names the schema (not used)
    description: Text | None = None
    schema_: Annotated[dict, AfterValidator(_schema)] = Field(alias="schema")
    strict: bool | None = None  # specserve always enforces the schema


class TextFormat(EdgeModel):
    type: Literal["text"]


class JsonObjectFormat(EdgeModel):
    type: Literal["json_object"]


class JsonSchemaFormat(EdgeModel):
    type: Literal["json_schema"]
    json_schema: JsonSchemaSpec


def _kind(value: Any) -> str | None:
    if not isinstance(value, dict):
        return None
    return {"text": "<text>", "json_object": "<object>", "json_schema": "<schema>"}.get(value.get("type"))


OpenAIResponseFormat = Annotated[
    Union[  # noqa: UP007 - tagged members
        Annotated[TextFormat, Tag("<text>")],
        Annotated[JsonObjectFormat, Tag("<object>")],
        Annotated[JsonSchemaFormat, Tag("<schema>")],
    ],
    Discriminator(_kind, custom_error_type="response_format", custom_error_message=f"must be {TYPES}"),
]


def from_openai(value: TextFormat | JsonObjectFormat | JsonSchemaFormat | None) -> ResponseFormat | None:
    """The validated OpenAI field as the internal format (None: free text)."""
    if isinstance(value, JsonSchemaFormat):
        return value.json_schema.schema_
    if isinstance(value, JsonObjectFormat):
        return ResponseFormat(type="json_object")
    return None


class GrpcResponseFormat(EdgeModel):
    """gRPC's sampling.response_format: type "" or "text" is free text."""

    type: Literal["", "text", "json_object", "json_schema"]
    json_schema: str  # the schema as JSON text, with type "json_schema"

    @model_validator(mode="after")
    def _enforceable(self) -> GrpcResponseFormat:
        self.internal()
        return self

    def internal(self) -> ResponseFormat | None:
        if self.type in ("", "text", "json_object"):
            if self.json_schema:
                raise PydanticCustomError("schema", "json_schema goes with type 'json_schema' only")
            return ResponseFormat(type="json_object") if self.type == "json_object" else None
        try:
            schema = json.loads(self.json_schema)
        except (RecursionError, ValueError):  # JSONDecodeError is a ValueError
            raise PydanticCustomError("schema", "json_schema is not valid JSON") from None
        if not isinstance(schema, dict):
            raise PydanticCustomError("schema", "json_schema must be a JSON object: the schema")
        return _schema(schema)
