"""Grammar-constrained target-only decoding written without specserve code: transformers' `generate` with xgrammar's
own logits processor (xgrammar.contrib.hf), the grammar compiled here from the schema with the options specserve
documents (any whitespace, at most 16 characters of it between two JSON tokens; json_object is the schema of any
object). And the schemas the structured-output tests ask for: bounded, so a random tiny model finishes them (a string
bounded by a pattern: xgrammar 0.2.8's rule for maxLength / minLength strings lets raw control characters through,
which JSON forbids unescaped)."""

import json

import torch

SCHEMAS = {
    "flags": {"type": "object", "properties": {"ok": {"type": "boolean"}, "colour": {"enum": ["red", "green", "blue"]}},
              "required": ["ok", "colour"], "additionalProperties": False},
    "record": {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 99},
                                                "name": {"type": "string", "pattern": "^[a-z]{1,4}$"}},
               "required": ["id", "name"], "additionalProperties": False},
    "list": {"type": "object", "properties": {"xs": {"type": "array", "items": {"type": "boolean"},
                                                     "minItems": 1, "maxItems": 3}},
             "required": ["xs"], "additionalProperties": False},
}  # fmt: skip
ANY_OBJECT = {"type": "object", "additionalProperties": True}  # what json_object means


def compiled_grammar(loaded, schema: dict):
    import xgrammar as xgr

    vocab = int(loaded.model.get_output_embeddings().weight.shape[0])
    info = xgr.TokenizerInfo.from_huggingface(loaded.tokenizer, vocab_size=vocab,
                                              stop_token_ids=sorted(loaded.eos_token_ids))  # fmt: skip
    return xgr.GrammarCompiler(info).compile_json_schema(json.dumps(schema), any_whitespace=True, max_whitespace_cnt=16)


def grammar_greedy(loaded, prompt_ids: list[int], max_new: int, schema: dict) -> list[int]:
    """Target-only greedy decoding under the schema's grammar: the generated ids (EOS included)."""
    from xgrammar.contrib.hf import LogitsProcessor

    eos = sorted(loaded.eos_token_ids)
    with torch.no_grad():
        out = loaded.model.generate(
            torch.tensor([prompt_ids], device=loaded.model.device),
            do_sample=False,
            max_new_tokens=max_new,
            logits_processor=[LogitsProcessor(compiled_grammar(loaded, schema))],
            eos_token_id=eos,
            pad_token_id=eos[0],
        )
    return out[0, len(prompt_ids) :].tolist()
