"""Completions' `echo` and vLLM's `prompt_logprobs` on a whole result or a stream's chunks, with vLLM's semantics
(its serving_completion.py): `echo` puts the prompt's text before the output's, and with `logprobs` the prompt's
tokens before the output's in the logprobs (the first token's logprob and top_logprobs null: nothing precedes it;
each token with `logprobs` alternatives); `max_tokens: 0` with echo answers the prompt alone (vLLM runs one token and
drops it, and so does specserve: the usage counts no completion tokens); `prompt_logprobs` (or echo with logprobs)
adds vLLM's list of the prompt's logprobs (openai_logprobs.py: `LogprobsShaper.prompt_list`) to a completions choice
(`prompt_logprobs`) or a chat response. The values are the target's, from the forward that prefilled the prompt
(workers/speculation/logprobs.py)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from specserve.cluster.scheduling.prepared import Chunk
from specserve.cluster.serve.openai_logprobs import LogprobsShaper


def whole(out: dict, parsed, shaper: LogprobsShaper | None, prompt_ids: Sequence[int], index: int = 0) -> dict:
    """A whole result (the scheduler's `generate`: text, token_ids, logprobs and prompt_logprobs as TokenLogprobs) as
    the request asks it, its logprobs in OpenAI's shape and its prompt's logprobs in vLLM's."""
    token_ids, logprobs, text, usage = out["token_ids"], out.get("logprobs"), out["text"], out["usage"]
    if parsed.echo_only:
        token_ids, text, usage = [], "", {**usage, "completion_tokens": 0}
        logprobs = [] if logprobs is not None else None
    prompt = out.get("prompt_logprobs")
    out = {k: v for k, v in out.items() if k != "prompt_logprobs"}
    out |= {"text": parsed.echo_text + text, "token_ids": token_ids, "usage": usage}
    if shaper is None:
        return out
    top = parsed.request.logprobs
    if parsed.echo and logprobs is not None:
        out["logprobs"] = shaper.shape([*prompt_ids, *token_ids], [None, *prompt, *logprobs], index, top)
    else:
        out["logprobs"] = shaper.shape(token_ids, logprobs, index)
    if parsed.prompt_logprobs is not None:
        out["prompt_logprobs"] = shaper.prompt_list(prompt_ids, prompt, parsed.prompt_logprobs)
    return out


def streamed(chunk: Chunk, parsed, prompt_ids: Sequence[int], first: bool) -> Chunk:
    """A stream's chunk as the request asks it: a choice's first carries the prompt's text with echo (and with
    logprobs its tokens and theirs: token_ids and logprobs as shown, the first token's None); with max_tokens 0 the
    generated part is dropped. (prompt_logprobs is not streamed: openai_api.py refuses it, as vLLM.)"""
    tokens, logprobs, text = chunk.token_ids, chunk.logprobs, chunk.text
    if parsed.echo_only:
        tokens, text = [], ""
        logprobs = [] if logprobs is not None else None
    if parsed.echo and first:
        text = parsed.echo_text + text
        if logprobs is not None:
            tokens, logprobs = [*prompt_ids, *tokens], [None, *(chunk.prompt_logprobs or []), *logprobs]
    return dataclasses.replace(chunk, text=text, token_ids=list(tokens), logprobs=logprobs)
