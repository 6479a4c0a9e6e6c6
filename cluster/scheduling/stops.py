"""Stop sequences and stop token ids, applied to a request's committed tokens one token at a time, so a round that
commits several tokens is cut exactly where target-only decoding would have stopped: the text before the stop string
(with it, for `include_stop_str_in_output`), the token ids up to and including the token that completed it, and
`finish_reason` "stop". Speculation changes nothing here: only committed tokens reach it, and they equal target-only
decoding's.

Streamed text is held back only while it could still become a stop string (its longest suffix that begins one).
Before `min_tokens` tokens no stop string is looked for (as vLLM; EOS and the stop token ids cannot come earlier:
the target's logits mask them, workers/speculation/logits_controls.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class StopSpec:
    strings: tuple[str, ...] = ()
    token_ids: frozenset[int] = frozenset()
    include_in_output: bool = False  # vLLM's include_stop_str_in_output
    min_tokens: int = 0  # stop strings end no output shorter than this (vLLM's min_tokens; the stop ids are masked)

    def __bool__(self) -> bool:
        return bool(self.strings or self.token_ids)


@dataclass
class StopCut:
    """What a round adds to the output: `text` to emit, the first `tokens` of the round's tokens, and whether a stop
    ended the request."""

    text: str
    tokens: int
    stopped: bool


class StopMatcher:
    """One request's stops. `text_of(tokens, final)` is the incremental detokenizer's delta for the generated tokens
    so far (called once per new token)."""

    def __init__(self, spec: StopSpec, text_of: Callable[[list[int], bool], str]):
        self.spec = spec
        self.text_of = text_of
        self.held = ""  # text that may still begin a stop string

    def feed(self, generated: list[int], new: int, final: bool) -> StopCut:
        """The round that committed the last `new` of `generated`; `final`: the request ended by itself after it."""
        emitted: list[str] = []
        start = len(generated) - new
        for i in range(start, len(generated)):
            last = i == len(generated) - 1
            token = generated[i]
            if token in self.spec.token_ids:
                text = self.text_of(generated[: i + 1], True)
                emitted.append(self.held + (text if self.spec.include_in_output else ""))
                self.held = ""
                return StopCut("".join(emitted), i + 1 - start, True)
            self.held += self.text_of(generated[: i + 1], final and last)
            at, stop = self._first_stop() if i + 1 >= self.spec.min_tokens else (-1, None)
            if stop is not None:
                end = at + len(stop) if self.spec.include_in_output else at
                emitted.append(self.held[:end])
                self.held = ""
                return StopCut("".join(emitted), i + 1 - start, True)
            keep = 0 if final and last else self._partial()
            emitted.append(self.held[: len(self.held) - keep])
            self.held = self.held[len(self.held) - keep :]
        return StopCut("".join(emitted), new, False)

    def _first_stop(self) -> tuple[int, str | None]:
        found = [(self.held.find(s), s) for s in self.spec.strings]
        found = [(at, s) for at, s in found if at >= 0]
        return min(found, key=lambda f: (f[0], len(f[1]))) if found else (-1, None)

    def _partial(self) -> int:
        """Length of the held text's longest suffix that is a proper prefix of a stop string."""
        best = 0
        for stop in self.spec.strings:
            for n in range(min(len(stop) - 1, len(self.held)), best, -1):
                if self.held.endswith(stop[:n]):
                    best = n
                    break
        return best
