"""A block arena for a worker's KV cache: one buffer per layer, sized once from the memory budget; each request
holds a contiguous run of its positions.

Each layer keeps keys and values as [capacity, kv_heads, head_dim]: position p of a request whose run starts at
`base` lives at row base + p. A run is a whole number of BLOCK positions. It grows in place where the run after it is
free, else moves to a free run twice its size (its positions copied once: amortized, and only that request's). Only
when no free run is long enough do the runs slide down together (compaction). So no forward pass ever reshapes the
whole cache: the slot layout before it copied every request's slot whenever one outgrew the longest (2-5 s a time
with a 4K prompt beside 32 slots on a CPU). Memory is what the budget names, whatever the mix of lengths: one 8K
request among short ones takes 8K positions, not slots x 8K.

Why contiguous runs rather than vLLM's block tables: a run is read as a view, with no gather, by the ragged
attention (ragged.py), which on a CPU attends row by row; a block table would copy every row's keys and values each
layer of each pass. A released request's run is retained whole for prefix caching and taken over by a later request
(kv_cache.py), as a block table's blocks would be.

This plugs into transformers as a `Cache` (its `update` is what the attention layers call): `update` writes the
pass's new keys/values where its `RaggedPlan` says; the registered attention reads them back (ragged.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache

BLOCK = 16  # positions: the unit of a run
SCRATCH_ROWS = BLOCK  # rows past the capacity, written by padding columns only (graphs.py)


def blocks(positions: int) -> int:
    """Positions rounded up to whole blocks."""
    return -(-positions // BLOCK) * BLOCK


@dataclass
class Run:
    """A request's positions in the arena: rows base .. base + size - 1."""

    base: int
    size: int

    @property
    def end(self) -> int:
        return self.base + self.size


class RunAllocator:
    """First-fit allocation of runs within `capacity` positions (free runs kept sorted and merged)."""

    def __init__(self, capacity: int):
        self.capacity = blocks(capacity)  # the budget's positions, up to a whole block
        self._free: list[Run] = [Run(0, self.capacity)] if self.capacity else []

    @property
    def free_positions(self) -> int:
        return sum(r.size for r in self._free)

    def allocate(self, size: int) -> Run | None:
        size = blocks(size)
        for i, free in enumerate(self._free):
            if free.size >= size:
                return self._take(i, size)
        return None

    def extend(self, run: Run, more: int) -> bool:
        """Grow `run` in place by `more` positions (whole blocks) when the run after it is free that far."""
        more = blocks(more)
        for i, free in enumerate(self._free):
            if free.base == run.end and free.size >= more:
                run.size += self._take(i, more).size
                return True
        return False

    def _take(self, i: int, size: int) -> Run:
        """The first `size` positions of free run i."""
        free = self._free[i]
        if free.size == size:
            del self._free[i]
        else:
            self._free[i] = Run(free.base + size, free.size - size)
        return Run(free.base, size)

    def free_after(self, run: Run) -> int:
        """Free positions right after `run` (what `extend` could take)."""
        return next((free.size for free in self._free if free.base == run.end), 0)

    def release(self, run: Run) -> None:
        if run.size <= 0:
            return
        self._free.append(Run(run.base, run.size))
        self._free.sort(key=lambda r: r.base)
        merged: list[Run] = []
        for free in self._free:
            if merged and merged[-1].end == free.base:
                merged[-1].size += free.size
            else:
                merged.append(Run(free.base, free.size))
        self._free = merged

    def shrink(self, run: Run, size: int) -> None:
        """Give back the run's positions past `size` (rounded up to a block)."""
        size = blocks(size)
        if size < run.size:
            self.release(Run(run.base + size, run.size - size))
            run.size = size

    def reset_after_compaction(self, used_end: int) -> None:
        """Runs were slid down to end at `used_end`: everything after is one free run."""
        self._free = [Run(used_end, self.capacity - used_end)] if used_end < self.capacity else []


