"""vLLM's `speculative_config` in a model's config (and `specserve serve --speculative-config JSON`), translated once,
at the edge, into specserve's own keys, so a vLLM user's block pastes over; SGLang's flags are mapped in
docs/speculative-config.md.

    {"method": "eagle3", "model": HEAD_DIR, "num_speculative_tokens": 3}  ->  draft: HEAD_DIR, k: auto, max_k: 3

`num_speculative_tokens` becomes the most tokens the goodput planner may draft a round (`max_k`), as vLLM's dynamic
speculation treats it; k stays 'auto'. Keys vLLM has that specserve has no use for are refused by name, never dropped
silently.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, ValidationError

from specserve.workers.config.request import MAX_K
from specserve.workers.config.strict import StrictModel

METHODS = ("eagle3", "ngram", "draft_model")


class VllmSpeculativeConfig(StrictModel):
    """The keys of vLLM's speculative_config that specserve takes."""

    method: Literal["eagle3", "ngram", "draft_model"] | None = None
    model: str | None = Field(None, min_length=1)
    num_speculative_tokens: int | None = Field(None, ge=1, le=MAX_K)
    draft_tensor_parallel_size: int | None = Field(None, ge=1, le=64)
    prompt_lookup_min: int | None = Field(None, ge=1, le=16)
    prompt_lookup_max: int | None = Field(None, ge=1, le=16)


def _parsed(block: Any) -> VllmSpeculativeConfig:
    if not isinstance(block, dict):
        raise ValueError(f"speculative_config must be an object of vLLM's keys, got {type(block).__name__}")
    try:
        return VllmSpeculativeConfig.model_validate(block)
    except ValidationError as err:
        first = err.errors()[0]
        key = ".".join(str(part) for part in first["loc"]) or "speculative_config"
        if first["type"] == "extra_forbidden":
            known = ", ".join(VllmSpeculativeConfig.model_fields)
            raise ValueError(f"speculative_config.{key}: not a key specserve takes (it takes {known})") from None
        if key == "method":
            raise ValueError(f"speculative_config.method: {first['input']!r} is not one specserve runs (it runs "
                             f"{', '.join(METHODS)}; EAGLE-1 heads and MTP are not supported)") from None  # fmt: skip
        raise ValueError(f"speculative_config.{key}: {first['msg']}") from None


def _draft(spec: VllmSpeculativeConfig) -> str | None:
    if spec.method == "ngram":
        if spec.model is not None:
            raise ValueError("speculative_config.model: method 'ngram' (prompt lookup) takes no model")
        return "ngram"
    if spec.method == "draft_model" and spec.model is None:
        raise ValueError("speculative_config.model: method 'draft_model' needs the draft model's path or name")
    if spec.method == "eagle3":
        return spec.model or "eagle"  # none given: the head packaged for the target
    return spec.model  # no method: the draft field tells a head's directory from a draft model's


def apply_speculative_config(fields: dict[str, Any], block: Any) -> dict[str, Any]:
    """A model's raw config fields with `block` (vLLM's keys) translated into specserve's: draft, max_k, ngram,
    draft_pool.tensor_parallel_size. Raises ValueError naming the key for an unknown key, a bad value, or a key
    that the model's own config also sets."""
    spec = _parsed(block)
    out = dict(fields)
    translated: dict[str, Any] = {}
    draft = _draft(spec)
    if draft is not None:
        translated["draft"] = draft
    if spec.num_speculative_tokens is not None:
        translated["max_k"] = spec.num_speculative_tokens
    if spec.prompt_lookup_min is not None or spec.prompt_lookup_max is not None:
        # as vLLM: one of the two given stands for both
        low, high = spec.prompt_lookup_min or spec.prompt_lookup_max, spec.prompt_lookup_max or spec.prompt_lookup_min
        if low > high:
            raise ValueError(f"speculative_config.prompt_lookup_min: {low} is over prompt_lookup_max {high}")
        translated["ngram"] = {"min_ngram": low, "max_ngram": high}
    for key, value in translated.items():
        if out.get(key) is not None:
            raise ValueError(f"{key}: set both directly and by speculative_config; give one")
        out[key] = value
    if spec.draft_tensor_parallel_size is not None:
        pool = dict(out.get("draft_pool") or {})
        if pool.get("tensor_parallel_size") is not None:
            raise ValueError("draft_pool.tensor_parallel_size: set both directly and by speculative_config."
                             "draft_tensor_parallel_size; give one")  # fmt: skip
        out["draft_pool"] = pool | {"tensor_parallel_size": spec.draft_tensor_parallel_size}
    return out
