"""Incremental detokenization: a growing token list -> text deltas, each step decoding only a short window of the
last tokens (O(new tokens), not O(all tokens)), whose concatenation equals decoding all tokens at once.

The standard window trick (vLLM's `detokenize_incrementally`, TGI's `decode_token`): decode the tokens from a prefix
offset twice, up to the read offset and up to the end, and emit what the second adds. Starting both decodes at the
same token makes decoders that treat the first token specially (SentencePiece's leading-space strip) cancel out, and a
text that ends in an incomplete UTF-8 sequence (decoded as U+FFFD) is held back until its bytes are all there.
SentencePiece's byte-fallback pieces (`<0xE2>`) decode as a run: a later byte can turn the whole run into U+FFFDs,
so a trailing run is held back too, until a piece that is no byte closes it.
"""

from __future__ import annotations

import re

REPLACEMENT = "\ufffd"
_BYTE_PIECE = re.compile(r"<0x[0-9A-Fa-f]{2}>")


def byte_pieces(tokenizer) -> frozenset[int]:
    """Ids of the vocabulary's byte-fallback pieces (`<0x00>`..`<0xFF>`); none for byte-level BPE. Once per
    tokenizer: it reads the whole vocabulary."""
    return frozenset(i for t, i in tokenizer.get_vocab().items() if _BYTE_PIECE.fullmatch(t))


class IncrementalText:
    """Text deltas of one request's generated tokens; `delta` is called with the whole (growing) token list."""

    def __init__(self, tokenizer, held: frozenset[int] = frozenset()):
        """held: `byte_pieces(tokenizer)`, ids whose text depends on the tokens after them."""
        self.tokenizer = tokenizer
        self.held = held
        # tokens[prefix_offset:read_offset] were emitted already and give the window its context; prefix_offset is
        # always where a complete character (and any byte run) ended, so a window never starts inside one.
        self.prefix_offset = 0
        self.read_offset = 0

    def _decode(self, tokens: list[int]) -> str:
        # No clean-up of spaces: it rewrites text across tokens (" ." -> "."), so windows could not add up to the
        # whole; the tokenizers specserve serves (byte-level BPE, SentencePiece) do not clean up anyway.
        return self.tokenizer.decode(tokens, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def delta(self, tokens: list[int], final: bool) -> str:
        """The text `tokens` add to what was emitted so far; `final`: the last call (nothing is held back)."""
        if len(tokens) <= self.read_offset or (not final and tokens[-1] in self.held):
            return ""
        prefix = self._decode(tokens[self.prefix_offset : self.read_offset])
        text = self._decode(tokens[self.prefix_offset :])
        if not final and (len(text) <= len(prefix) or text.endswith(REPLACEMENT)):
            return ""  # nothing visible yet, or a character whose bytes are still coming
        self.prefix_offset, self.read_offset = self.read_offset, len(tokens)
        return text[len(prefix) :]
