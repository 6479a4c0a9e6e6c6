"""Suffix drafting (method "suffix"; SuffixDecoding, Oliaro et al. 2024, as Arctic Inference and vLLM run it): the
continuation of the longest suffix of the request's tokens that occurred before, in the request itself (prompt and
output) or in the recent outputs of other requests of the same model, drafted as far as that match and the
agreement of its occurrences support. Agentic and repetitive work repeats whole answers across requests, which
prompt lookup, seeing one request only, cannot draft.

Torch-free and pure. Where a suffix tree indexes every suffix, this indexes each position by the two tokens ending
there (`SuffixIndex`), then measures how far back each candidate occurrence matches (up to `max_depth` tokens): the
occurrences of the longest match are the suffix tree's node for it, and their continuations, counted in a small trie,
give the draft (the most frequent next token while its share stays at least `min_token_prob`; at most
`max_spec_factor` tokens per matched token, as vLLM's suffix_decoding_max_spec_factor). Recent outputs live in a
bounded per-model `SuffixCache` (oldest evicted first), each output with the end of its prompt, so that a request
ending its prompt the same way is drafted the answer from its first token.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from specserve.workers.errors import InvalidRequestError

_KEY = 2  # tokens that key an occurrence: one token alone matches too much to scan
_MAX_CANDIDATES = 64  # most recent occurrences of a key looked at, per sequence


@dataclass(frozen=True)
class SuffixConfig:
    max_depth: int = 24  # longest suffix matched (vLLM's suffix_decoding_max_tree_depth)
    max_spec_factor: float = 1.0  # tokens drafted per matched token
    min_token_prob: float = 0.1  # a drafted token's share of the occurrences that reach it
    max_cached_requests: int = 1000  # recent outputs kept per model
    max_cached_tokens: int = 500_000

    def __post_init__(self):
        for name in ("max_depth", "max_cached_requests", "max_cached_tokens"):
            if getattr(self, name) < 1:
                raise InvalidRequestError(name, f"must be at least 1, got {getattr(self, name)}")
        if not 0.0 < self.min_token_prob <= 1.0 or self.max_spec_factor <= 0:
            raise InvalidRequestError("min_token_prob", "min_token_prob must be in (0, 1], max_spec_factor over 0")


class SuffixIndex:
    """One sequence and, for each position, where the same two tokens ended before (appended to, never rewritten)."""

    def __init__(self, tokens: Sequence[int] = ()):
        self.tokens: list[int] = []
        self.ends: dict[tuple[int, int], list[int]] = {}  # key -> end positions, oldest first
        self.extend(tokens)

    def extend(self, tokens: Sequence[int]) -> None:
        for token in tokens:
            self.tokens.append(token)
            if len(self.tokens) >= _KEY:
                self.ends.setdefault(tuple(self.tokens[-_KEY:]), []).append(len(self.tokens) - 1)

    def sync(self, tokens: Sequence[int]) -> None:
        """Follow a request's committed tokens (they only grow)."""
        self.extend(tokens[len(self.tokens) :])

    def occurrences(self, context: Sequence[int], max_depth: int, before: int) -> list[tuple[int, int]]:
        """(match length, end position) of earlier occurrences of `context`'s last tokens that end before `before`
        and have a continuation, most recent first."""
        if len(context) < _KEY:
            return []
        ends = self.ends.get(tuple(context[-_KEY:]), [])
        found = []
        for end in reversed(ends[-_MAX_CANDIDATES - 1 :]):
            if end + 1 >= min(before, len(self.tokens)):
                continue  # the context itself, or nothing after it
            length = _KEY
            while length < max_depth and length < len(context) and end - length >= 0:
                if self.tokens[end - length] != context[-1 - length]:
                    break
                length += 1
            found.append((length, end))
        return found


class SuffixCache:
    """A model's recent outputs, shared by its requests; bounded by count and tokens, the oldest evicted first."""

    def __init__(self, config: SuffixConfig | None = None):
        self.config = config or SuffixConfig()
        self._outputs: OrderedDict[str, SuffixIndex] = OrderedDict()
        self.tokens = 0

    def __len__(self) -> int:
        return len(self._outputs)

    def remember(self, request_id: str, output: Sequence[int]) -> None:
        if len(output) < _KEY + 1:
            return
        output = list(output)[-self.config.max_cached_tokens :]
        self.forget(request_id)
        self._outputs[request_id] = SuffixIndex(output)
        self.tokens += len(output)
        while len(self._outputs) > self.config.max_cached_requests or self.tokens > self.config.max_cached_tokens:
            _, oldest = self._outputs.popitem(last=False)
            self.tokens -= len(oldest.tokens)

    def remember_request(self, request_id: str, tokens: Sequence[int], prompt_len: int) -> None:
        """A finished request: its output, after the end of its prompt (so a request that ends its prompt the same
        way finds the answer from its first token)."""
        if len(tokens) > prompt_len:
            self.remember(request_id, tokens[max(0, prompt_len - self.config.max_depth) :])

    def forget(self, request_id: str) -> None:
        old = self._outputs.pop(request_id, None)
        if old is not None:
            self.tokens -= len(old.tokens)

    def indexes(self) -> list[SuffixIndex]:
        return list(reversed(self._outputs.values()))  # newest first


@dataclass(frozen=True)
class SuffixDraft:
    match: int  # matched suffix length (0: nothing matched)
    tokens: tuple[int, ...] = ()
    shares: tuple[float, ...] = ()  # each drafted token's share of the occurrences that reached its parent


@dataclass
class _Node:
    count: int = 0
    children: dict[int, _Node] = field(default_factory=dict)


def suffix_draft(context: Sequence[int], own: SuffixIndex, cache: SuffixCache | None, limit: int,
                 config: SuffixConfig) -> SuffixDraft:  # fmt: skip
    """The draft for `context` (the request's committed tokens, `own` indexing them): the continuation of its
    longest earlier match, at most `limit` tokens."""
    if limit <= 0:
        return SuffixDraft(0)
    sources = [(own, own.occurrences(context, config.max_depth, len(context)))]
    for index in cache.indexes() if cache is not None else []:
        sources.append((index, index.occurrences(context, config.max_depth, len(index.tokens))))
    best = max((length for _, found in sources for length, _ in found), default=0)
    if best == 0:
        return SuffixDraft(0)
    depth = min(limit, max(1, int(config.max_spec_factor * best)))
    root = _Node()
    for index, found in sources:
        for length, end in found:
            if length == best:
                _count(root, index.tokens[end + 1 : end + 1 + depth])
    tokens, shares, node = [], [], root
    while node.children and len(tokens) < depth:
        token, child = max(node.children.items(), key=lambda item: item[1].count)
        share = child.count / node.count
        if share < config.min_token_prob:
            break
        tokens.append(token)
        shares.append(share)
        node = child
    return SuffixDraft(best, tuple(tokens), tuple(shares))


def _count(root: _Node, continuation: Sequence[int]) -> None:
    node = root
    node.count += 1
    for token in continuation:
        node = node.children.setdefault(token, _Node())
        node.count += 1


class SuffixLookup:
    """One request's suffix drafting: its own tokens, indexed as they commit, and its model's cache."""

    def __init__(self, cache: SuffixCache):
        self.cache = cache
        self.own = SuffixIndex()

    def draft(self, tokens: Sequence[int], limit: int) -> SuffixDraft:
        self.own.sync(tokens)
        return suffix_draft(tokens, self.own, self.cache, limit, self.cache.config)
