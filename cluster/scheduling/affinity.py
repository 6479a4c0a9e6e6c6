"""Prefix affinity: which worker holds which prompt prefix, so that a request goes where its history is cached.

A worker keeps a finished request's KV cache for later requests that start with the same tokens (prefix caching,
workers/runtime/kv_cache.py); with several target workers (or draft workers) a conversation's next turn finds it
only on the worker that served the last one. The scheduler records, per request it releases, the sequence each of
its workers held, as hashes of 16-token blocks chained from the start (vLLM's block hashes: equal hashes mean equal
prefixes), least recently recorded first out past a bound; a new request goes to the worker holding the most of its
prompt when that is at least a tenth of it and the worker's load is within `max_imbalance` requests of the least
loaded one (Ray Serve LLM's PrefixCacheAffinityRouter: its match_rate_threshold 0.1 and imbalanced_threshold), else
to the least loaded. It is a hint: a worker may have given the prefix up since (its cache computes it again). Block
hashes are Python's hashes of int tuples, equal in every process: scheduler replicas share their records (prefixes.py).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

BLOCK_TOKENS = 16  # a shorter shared prefix is not worth a worker's imbalance (kv_cache.PREFIX_MIN_TOKENS)
MAX_BLOCKS = 1 << 18  # blocks remembered, over every worker: ~4M tokens of prompts
MATCH_RATE = 0.1  # the least share of a prompt a worker must hold to draw it
MAX_IMBALANCE = 4  # requests more than the least loaded worker's that a worker holding the prefix may run


def block_hashes(tokens: Sequence[int]) -> list[int]:
    """Hashes of each whole BLOCK_TOKENS-token block of `tokens`, each chained to the blocks before it."""
    hashes, h = [], 0
    for start in range(0, len(tokens) - BLOCK_TOKENS + 1, BLOCK_TOKENS):
        h = hash((h, tuple(tokens[start : start + BLOCK_TOKENS])))
        hashes.append(h)
    return hashes


class PrefixAffinity:
    """Block hash -> the workers that held that prefix, least recently recorded first."""

    def __init__(self, max_blocks: int = MAX_BLOCKS, max_imbalance: int = MAX_IMBALANCE):
        self.max_blocks = max_blocks
        self.max_imbalance = max_imbalance
        self._holders: OrderedDict[int, set[str]] = OrderedDict()
        self.placed = 0  # requests placed by their prefix (not by load alone)

    def record(self, worker: str, tokens: Sequence[int]) -> list[int]:
        """`worker` holds `tokens`' KV cache (a request runs or ended there); returns their block hashes."""
        hashes = block_hashes(tokens)
        self.add(worker, hashes)
        return hashes

    def add(self, worker: str, hashes: Sequence[int]) -> None:
        """`worker` holds the prefix whose block hashes these are (another scheduler replica's record)."""
        for h in hashes:
            self._holders.setdefault(h, set()).add(worker)
            self._holders.move_to_end(h)
        while len(self._holders) > self.max_blocks:
            self._holders.popitem(last=False)

    def forget(self, worker: str) -> None:
        """The worker left (its caches with it)."""
        for h in [h for h, holders in self._holders.items() if worker in holders]:
            self._holders[h].discard(worker)
            if not self._holders[h]:
                del self._holders[h]

    def held(self, tokens: Sequence[int], workers: Sequence[str]) -> tuple[str | None, int]:
        """The worker among `workers` holding the longest prefix of `tokens` (the first listed of equals), and how
        many tokens of it; (None, 0) when none holds a block."""
        hashes = block_hashes(tokens)
        for i in range(len(hashes) - 1, -1, -1):
            holders = self._holders.get(hashes[i])
            if holders:
                for w in workers:
                    if w in holders:
                        return w, (i + 1) * BLOCK_TOKENS
        return None, 0

    def place(self, tokens: Sequence[int], load: dict[str, int]) -> str | None:
        """The worker for a new request of prompt `tokens` among `load`'s (worker -> running requests, in order of
        preference): the one holding most of its prompt when that draws it, else None (place by load)."""
        if not load:
            return None
        worker, matched = self.held(tokens, list(load))
        if worker is None or matched < max(BLOCK_TOKENS, MATCH_RATE * len(tokens)):
            return None
        if load[worker] - min(load.values()) > self.max_imbalance:
            return None
        self.placed += 1
        return worker
