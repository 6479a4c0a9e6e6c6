"""A served model's own sampling defaults, read from its `generation_config.json` once per ingress replica and applied
where an OpenAI request leaves a field unset, as vLLM's OpenAI server does (its `--generation-config auto`, the
default): `temperature`, `top_p`, `top_k`, `min_p`, `repetition_penalty`, and `max_new_tokens` as the bound of an
unset `max_tokens`. A model without the file, or without those keys in it (the default GGUF model), keeps OpenAI's
defaults: temperature 1, top_p 1, no top_k, no min_p, no repetition penalty. A value the file holds out of range is
skipped, with a warning. Plain JSON, read without transformers (whose GenerationConfig warns about combinations
such as a temperature without do_sample, which vLLM applies as they are).

gRPC requests carry their values as the proto defines them (temperature 0 is greedy, top_p 0 is 1, ...), so the
model's defaults apply to HTTP requests only."""

from __future__ import annotations

import json
import logging
import math
import os
from dataclasses import dataclass, field, replace

from specserve.cluster.serve.edge import Request
from specserve.workers.config.request import MAX_REPETITION_PENALTY

log = logging.getLogger(__name__)

FILE = "generation_config.json"
# What a request that leaves them unset gets when the model says nothing (OpenAI's defaults; top_k 0 = off).
OPENAI_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0}
_MAX_TOP_K = 2**32 - 1


def _number(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


# key -> whether a value is one a request could send (top_k -1 is vLLM's "off", read as 0)
_VALID = {
    "temperature": lambda v: _number(v) and 0 <= v <= 100,
    "top_p": lambda v: _number(v) and 0 < v <= 1,
    "top_k": lambda v: isinstance(v, int) and not isinstance(v, bool) and -1 <= v <= _MAX_TOP_K,
    "min_p": lambda v: _number(v) and 0 <= v <= 1,
    "repetition_penalty": lambda v: _number(v) and 0 < v <= MAX_REPETITION_PENALTY,
    "max_new_tokens": lambda v: isinstance(v, int) and not isinstance(v, bool) and 0 < v <= 1_000_000,
}


@dataclass(frozen=True)
class GenerationDefaults:
    """sampling: field -> the model's value, for the fields its file sets; max_new_tokens: its bound on an unset
    max_tokens, or None."""

    sampling: dict[str, float | int] = field(default_factory=dict)
    max_new_tokens: int | None = None

    def apply(self, request: Request) -> Request:
        """The request with every unset sampling field (None) given the model's value, else OpenAI's default."""
        values = {}
        for name, fallback in OPENAI_DEFAULTS.items():
            if getattr(request, name) is None:
                values[name] = self.sampling.get(name, fallback)
        return replace(request, **values) if values else request

    def describe(self) -> str:
        """What a request that sets none of them gets, for the log."""
        shown = {**OPENAI_DEFAULTS, **self.sampling}
        text = ", ".join(f"{k}={shown[k]:g}" for k in OPENAI_DEFAULTS)
        if self.max_new_tokens is not None:
            text += f", max_tokens at most {self.max_new_tokens}"
        return text


def read_generation_defaults(model_dir: str) -> GenerationDefaults:
    """The model directory's generation_config.json sampling defaults (none when it has no such file)."""
    path = os.path.join(model_dir, FILE)
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        return GenerationDefaults()
    except (OSError, ValueError) as e:
        log.warning("%s is not readable JSON (%s): the model's sampling defaults are not applied", path, e)
        return GenerationDefaults()
    if not isinstance(data, dict):
        return GenerationDefaults()
    sampling, max_new = {}, None
    for key, valid in _VALID.items():
        value = data.get(key)
        if value is None:
            continue
        if not valid(value):
            log.warning("%s: %s = %r is out of range, not applied", path, key, value)
        elif key == "max_new_tokens":
            max_new = value
        else:
            sampling[key] = 0 if key == "top_k" and value == -1 else value
    return GenerationDefaults(sampling, max_new)


def load_generation_defaults(name: str, model_dir: str) -> GenerationDefaults:
    """read_generation_defaults, saying once (at INFO) what an OpenAI request that sets none of them gets."""
    defaults = read_generation_defaults(model_dir)
    if defaults.sampling or defaults.max_new_tokens is not None:
        given = ", ".join([*defaults.sampling, *(["max_new_tokens"] if defaults.max_new_tokens else [])])
        log.info("model %s: the sampling defaults of its %s (%s) apply where an OpenAI request leaves them unset: %s",
                 name, FILE, given, defaults.describe())  # fmt: skip
    else:
        log.info("model %s: no sampling defaults in its %s; a request that leaves them unset gets OpenAI's: %s",
                 name, FILE, defaults.describe())  # fmt: skip
    return defaults
