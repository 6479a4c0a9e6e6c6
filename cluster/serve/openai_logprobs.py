"""OpenAI's log-probabilities: what a request asks for (chat `logprobs` + `top_logprobs` 0..20, completions `logprobs`
0..20, vLLM's bound: SamplingParams.logprobs, the number of alternatives), and the target's TokenLogprobs
(workers/speculation/logprobs.py: raw, before temperature and every other control, as vLLM's default
`logprobs_mode`) in OpenAI's shapes: chat `{"content": [{token, logprob, bytes, top_logprobs}]}`, completions
`{tokens, token_logprobs, top_logprobs, text_offset}` (whose top_logprobs maps each alternative's text to its
logprob, the chosen token included, as OpenAI's).

vLLM's `prompt_logprobs` (0..20, the prompt's tokens 1..P-1 from the forward that prefills it): a list, None for the
first token (nothing precedes it), then per token `{token id: {logprob, rank, decoded_token}}`, the token's own first,
then its position's likeliest.

A token's text is its id decoded alone (special tokens as written); its `bytes` that text's UTF-8, so a token that
is part of a multi-byte character shows U+FFFD, as vLLM shows it. Logprobs below -9999 are reported as -9999 (vLLM's
floor: JSON has no -Infinity)."""

from __future__ import annotations

from collections.abc import Sequence

from specserve.workers.errors import InvalidRequestError
from specserve.workers.speculation.logprobs import MAX_LOGPROBS, TokenLogprob

MAX_COMPLETION_LOGPROBS = MAX_LOGPROBS  # vLLM's bound on completions' logprobs (OpenAI's is 5)
FLOOR = -9999.0


def requested(logprobs: bool | int | None, top_logprobs: int | None, chat: bool) -> int | None:
    """A body's logprobs fields (ranges checked) -> SamplingParams.logprobs; None: not asked. InvalidRequestError
    naming `top_logprobs` when it asks for alternatives without logprobs (chat) or on completions."""
    if top_logprobs and not (chat and logprobs):
        why = "needs logprobs: true" if chat else f"is chat's: completions take logprobs: 0..{MAX_COMPLETION_LOGPROBS}"
        raise InvalidRequestError("top_logprobs", why)
    if chat:
        return (top_logprobs or 0) if logprobs else None
    return logprobs


class TokenTexts:
    """Token id -> its text decoded alone, cached (one per served model's tokenizer)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._texts: dict[int, str] = {}

    def __call__(self, token: int) -> str:
        text = self._texts.get(token)
        if text is None:
            text = self._texts[token] = self.tokenizer.decode([token], skip_special_tokens=False)
        return text


def _value(logprob: float) -> float:
    return max(logprob, FLOOR)


class LogprobsShaper:
    """One response's logprobs in OpenAI's shape, chunk by chunk (completions' text_offset counts on per choice)."""

    def __init__(self, texts: TokenTexts, chat: bool):
        self.texts = texts
        self.chat = chat
        self.offsets: dict[int, int] = {}  # choice index -> characters of its tokens' texts so far

    def shape(self, token_ids: Sequence[int], logprobs: Sequence[TokenLogprob | None] | None, index: int = 0,
              top: int | None = None) -> dict | None:  # fmt: skip
        """The logprobs of these tokens (a whole choice, or one chunk of its stream); None when not asked.
        Completions' echo: a None entry (the prompt's first token) shows as null, and `top` cuts each token's
        alternatives (the prompt's may carry more)."""
        if logprobs is None:
            return None
        if self.chat:
            return {"content": [self._chat_entry(t, lp) for t, lp in zip(token_ids, logprobs, strict=True)]}
        tokens = [self.texts(t) for t in token_ids]
        offsets, at = [], self.offsets.get(index, 0)
        for text in tokens:
            offsets.append(at)
            at += len(text)
        self.offsets[index] = at
        return {
            "tokens": tokens,
            "token_logprobs": [None if lp is None else _value(lp.logprob) for lp in logprobs],
            "top_logprobs": [
                None
                if lp is None
                else {text: _value(lp.logprob), **{self.texts(a): _value(v) for a, v in lp.top[:top]}}
                for text, lp in zip(tokens, logprobs, strict=True)
            ],
            "text_offset": offsets,
        }

    def prompt_list(self, prompt_ids: Sequence[int], logprobs: Sequence[TokenLogprob], n: int) -> list[dict | None]:
        """vLLM's `prompt_logprobs` of the prompt's tokens 1..P-1 (`logprobs`, with ranks), n alternatives each (the
        token once where it is among them)."""
        out: list[dict | None] = [None]
        for token, lp in zip(prompt_ids[1:], logprobs, strict=True):
            entry = {token: self._ranked(token, lp.logprob, lp.rank)}
            for rank, (alt, value) in enumerate(lp.top[:n], start=1):
                entry.setdefault(alt, self._ranked(alt, value, rank))
            out.append(entry)
        return out

    def _ranked(self, token: int, logprob: float, rank: int) -> dict:
        return {"logprob": _value(logprob), "rank": rank, "decoded_token": self.texts(token)}

    def _chat_entry(self, token: int, logprob: TokenLogprob) -> dict:
        entry = self._token(token, logprob.logprob)
        entry["top_logprobs"] = [self._token(alt, value) for alt, value in logprob.top]
        return entry

    def _token(self, token: int, logprob: float) -> dict:
        text = self.texts(token)
        return {"token": text, "logprob": _value(logprob), "bytes": list(text.encode("utf-8", errors="replace"))}


__all__ = ["MAX_COMPLETION_LOGPROBS", "MAX_LOGPROBS", "LogprobsShaper", "TokenTexts", "requested"]
