"""Per-request KV-cache state of one worker: which tokens each request's cache holds, rollback, capacity.

A cache entry remembers the token ids whose keys/values it holds, so a caller can never feed a continuation onto a
stale cache: `sync` keeps only the longest prefix that agrees with the sequence the caller names and rolls the rest
back. Each entry owns one slot of a shared `SlotKVCache`; its length is the number of tokens it holds, so rolling back
copies nothing. Memory is accounted per request in cached positions against a configured capacity.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from specserve.workers.config import KVCacheConfig
from specserve.workers.errors import KVCapacityError, RequestNotFoundError
from specserve.workers.runtime.slot_cache import SlotKVCache
from specserve.workers.runtime.worker_state import common_prefix_length


@dataclass
class CacheEntry:
    slot: int  # the request's row of the shared SlotKVCache
    tokens: list[int] = field(default_factory=list)  # token ids whose K/V the cache holds, in order
    last_used: float = field(default_factory=time.monotonic)

    @property
    def length(self) -> int:
        return len(self.tokens)


class KVCacheStore:
    """Request id -> CacheEntry, with capacity accounting (in cached positions) and LRU order."""

    def __init__(self, config: KVCacheConfig, bytes_per_token: int = 0):
        self.capacity_tokens = config.capacity_tokens
        self.bytes_per_token = bytes_per_token
        self._entries: OrderedDict[str, CacheEntry] = OrderedDict()
        self._used = 0
        self.cache = SlotKVCache()
        self._free_slots: list[int] = []
        self._next_slot = 0

    @property
    def used_tokens(self) -> int:
        return self._used

    @property
    def used_bytes(self) -> int:
        return self._used * self.bytes_per_token

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, request_id: str) -> CacheEntry:
        try:
            entry = self._entries[request_id]
        except KeyError:
            raise RequestNotFoundError(f"no KV cache for request {request_id!r}") from None
        entry.last_used = time.monotonic()
        self._entries.move_to_end(request_id)
        return entry

    def get_or_create(self, request_id: str) -> CacheEntry:
        if request_id not in self._entries:
            if self._free_slots:
                slot = min(self._free_slots)  # low slots first: keeps the live slots dense, and shrinkable
                self._free_slots.remove(slot)
            else:
                slot, self._next_slot = self._next_slot, self._next_slot + 1
            self._entries[request_id] = CacheEntry(slot=slot)
        return self.get(request_id)

    def sync(self, request_id: str, sequence: Sequence[int], keep_at_most: int) -> CacheEntry:
        """Roll the request's cache back to the longest prefix it shares with `sequence`, at most `keep_at_most`."""
        entry = self.get_or_create(request_id)
        keep = min(common_prefix_length(entry.tokens, sequence), keep_at_most)
        self.rollback(request_id, keep)
        return entry

    def rollback(self, request_id: str, length: int) -> None:
        """Drop cached positions beyond `length` (rejected draft tokens)."""
        entry = self.get(request_id)
        drop = entry.length - length
        if drop > 0:
            del entry.tokens[length:]  # the slot's positions beyond its length are dead: nothing to copy
            self._used -= drop

    def reserve(self, request_id: str, new_tokens: int) -> None:
        """Check that `new_tokens` more positions fit; raise KVCapacityError otherwise."""
        if self._used + new_tokens > self.capacity_tokens:
            raise KVCapacityError(
                f"KV cache capacity exceeded: request {request_id!r} needs {new_tokens} more positions, "
                f"{self._used} of {self.capacity_tokens} are in use (raise kv_cache.capacity_tokens or lower load)"
            )

    def reserve_batch(self, request_ids: Sequence[str], new_tokens: Sequence[int]) -> None:
        """Check that a batch's new positions fit together; KVCapacityError names the first row that does not."""
        used = self._used
        for rid, n in zip(request_ids, new_tokens, strict=False):
            if used + n > self.capacity_tokens:
                self.reserve(rid, n + used - self._used)
            used += n

    def commit(self, request_id: str, tokens: Sequence[int]) -> None:
        """Record that the cache now also holds `tokens` (after a forward pass appended them)."""
        entry = self.get(request_id)
        entry.tokens.extend(int(t) for t in tokens)
        self._used += len(tokens)

    def release(self, request_id: str) -> bool:
        entry = self._entries.pop(request_id, None)
        if entry is None:
            return False
        self._used -= entry.length
        self._free_slots.append(entry.slot)
        self._give_back_memory()
        return True

    def _give_back_memory(self) -> None:
        """Shrink the shared buffers when the live requests use a quarter of them or less."""
        if not self._entries:
            self.cache.reset()
            self._free_slots.clear()
            self._next_slot = 0
            return
        while self._next_slot - 1 in self._free_slots:  # trailing free slots are no longer needed
            self._free_slots.remove(self._next_slot - 1)
            self._next_slot -= 1
        slots, length = self.cache.capacity
        longest = max(e.length for e in self._entries.values())
        while slots >= 8 and self._next_slot * 4 <= slots:
            slots //= 2
        while length >= 512 and longest * 4 <= length:
            length //= 2
        self.cache.shrink(slots, length)
