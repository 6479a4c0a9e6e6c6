"""Per-request KV-cache state of one worker: which tokens each request's cache holds, rollback, capacity.

A cache entry remembers the token ids whose keys/values it holds, so a caller can never feed a continuation onto a
stale cache: `sync` keeps only the longest prefix that agrees with the sequence the caller names and rolls the rest
back. Each entry owns a run of positions of the worker's `KVArena` (kv_arena.py); its length is the number of tokens
it holds, so rolling back copies nothing. Memory is accounted per request in cached positions against the capacity,
and the runs (which grow ahead of the positions held) must fit the arena.

Prefix caching (`KVCacheConfig.prefix_caching`, on by default as in vLLM): a released entry is retained, not freed,
and a new request whose tokens start with what a retained entry holds takes that entry over (its run, nothing
copied), rolled back to the shared prefix. Where a running request holds a longer prefix of the new one's tokens (a
system prompt or document that concurrent requests share), those positions are copied into the new request's own
run: runs are contiguous, so two requests cannot share blocks as vLLM's block tables do, but a copy of the keys and
values costs far less than computing them (46 KB a position for SmolLM2-135M in fp32, a memory copy).
Positions rolled back stay behind in the run as the entry's `spare` until something is written over them: a later
call whose sequence goes on with the same tokens gets them back without computing them (a chunked prompt's later
chunks over a cached prefix; a draft model's own accepted drafts).
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
from specserve.workers.runtime.kv_arena import KVArena, Run, blocks
from specserve.workers.runtime.worker_state import common_prefix_length

PREFIX_MIN_TOKENS = 16  # a shorter shared prefix (a chat template's first tokens) is computed again
RETAINED_MAX = 64  # released entries kept for their prefixes
# A released entry is retained less its newest positions: computing them again costs little, and a draft worker's
# cache (an EAGLE-3 head's), which the last rounds of the request did not reach, then still covers what is reused.
RETAIN_LESS = 32


def run_for(expected_len: int) -> int:
    """The positions a run is sized for when its sequence is expected to reach `expected_len` (a chunked prompt's
    whole length): that and a quarter more for its answer, so that neither its chunks nor its first rounds move it. A
    move copies every position the run holds: deep in a 4K prompt on a CPU worker ~0.5 s (its pages touched for the
    first time), in the pass of every request beside it."""
    return expected_len + expected_len // 4


@dataclass
class CacheEntry:
    run: Run | None = None  # its positions in the worker's KVArena (None: none yet)
    tokens: list[int] = field(default_factory=list)  # token ids whose K/V the cache holds, in order
    spare: list[int] = field(default_factory=list)  # tokens rolled back whose K/V still follow `tokens` in the run
    queried: int = 0  # the request's positions counted in the store's prefix_queries (all before this one)
    last_used: float = field(default_factory=time.monotonic)

    @property
    def length(self) -> int:
        return len(self.tokens)

    @property
    def extent(self) -> int:
        """Positions of the run in use: held and spare."""
        return len(self.tokens) + len(self.spare)


class KVCacheStore:
    """Request id -> CacheEntry, with capacity accounting (in cached positions) and LRU order."""

    def __init__(self, config: KVCacheConfig, bytes_per_token: int, capacity_tokens: int):
        """capacity_tokens: the positions the arena holds (memory_budget.py)."""
        self.capacity_tokens = capacity_tokens
        self.bytes_per_token = bytes_per_token
        self._entries: OrderedDict[str, CacheEntry] = OrderedDict()
        self._used = 0
        self.cache = KVArena(capacity_tokens)
        self.prefix_caching = config.prefix_caching
        self._retained: OrderedDict[int, CacheEntry] = OrderedDict()  # released entries, least recently used first
        self._retained_count = 0  # keys of retained entries
        self._retained_tokens = 0
        self.prefix_queries = 0  # new requests' tokens looked up, and of those found cached (vLLM's counters)
        self.prefix_hits = 0
        self.compactions = 0  # each slides every run down (a run that only moves copies itself alone)
        self.prefix_copies = 0  # new requests that copied a running request's prefix
        self._needs: dict[int, int] = {}  # during fit_runs: id(entry) -> the positions its pass needs

    @property
    def used_tokens(self) -> int:
        return self._used

    @property
    def capacity_bytes(self) -> int:
        return self.capacity_tokens * self.bytes_per_token

    @property
    def allocated_bytes(self) -> int:
        """What the requests' runs reserve in the arena now (live and retained; a run grows ahead of its positions)."""
        return (self.cache.capacity - self.cache.allocator.free_positions) * self.bytes_per_token

    def fit_runs(self, request_ids: Sequence[str], extents: Sequence[int],
                 expected: Sequence[int | None] | None = None) -> None:  # fmt: skip
        """Before a forward pass of these requests that makes each hold `extents` positions: grow their runs to that.
        A run grows in place, else moves (its positions copied); where the arena has no free run long enough, the
        runs slide down together if that frees enough, else live requests' spare positions and then retained prefixes
        (least recently used first) give way. KVCapacityError (the caller evicts or preempts) when even that does not
        fit. Runs may move: read them after this.

        expected: per request, the length its sequence soon reaches (a chunked prompt's whole length) or None; a run
        that grows is sized for it where the arena has room (`run_for`), never at the cost of another's positions."""
        try:
            for rid, extent, soon in zip(request_ids, extents, expected or [None] * len(request_ids), strict=True):
                self._fit(rid, extent, soon)
                # it keeps what it grew to when a later row's room compacts or cuts runs
                self._needs[id(self._entries[rid])] = extent
        finally:
            self._needs = {}

    def _fit(self, rid: str, extent: int, expected: int | None = None) -> None:
        entry = self._entries[rid]
        while not self._grow(entry, extent, expected):
            if self.cache.allocator.free_positions >= blocks(extent) - self._size(entry) and not self._packed():
                self._compact(last=entry)  # copies what is held, where giving up a prefix would lose it
            elif any(e.spare for e in self._entries.values()):
                self._drop_spare()
            elif self._retained:
                self._forget_retained()
            else:
                raise KVCapacityError(
                    f"KV cache capacity exceeded: request {rid!r} needs {extent} positions, "
                    f"{self.cache.allocator.free_positions} of the arena's {self.capacity_tokens} are free "
                    f"({self.capacity_bytes} bytes; raise kv_cache's budget or lower load)"
                )

    @staticmethod
    def _size(entry: CacheEntry) -> int:
        return entry.run.size if entry.run is not None else 0

    def _grow(self, entry: CacheEntry, need: int, expected: int | None = None) -> bool:
        """The entry's run holds `need` positions: grown in place where the arena allows, else moved to a free run
        (twice the size, or what `expected` asks, where one is free: for a row that goes on growing). False when
        neither fits."""
        size = self._size(entry)
        if size >= need:
            return True
        allocator = self.cache.allocator
        want = blocks(max(need, 2 * size, run_for(expected) if expected else 0))
        if entry.run is not None:
            after = allocator.free_after(entry.run)
            if after >= blocks(need) - size:
                return allocator.extend(entry.run, min(after, want - size))
        run = allocator.allocate(want) or allocator.allocate(need)
        if run is None:
            return False
        if entry.run is not None:
            self.cache.copy(entry.run.base, run.base, entry.extent)
            allocator.release(entry.run)
        entry.run = run
        return True

    def _runs(self) -> list[CacheEntry]:
        return sorted((e for e in (*self._entries.values(), *self._retained.values()) if e.run is not None),
                      key=lambda e: e.run.base)  # fmt: skip

    def _packed(self) -> bool:
        """No gap between the runs (each trimmed to its extent): compacting would free nothing."""
        cursor = 0
        for entry in self._runs():
            if entry.run.base != cursor or entry.run.size != self._kept_size(entry):
                return False
            cursor = entry.run.end
        return True

    def _drop_spare(self) -> None:
        """Live requests' spare positions given up, their runs cut to what they hold (or the pass needs)."""
        for entry in self._entries.values():
            if entry.spare and entry.run is not None:
                entry.spare.clear()
                self.cache.allocator.shrink(entry.run, self._kept_size(entry))

    def _kept_size(self, entry: CacheEntry) -> int:
        """What an entry's run keeps when runs are cut for room: its positions, or what the pass grew it to."""
        return blocks(max(entry.extent, self._needs.get(id(entry), 0), 1))

    def _compact(self, last: CacheEntry | None = None) -> None:
        """Every run trimmed to what it uses and slid down to the arena's start, lowest first, `last` (a growing run)
        last (their positions copied): the free positions become one run at the end, after `last`."""
        cursor = 0
        held = self.cache.stash(last.run.base, last.extent) if last is not None and last.run is not None else None
        for entry in self._runs():
            if held is not None and entry is last:
                continue  # its positions are in `held`: the others may slide over them
            size = self._kept_size(entry)
            if entry.run.base != cursor:
                self.cache.copy(entry.run.base, cursor, entry.extent)
            entry.run = Run(cursor, size)
            cursor += size
        if held is not None:
            self.cache.unstash(held, cursor)
            last.run = Run(cursor, self._kept_size(last))
            cursor = last.run.end
        self.cache.allocator.reset_after_compaction(cursor)
        self.compactions += 1

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
            self._entries[request_id] = CacheEntry()
        return self.get(request_id)

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
            entry.spare[:0] = entry.tokens[length:]  # nothing copied: still in the run, until written over
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
        """Give the new request the longest prefix of `sequence` the store holds, when it is at least PREFIX_MIN_TOKENS
        long: a retained entry's is taken over (nothing copied), a running request's longer one copied. A head's
        request caps it at what its head holds (`prefix_at_most`): the head needs the skipped positions' entries."""
        best, hit = None, 0
        for key, entry in self._retained.items():
            n = min(common_prefix_length(entry.tokens, sequence), keep_at_most)
            if n > hit:
                best, hit = key, n
        source, shared = None, 0
        for entry in self._entries.values():
            n = min(common_prefix_length(entry.tokens, sequence), keep_at_most)
            if n > shared:
                source, shared = entry, n
        if shared > hit and shared >= PREFIX_MIN_TOKENS:
            self._copy_prefix(request_id, source, shared)
            return
        if hit < PREFIX_MIN_TOKENS:
            return
        entry = self._retained.pop(best)
        self._retained_tokens -= entry.length
        self._used += entry.length  # rolled back to the shared prefix by the caller
        entry.queried = 0
        self._entries[request_id] = entry

    def _copy_prefix(self, request_id: str, source: CacheEntry, n: int) -> None:
        """The new request's run holds a copy of `source`'s first n positions; nothing when they do not fit (then
        they are computed, and the capacity error, if any, is the pass's)."""
        self._make_room(n)
        if self._used + n > self.capacity_tokens:
            return
        entry = self._entries[request_id] = CacheEntry()
        try:
            self._fit(request_id, n)  # may move the source's run: read it after
        except KVCapacityError:
            return
        self.cache.copy(source.run.base, entry.run.base, n)
        entry.tokens = list(source.tokens[:n])
        self._used += n
        self.prefix_copies += 1

    def _make_room(self, new_tokens: int) -> None:
        """Give up retained entries, least recently used first, until `new_tokens` more positions fit beside them."""
        while self._retained and self._used + self._retained_tokens + new_tokens > self.capacity_tokens:
            self._forget_retained()

    def forget_retained(self) -> None:
        """Give up every retained prefix (a bench's rows start cold, so that none prefills for free)."""
        while self._retained:
            self._forget_retained()

    def _forget_retained(self) -> None:
        _, entry = self._retained.popitem(last=False)
        self._retained_tokens -= entry.length
        self._free_run(entry)

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
            del entry.tokens[entry.length - RETAIN_LESS :]  # the run's positions beyond are dead: nothing copied
            self.cache.allocator.shrink(entry.run, entry.length)
            self._retained[self._retained_count] = entry
            self._retained_count += 1
            self._retained_tokens += entry.length
            while len(self._retained) > RETAINED_MAX:
                self._forget_retained()
            self._make_room(0)
        else:
            self._free_run(entry)
        if not self._entries and not self._retained:
            self.cache.reset()
        return True

    def _free_run(self, entry: CacheEntry) -> None:
        if entry.run is not None:
            self.cache.allocator.release(entry.run)
            entry.run = None
