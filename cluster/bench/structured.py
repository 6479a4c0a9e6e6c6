"""`specserve bench --target NAME --json-schema`: structured-output rows (issue 43 item 5). Chat questions that ask
for JSON, each answered under its own response_format (three schemas, in turn), by every in-process row: speculation
on against target-only (off) on the same prompts, every output checked: whole (the grammar terminated with EOS) and
parsing as JSON. HF rows are left out (transformers' generate takes no response_format)."""

from __future__ import annotations

import json
from collections.abc import Sequence

from specserve.cluster.bench.rows import RowFn
from specserve.workers.config.request import ResponseFormat, SamplingParams
from specserve.workers.errors import InvalidRequestError
from specserve.workers.models.chat import ChatMessage, chat_prompt_ids
from specserve.workers.speculation.grammar import Grammars

_STRING = {"type": "string"}  # no maxLength: xgrammar 0.2.8 lets raw control characters into such strings
SCHEMAS = {
    "person": {"type": "object", "properties": {"name": _STRING, "age": {"type": "integer"}, "city": _STRING},
               "required": ["name", "age", "city"]},
    "recipe": {"type": "object", "properties": {"title": _STRING, "ingredients": {"type": "array", "items": _STRING,
                                                                                  "maxItems": 6},
                                                "minutes": {"type": "integer"}},
               "required": ["title", "ingredients", "minutes"]},
    "weather": {"type": "object", "properties": {"city": _STRING, "temperature_c": {"type": "number"},
                                                 "conditions": {"enum": ["sunny", "cloudy", "rain", "snow"]}},
                "required": ["city", "temperature_c", "conditions"]},
}  # fmt: skip
QUESTIONS = {
    "person": "Describe a fictional person as JSON with the fields name, age and city.",
    "recipe": "Give me a simple pancake recipe as JSON with the fields title, ingredients (a list) and minutes.",
    "weather": "Report today's weather in Paris as JSON with the fields city, temperature_c and conditions.",
}


def json_prompts(tokenizer, count: int) -> tuple[list[list[int]], list[ResponseFormat]]:
    """`count` chat prompts asking for JSON, the three schemas in turn, and each prompt's response_format."""
    names = [list(SCHEMAS)[i % len(SCHEMAS)] for i in range(count)]
    prompts = [chat_prompt_ids(tokenizer, [ChatMessage("user", QUESTIONS[name])]) for name in names]
    formats = [ResponseFormat(type="json_schema", json_schema=json.dumps(SCHEMAS[name])) for name in names]
    return prompts, formats


def with_formats(fn: RowFn, prompts: Sequence[list[int]], formats: Sequence[ResponseFormat]) -> RowFn:
    """A row's function that answers each of `prompts` under its response_format (others, such as the warm-up's
    prefixes, as they come)."""
    by_prompt = {tuple(p): f for p, f in zip(prompts, formats, strict=True)}

    def run(prompt, params: SamplingParams):
        fmt = by_prompt.get(tuple(prompt))
        return fn(prompt, params if fmt is None else params.model_copy(update={"response_format": fmt}))

    return run


def valid_outputs(tokenizer, vocab_size: int, eos: set[int], outputs: Sequence[list[int]],
                  formats: Sequence[ResponseFormat]) -> int:  # fmt: skip
    """How many outputs are whole documents of their format: every token allowed, EOS where the grammar completes,
    and the text parses as JSON."""
    grammars, valid = Grammars(tokenizer, vocab_size, sorted(eos)), 0
    for i, (tokens, fmt) in enumerate(zip(outputs, formats, strict=True)):
        state = grammars.for_request(str(i), fmt)
        try:
            state.sync(tokens)
            json.loads(tokenizer.decode(tokens, skip_special_tokens=True))
        except (InvalidRequestError, ValueError):
            continue
        valid += bool(tokens) and tokens[-1] in eos and state.matcher.is_terminated()
    return valid


def warm_formats(fn: RowFn, prompts: Sequence[list[int]], formats: Sequence[ResponseFormat]) -> None:
    """Compile each schema (and build the vocabulary's grammar tables) before anything is timed: one short answer to
    the first prompt of each format."""
    seen: set[ResponseFormat] = set()
    for prompt, fmt in zip(prompts, formats, strict=True):
        if fmt not in seen:
            seen.add(fmt)
            fn(prompt, SamplingParams(max_new_tokens=2))
