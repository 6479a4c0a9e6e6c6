"""Where generation stops: a model's EOS token ids, from its tokenizer and generation config. Torch-free, so the
scheduler reads them from a model directory without loading the model."""

from __future__ import annotations

import json
import os


def eos_ids(tokenizer, generation_eos: int | list[int] | None) -> frozenset[int]:
    """Where generation stops: the tokenizer's EOS and the generation config's (a chat model's end-of-turn token,
    e.g. `<|im_end|>` or Llama 3's `<|eot_id|>`, is one of them)."""
    ids: set[int] = set()
    for source in (tokenizer.eos_token_id, generation_eos):
        if isinstance(source, int):
            ids.add(source)
        elif isinstance(source, list | tuple):
            ids.update(int(t) for t in source)
    return frozenset(ids)


def directory_eos_ids(path: str, tokenizer) -> frozenset[int]:
    """eos_ids for a model directory, without loading the model (its generation_config.json, when it has one)."""
    file = os.path.join(path, "generation_config.json")
    generation_eos = None
    if os.path.isfile(file):
        with open(file) as f:
            generation_eos = json.load(f).get("eos_token_id")
    return eos_ids(tokenizer, generation_eos)
