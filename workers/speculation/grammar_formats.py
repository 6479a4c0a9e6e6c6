"""A response_format as the grammar engine (xgrammar) takes it: the schema text and options both the edges' check and
the target worker's compiler use (grammar.py). Torch-free at import (xgrammar is imported where a format is checked),
so the ingress's prepare step stays torch-free."""

from __future__ import annotations

import json
from functools import lru_cache

from specserve.workers.config.request import ResponseFormat
from specserve.workers.errors import InvalidRequestError

FIELD = "response_format"
MAX_WHITESPACE = 16  # whitespace characters between two JSON tokens: stops a model from spacing forever


def xgrammar():
    import xgrammar  # imported where a request asks for a grammar: a process without such requests never loads it

    return xgrammar


def schema_text(fmt: ResponseFormat) -> str:
    if fmt.type == "json_object":  # any JSON object (extra properties allowed: xgrammar's strict mode refuses them)
        return json.dumps({"type": "object", "additionalProperties": True})
    return fmt.json_schema


def not_enforceable(error: Exception) -> InvalidRequestError:
    return InvalidRequestError(f"{FIELD}.json_schema", f"is not a JSON schema specserve can enforce: {error}")


@lru_cache(maxsize=256)
def check_format(fmt: ResponseFormat) -> None:
    """Raise InvalidRequestError naming response_format when the grammar engine cannot take `fmt` (an invalid or
    unsupported schema). Needs no tokenizer: the edges call it once per request."""
    try:
        json.loads(schema_text(fmt))
        xgrammar().Grammar.from_json_schema(schema_text(fmt), any_whitespace=True, max_whitespace_cnt=MAX_WHITESPACE)
    except (ValueError, RuntimeError, TypeError) as e:
        raise not_enforceable(e) from None