class KVArena(Cache):
    """Keys and values of every request of one worker, per layer [capacity, H_kv, D], allocated at the first pass."""

    def __init__(self, capacity: int):
        super().__init__(layers=[])
        self.allocator = RunAllocator(capacity)
        self._keys: list[torch.Tensor] = []  # per layer: [capacity, H_kv, D]
        self._values: list[torch.Tensor] = []
        self.plan = None  # the next pass's RaggedPlan (ragged.py)

    @property
    def capacity(self) -> int:
        return self.allocator.capacity

    @property
    def scratch_row(self) -> int:
        """The first of SCRATCH_ROWS rows past the capacity that no request holds: a static pass's padding columns
        write there (graphs.py)."""
        return self.allocator.capacity

    @property
    def allocated(self) -> bool:
        return bool(self._keys)

    def layer(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's keys and values, [capacity, H_kv, D] each."""
        return self._keys[layer_idx], self._values[layer_idx]

    def copy(self, source: int, target: int, length: int) -> None:
        """In every layer, rows source .. source + length - 1 to target .. (overlapping ranges allowed)."""
        if length <= 0 or source == target:
            return
        overlap = abs(source - target) < length
        for buffers in (self._keys, self._values):
            for buffer in buffers:
                block = buffer[source : source + length]
                buffer[target : target + length] = block.clone() if overlap else block

    def stash(self, base: int, length: int) -> list[torch.Tensor]:
        """A copy of rows base .. base + length - 1 of every layer (keys, then values), for `unstash`."""
        return [buffer[base : base + length].clone() for buffers in (self._keys, self._values) for buffer in buffers]

    def unstash(self, held: list[torch.Tensor], base: int) -> None:
        """Write what `stash` copied at rows base .. ."""
        for buffer, rows in zip([*self._keys, *self._values], held, strict=True):
            buffer[base : base + rows.shape[0]] = rows

    def move(self, base: int, sources: list[int], start: int) -> None:
        """In every layer, positions `sources` of the run at `base` to positions start, start + 1, ... (a drafted
        tree's accepted path, gathered after the committed positions)."""
        if not self._keys:
            return
        index = torch.tensor([base + s for s in sources], device=self._keys[0].device)
        for buffers in (self._keys, self._values):
            for buffer in buffers:
                buffer[base + start : base + start + len(sources)] = buffer[index]  # the gather copies first

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """key/value_states: [1, H_kv, N, D], the pass's packed columns. Written at the plan's rows; returned as they
        came (the ragged attention reads each request's run from the arena)."""
        plan = self.plan
        if plan is None:
            raise RuntimeError("KVArena.plan must be set before each forward pass")
        while len(self._keys) <= layer_idx:
            # torch.empty: a CPU worker's pages are touched only as positions are written; nothing unwritten is read
            shape = (self.capacity + SCRATCH_ROWS, key_states.shape[1], key_states.shape[3])
            self._keys.append(key_states.new_empty(shape))
            self._values.append(value_states.new_empty(shape))
        keys, values = self._keys[layer_idx], self._values[layer_idx]
        keys.index_copy_(0, plan.write, key_states[0].transpose(0, 1))  # [N, H_kv, D] at their rows
        values.index_copy_(0, plan.write, value_states[0].transpose(0, 1))
        return key_states, value_states

    # transformers asks these of a cache; the ragged attention needs none of them.
    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0 if self.plan is None else self.plan.kv_len

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return (query_length if self.plan is None else self.plan.kv_len), 0

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return -1

    def reset(self) -> None:
        """No request is live: every position free; a CPU worker's buffers freed (its pages back to the system), a
        GPU's kept (allocated once, as vLLM's)."""
        if self._keys and self._keys[0].device.type == "cpu":
            self._keys.clear()
            self._values.clear()
        self.allocator = RunAllocator(self.allocator.capacity)
        self.plan = None
