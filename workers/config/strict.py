"""The one base of every validated configuration and request object (`StrictModel`: unknown fields refused,
instances frozen), and `validate`, which turns raw user data into one with an error naming the field."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, ValidationError

from specserve.workers.errors import InvalidRequestError


class StrictModel(BaseModel):
    """Refuses unknown fields (a misspelt key is an error, never ignored) and is frozen (shared freely)."""

    model_config = ConfigDict(extra="forbid", frozen=True)


def _field_name(loc: tuple, model: type[BaseModel]) -> str:
    # Union members add segments such as "constrained-int" or "literal['auto']": not field names.
    parts = [str(p) for p in loc if not (isinstance(p, str) and ("-" in p or "[" in p))]
    return ".".join(parts) or model.__name__


def validate(model: type[BaseModel], data: dict) -> BaseModel:
    """Validate raw user data into `model`, turning pydantic's errors into one InvalidRequestError naming the
    first bad field (alternatives of a union are joined with 'or'; other bad fields are listed after it)."""
    try:
        return model.model_validate(data)
    except ValidationError as e:
        by_field: dict[str, list[str]] = {}
        for err in e.errors():
            by_field.setdefault(_field_name(err["loc"], model), []).append(err["msg"].removeprefix("Value error, "))
        (first, msgs), *others = by_field.items()
        message = ", or ".join(msgs)
        if others:
            message += " (also: " + "; ".join(f"{name}: {', or '.join(m)}" for name, m in others) + ")"
        raise InvalidRequestError(first, message) from None
