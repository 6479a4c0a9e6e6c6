"""Per-request KV-cache state of one worker: which tokens each request's cache holds, rollback, capacity.

A cache entry remembers the token ids whose keys/values it holds, so a caller can never feed a continuation onto a
stale cache: `sync` keeps only the longest prefix that agrees with the sequence the caller names and rolls the rest
back. Each entry owns one slot of a shared `SlotKVCache`; its length is the number of tokens it holds, so rolling back
copies nothing. Memory is accounted per request in cached positions against a configured capacity.

Prefix caching (`KVCacheConfig.prefix_caching`, on by default as in vLLM): a released entry is retained, not freed,
and a new request whose tokens start with what a retained entry holds takes that entry over (its slot, nothing
copied), rolled back to the shared prefix.
Positions rolled back stay behind as the entry's `spare` until something is written over them: a later call whose
sequence goes on with the same tokens gets them back without computing them (a chunked prompt's later chunks over a
cached prefix; a draft model's own accepted drafts).
Retained entries give way, least recently used first, to running requests' positions and past `RETAINED_MAX`. The
keys and values reused are those the same tokens would get computed again (a causal model's prefix does not depend
on what follows it), so outputs do not change.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from specserve.workers.config.settings import KVCacheConfig
from specserve.workers.errors import KVCapacityError, RequestNotFoundError
from specserve.workers.runtime.slot_cache import BatchPlan, SlotKVCache
from specserve.workers.runtime.worker_state import common_prefix_length

PREFIX_MIN_TOKENS = 16  # a shorter shared prefix (a chat template's first tokens) is computed again
RETAINED_MAX = 64  # released entries kept for their prefixes
# A released entry is retained less its newest positions: computing them again costs little, and a draft worker's
# cache (an EAGLE-3 head's), which the last rounds of the request did not reach, then still covers what is reused.
RETAIN_LESS = 32


@dataclass
class CacheEntry:
    slot: int  # the request's row of the shared SlotKVCache
    tokens: list[int] = field(default_factory=list)  # token ids whose K/V the cache holds, in order
    spare: list[int] = field(default_factory=list)  # tokens rolled back whose K/V still follow `tokens` in the slot
    queried: int = 0  # the request's positions counted in the store's prefix_queries (all before this one)
    last_used: float = field(default_factory=time.monotonic)

    @property
    def length(self) -> int:
        return len(self.tokens)

    @property
    def extent(self) -> int:
        """Positions of the slot in use: held and spare."""
        return len(self.tokens) + len(self.spare)


class KVCacheStore:
    """Request id -> CacheEntry, with capacity accounting (in cached positions) and LRU order."""

    def __init__(self, config: KVCacheConfig, bytes_per_token: int, capacity_tokens: int):
        """capacity_tokens: the positions the shared buffers may hold (memory_budget.py), every slot as long as the
        longest."""
        self.capacity_tokens = capacity_tokens
        self.bytes_per_token = bytes_per_token
        self._entries: OrderedDict[str, CacheEntry] = OrderedDict()
        self._used = 0
        self.cache = SlotKVCache()
        self._free_slots: list[int] = []
        self._next_slot = 0
        self.prefix_caching = config.prefix_caching
        self._retained: OrderedDict[int, CacheEntry] = OrderedDict()  # released entries, least recently used first
        self._retained_count = 0  # keys of retained entries
        self._retained_tokens = 0
        self.prefix_queries = 0  # new requests' tokens looked up, and of those found cached (vLLM's counters)
        self.prefix_hits = 0

    @property
    def used_tokens(self) -> int:
        return self._used

    @property
    def used_bytes(self) -> int:
        return self._used * self.bytes_per_token

    @property
    def capacity_bytes(self) -> int:
        return self.capacity_tokens * self.bytes_per_token

    @property
    def allocated_bytes(self) -> int:
        """What the shared buffers hold now (they grow by doubling within the capacity, and shrink)."""
        slots, length = self.cache.capacity
        return slots * length * self.bytes_per_token if self.cache.allocated else 0

    def fit_buffers(self, request_ids: Sequence[str], max_position: int) -> None:
        """Before a forward pass of these requests that writes up to `max_position`: make sure the shared buffers can
        hold it within the capacity. Retained prefixes and spare positions give way first, then the live requests move
        to the lowest slots; KVCapacityError (the caller evicts or preempts) when even that does not fit. Slots may
        change: read them after this."""
        max_slot = max(self._entries[r].slot for r in request_ids)
        if self.cache.fits(max_slot, max_position, self.capacity_tokens):
            return
        # Compacted, every entry takes a slot as long as the pass's longest row: retained prefixes give way until that
        # fits, least recently used first; then the entries move and the buffers are reshaped, once each, as long as
        # the capacity allows up to twice the row (it grows on: a prompt in chunks, a long answer). Every reshape
        # copies every buffer: GBs, seconds on a CPU, for slots x a 4K prompt.
        need = max_position + 1
        while self._retained and (len(self._entries) + len(self._retained)) * need > self.capacity_tokens:
            self._forget_retained()
        slots = self._compact(shrink=False)
        longest = max(need, *(e.extent for e in (*self._entries.values(), *self._retained.values())))
        if slots * longest <= self.capacity_tokens:  # never shorter than an entry (an idle request's, a prefix)
            self.cache.shrink(slots, max(longest, min(2 * need, self.capacity_tokens // slots)))
        else:
            self._give_back_memory(tight=True)
        max_slot = max(self._entries[r].slot for r in request_ids)
        if not self.cache.fits(max_slot, max_position, self.capacity_tokens):
            raise KVCapacityError(
                f"KV cache capacity exceeded: a forward pass needs buffers of {max_slot + 1} slots x "
                f"{max_position + 1} positions, over the capacity of {self.capacity_tokens} positions "
                f"({self.capacity_bytes} bytes; raise kv_cache's budget or lower load)"
            )

    def _compact(self, shrink: bool = True) -> int:
        """Live and retained entries into slots 0..n-1 (their held positions copied, lowest first), nothing spare;
        the buffers shrunk to fit (`shrink`). Returns n."""
        entries = sorted((*self._entries.values(), *self._retained.values()), key=lambda e: e.slot)
        for target, entry in enumerate(entries):
            entry.spare.clear()
            if entry.slot != target:
                if entry.length:
                    self.cache.copy_slot(entry.slot, target, entry.length)
                entry.slot = target
        self._free_slots.clear()
        self._next_slot = len(entries)
        if shrink:
            self._give_back_memory(tight=True)
        return len(entries)

    def plan_buffers(self, plan: BatchPlan, max_slot: int, max_position: int) -> None:
        """Set the shared buffers for the forward pass `fit_buffers` made room for."""
        self.cache.plan(plan, max_slot, max_position, self.capacity_tokens)

    @property
    def cached_tokens(self) -> int:
        """Positions held by retained entries, for later requests' prefixes (given up when room is needed)."""
        return self._retained_tokens

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
            self._entries[request_id] = CacheEntry(slot=self._new_slot())
        return self.get(request_id)

    def _new_slot(self) -> int:
        if self._free_slots:
            slot = min(self._free_slots)  # low slots first: keeps the live slots dense, and shrinkable
            self._free_slots.remove(slot)
            return slot
        slot, self._next_slot = self._next_slot, self._next_slot + 1
        return slot

    def sync(self, request_id: str, sequence: Sequence[int], keep_at_most: int,
             prefix_at_most: int | None = None) -> CacheEntry:  # fmt: skip
        """Roll the request's cache back to the longest prefix it shares with `sequence`, at most `keep_at_most`; a
        request new here starts from the longest cached prefix of `sequence` (prefix caching), and one that goes on
        past its length holds its spare positions again where they agree with `sequence`.

        Counts (vLLM's prefix_cache_queries / hits, per position): every position a request asks for, once; and of
        those, every one served from cache (a retained prefix taken over, spare positions held again).

        prefix_at_most: the most positions a new request takes from a retained prefix (an EAGLE-3 head's request whose
        head holds less of it: positions served from cache bring the head no features, and a head that lacks its
        prompt drafts badly, sglang #31600). None: as many as match."""
        fresh = request_id not in self._entries
        if fresh and prefix_at_most is not None:
            keep_at_most = min(keep_at_most, prefix_at_most)
        if fresh and self.prefix_caching:
            self._start_from_prefix(request_id, sequence, keep_at_most)
        entry = self.get_or_create(request_id)
        held = 0 if fresh else common_prefix_length(entry.tokens, sequence)
        keep = min(common_prefix_length(entry.tokens + entry.spare, sequence), keep_at_most)
        if keep > entry.length:  # computed before, rolled back since, never written over: held again
            self._restore(entry, keep - entry.length)
        self.rollback(request_id, keep)
        self.prefix_hits += max(0, keep - max(held, entry.queried))
        self.prefix_queries += max(0, len(sequence) - entry.queried)
        entry.queried = max(entry.queried, len(sequence))
        return entry

    def _restore(self, entry: CacheEntry, n: int) -> None:
        self._make_room(n)
        entry.tokens.extend(entry.spare[:n])
        del entry.spare[:n]
        self._used += n

    def rollback(self, request_id: str, length: int) -> None:
        """Drop cached positions beyond `length` (rejected draft tokens)."""
        entry = self.get(request_id)
        drop = entry.length - length
        if drop > 0:
            entry.spare[:0] = entry.tokens[length:]  # nothing copied: still in the slot, until written over
            del entry.tokens[length:]
            self._used -= drop

    def written(self, request_id: str, tokens: Sequence[int], overwrote: bool = False) -> None:
        """A forward pass wrote `tokens` at the entry's next positions (committed with `commit`); `overwrote`: it
        wrote past them too (a drafted tree's nodes), so nothing spare is left."""
        entry = self.get(request_id)
        if not entry.spare:  # the usual case: nothing rolled back since the last write
            return
        n = len(tokens)
        if overwrote or entry.spare[:n] != [int(t) for t in tokens]:
            entry.spare.clear()
        else:
            del entry.spare[:n]  # the same tokens after the same prefix: the same keys/values

    def _start_from_prefix(self, request_id: str, sequence: Sequence[int], keep_at_most: int) -> None:
        """Give the new request the retained entry that holds the longest prefix of `sequence` (taken over, nothing
        copied), when that prefix is at least PREFIX_MIN_TOKENS long. Running requests' caches are not shared: an
        EAGLE-3 head's worker reuses released caches the same way, and a prefix the target skips is one the head must
        already hold (else its drafts start from nothing there)."""
        best, hit = None, 0
        for key, entry in self._retained.items():
            n = min(common_prefix_length(entry.tokens, sequence), keep_at_most)
            if n > hit:
                best, hit = key, n
        if hit < PREFIX_MIN_TOKENS:
            return
        entry = self._retained.pop(best)
        self._retained_tokens -= entry.length
        self._used += entry.length  # rolled back to the shared prefix by the caller
        entry.queried = 0
        self._entries[request_id] = entry

    def _make_room(self, new_tokens: int) -> None:
        """Give up retained entries, least recently used first, until `new_tokens` more positions fit beside them, and
        until the slots they keep, each as long as the longest entry (the shared buffers' shape), fit the capacity."""
        while self._retained and (self._used + self._retained_tokens + new_tokens > self.capacity_tokens
                                  or self._footprint() > self.capacity_tokens):  # fmt: skip
            self._forget_retained()
        if self._footprint() > self.capacity_tokens:
            for entry in self._entries.values():
                entry.spare.clear()

    def _footprint(self) -> int:
        """Positions the shared buffers need for the live and retained entries: slots x the longest."""
        entries = (*self._entries.values(), *self._retained.values())
        return len(entries) * max((e.extent for e in entries), default=0)

    def forget_retained(self) -> None:
        """Give up every retained prefix (a bench's rows start cold, so that none prefills for free)."""
        while self._retained:
            self._forget_retained()

    def _forget_retained(self) -> None:
        _, entry = self._retained.popitem(last=False)
        self._retained_tokens -= entry.length
        self._free_slots.append(entry.slot)

    def reserve(self, request_id: str, new_tokens: int) -> None:
        """Check that `new_tokens` more positions fit (retained prefixes give way); raise KVCapacityError otherwise."""
        self._make_room(new_tokens)
        if self._used + new_tokens > self.capacity_tokens:
            raise KVCapacityError(
                f"KV cache capacity exceeded: request {request_id!r} needs {new_tokens} more positions, "
                f"{self._used} of {self.capacity_tokens} are in use (raise kv_cache.capacity_tokens or lower load)"
            )

    def reserve_batch(self, request_ids: Sequence[str], new_tokens: Sequence[int]) -> None:
        """Check that a batch's new positions fit together; KVCapacityError names the first row that does not."""
        self._make_room(sum(new_tokens))
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
        """The request ended: its entry is retained for later requests' prefixes (prefix caching), else freed."""
        entry = self._entries.pop(request_id, None)
        if entry is None:
            return False
        self._used -= entry.length
        entry.spare.clear()
        if self.prefix_caching and entry.length - RETAIN_LESS >= PREFIX_MIN_TOKENS:
            del entry.tokens[entry.length - RETAIN_LESS :]  # the slot's positions beyond are dead: nothing copied
            self._retained[self._retained_count] = entry
            self._retained_count += 1
            self._retained_tokens += entry.length
            while len(self._retained) > RETAINED_MAX:
                self._forget_retained()
            self._make_room(0)
        else:
            self._free_slots.append(entry.slot)
        self._give_back_memory()
        return True

    def _give_back_memory(self, tight: bool = False) -> None:
        """Shrink the shared buffers when the live and retained entries use a quarter of them or less (`tight`: to
        exactly what they use)."""
        if not self._entries and not self._retained:
            self.cache.reset()
            self._free_slots.clear()
            self._next_slot = 0
            return
        while self._next_slot - 1 in self._free_slots:  # trailing free slots are no longer needed
            self._free_slots.remove(self._next_slot - 1)
            self._next_slot -= 1
        slots, length = self.cache.capacity
        longest = max(e.extent for e in (*self._entries.values(), *self._retained.values()))
        if tight:
            slots, length = min(slots, self._next_slot), min(length, longest)
        while slots >= 8 and self._next_slot * 4 <= slots:
            slots //= 2
        while length >= 512 and longest * 4 <= length:
            length //= 2
        self.cache.shrink(slots, length)
