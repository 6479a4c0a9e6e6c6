"""A slot-based KV buffer for continuous batching: one slot per request, per-row lengths, rollback by length.

Each layer keeps keys and values as [slots, max_len, kv_heads, head_dim]. A forward pass over a batch of requests
writes each row's new keys/values at that row's own positions of its own slot and attends over the first `kv_len`
positions of the batch's slots, under a 4D mask that hides what lies beyond each row's length. Rolling a request back
is just forgetting positions (the caller tracks lengths); nothing is copied. Buffers grow by doubling, in slots and in
length, and shrink back when the requests holding them are released.

This plugs into transformers as a `Cache` (its `update` is what the attention layers call), so any causal LM whose
layers all use full attention runs batched, ragged and unmodified.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache


@dataclass
class ScatterPlan:
    """The N input columns whose keys/values a batched forward pass keeps (a padding column's are not kept)."""

    rows: torch.Tensor  # [N] long: the column's row of the batch
    columns: torch.Tensor  # [N] long: its column
    slots: torch.Tensor  # [N] long: the slot its keys/values go to
    positions: torch.Tensor  # [N] long: and the position

    @classmethod
    def of(cls, rows: list[int], columns: list[int], slots: list[int], positions: list[int], device) -> ScatterPlan:
        as_tensor = lambda v: torch.tensor(v, dtype=torch.long, device=device)  # noqa: E731
        return cls(as_tensor(rows), as_tensor(columns), as_tensor(slots), as_tensor(positions))


@dataclass
class BatchPlan:
    """Where the next forward pass reads and writes. B rows, T input columns (left-padded)."""

    slots: torch.Tensor | None  # [B] long: each row's slot (None: a single row, see single_start)
    write: ScatterPlan | None  # where the kept columns' keys/values go (None: a single row, see single_start)
    kv_len: int  # attend over positions [0, kv_len) of each row's slot
    contiguous: slice | None  # the slots as a slice when they are consecutive (reads are views, not copies)
    single_start: int | None = None  # one row, unpadded: its T new positions start here (plain slice writes)


class SlotKVCache(Cache):
    def __init__(self, initial_slots: int = 4, initial_length: int = 256):
        super().__init__(layers=[])
        self._keys: list[torch.Tensor] = []  # per layer: [S, L, H_kv, D]
        self._values: list[torch.Tensor] = []
        self._initial = (initial_slots, initial_length)
        self._slots, self._length = self._initial
        self._plan: BatchPlan | None = None

    @property
    def capacity(self) -> tuple[int, int]:
        """(slots, positions per slot) currently allocated."""
        return self._slots, self._length

    @property
    def allocated(self) -> bool:
        return bool(self._keys)

    def _grown(self, max_slot: int, max_position: int, limit: int | None) -> tuple[int, int]:
        """The buffers' shape to hold slot `max_slot` and position `max_position` (inclusive): doubled while that
        stays within `limit` positions in all, else as long as the limit allows (else just large enough, which does
        not fit). Not just enough when it would fit more: a prompt prefilled in chunks would then copy every buffer
        once a chunk (seconds each, 32 slots of a 4K prompt on 2 cores)."""
        slots, length = self._slots, self._length
        while slots <= max_slot:
            slots *= 2
        while length <= max_position:
            length *= 2
        if limit is not None and slots * length > limit:
            held = (self._slots, self._length) if self._keys else (0, 0)  # unallocated: no shape to keep
            slots = max(held[0], max_slot + 1)
            length = max(held[1], max_position + 1, min(length, limit // slots))
        return slots, length

    def fits(self, max_slot: int, max_position: int, limit: int) -> bool:
        slots, length = self._grown(max_slot, max_position, limit)
        return slots * length <= limit

    def plan(self, plan: BatchPlan, max_slot: int, max_position: int, limit: int | None = None) -> None:
        """Set the batch for the next forward pass, growing the buffers to hold slot `max_slot` and position
        `max_position` (both inclusive), within `limit` positions in all where the caller checked it fits."""
        self._resize(*self._grown(max_slot, max_position, limit))
        self._plan = plan

    def shrink(self, slots: int, length: int) -> None:
        """Give memory back: keep only the first `slots` slots and `length` positions (callers make sure nothing
        beyond them is live)."""
        self._resize(max(1, slots), max(1, length))

    def _resize(self, slots: int, length: int) -> None:
        if (slots, length) == (self._slots, self._length):
            return
        for buffers in (self._keys, self._values):
            for i, old in enumerate(buffers):
                new = old.new_zeros((slots, length, *old.shape[2:]))
                s, n = min(slots, old.shape[0]), min(length, old.shape[1])
                new[:s, :n] = old[:s, :n]
                buffers[i] = new
        self._slots, self._length = slots, length

    def copy_slot(self, source: int, target: int, length: int) -> None:
        """In every layer, copy the first `length` positions of slot `source` to slot `target`."""
        for buffers in (self._keys, self._values):
            for buffer in buffers:
                buffer[target, :length] = buffer[source, :length]

    def move(self, slot: int, sources: list[int], start: int) -> None:
        """In every layer, copy the keys/values at positions `sources` of `slot` to positions start, start + 1, ...
        (a drafted tree's accepted path, gathered after the committed positions)."""
        index = torch.tensor(sources, device=self._keys[0].device if self._keys else None)
        for buffers in (self._keys, self._values):
            for buffer in buffers:
                buffer[slot, start : start + len(sources)] = buffer[slot, index]  # the gather copies first

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """key/value_states: [B, H_kv, T, D] for the planned rows. Returns [B, H_kv, kv_len, D] keys and values."""
        plan = self._plan
        if plan is None:
            raise RuntimeError("SlotKVCache.plan() must be called before each forward pass")
        while len(self._keys) <= layer_idx:
            shape = (self._slots, self._length, key_states.shape[1], key_states.shape[3])
            self._keys.append(key_states.new_zeros(shape))
            self._values.append(value_states.new_zeros(shape))
        out = []
        for buffer, states in ((self._keys[layer_idx], key_states), (self._values[layer_idx], value_states)):
            if plan.single_start is not None:
                start, T = plan.single_start, states.shape[2]
                buffer[plan.contiguous, start : start + T] = states.transpose(1, 2)  # [1, T, H_kv, D]
            else:
                w = plan.write
                buffer[w.slots, w.positions] = states.transpose(1, 2)[w.rows, w.columns]  # [N, H_kv, D]
            if plan.contiguous is not None:
                read = buffer[plan.contiguous, : plan.kv_len]  # a view
            else:
                read = buffer[plan.slots, : plan.kv_len]  # [B, kv_len, H_kv, D]
            out.append(read.transpose(1, 2))
        return out[0], out[1]

    # transformers asks these of a cache; with an explicit 4D mask and position ids they only describe the batch.
    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0 if self._plan is None else self._plan.kv_len

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return (query_length if self._plan is None else self._plan.kv_len), 0

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return -1

    def reset(self) -> None:
        """Free every buffer (no request is live)."""
        self._keys.clear()
        self._values.clear()
        self._slots, self._length = self._initial
        self._plan = None


def single_row_mask(start: int, width: int, dtype: torch.dtype, device) -> torch.Tensor:
    """Additive mask [1, 1, width, start + width] for one unpadded row: causal over its new positions."""
    mask = torch.zeros((width, start + width), dtype=dtype, device=device)
    if width > 1:
        mask[:, start:] = torch.full((width, width), torch.finfo(dtype).min, dtype=dtype, device=device).triu(1)
    return mask.view(1, 1, width, start + width)


def batch_mask(
    starts: list[int], lengths: list[int], width: int, kv_len: int, dtype: torch.dtype, device
) -> torch.Tensor:
    """Additive attention mask [B, 1, width, kv_len] for left-padded rows: row b's input columns
    width - lengths[b] .. width - 1 are its new tokens at cache positions starts[b] ..; each sees its row's cache up to
    and including itself. Padding columns see position 0 only (their outputs are discarded)."""
    B = len(starts)
    starts_t = torch.tensor(starts, device=device).view(B, 1, 1)
    lengths_t = torch.tensor(lengths, device=device).view(B, 1, 1)
    column = torch.arange(width, device=device).view(1, width, 1)
    key = torch.arange(kv_len, device=device).view(1, 1, kv_len)
    position = starts_t + column - (width - lengths_t)  # [B, width, 1]: the column's cache position
    allowed = key <= position.clamp(min=0)
    mask = torch.zeros((B, width, kv_len), dtype=dtype, device=device)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask.unsqueeze(1)


def tree_mask(
    starts: list[int], tails: list[int], lineages: list[list[list[int]]], width: int, kv_len: int, dtype, device
) -> torch.Tensor:
    """Additive mask [B, 1, width, kv_len] for left-padded rows of committed tail tokens then drafted tree nodes.

    Row b: tails[b] committed tokens at cache positions starts[b] .., then node i at position L + i (L = starts[b] +
    tails[b]). A tail token sees the cache up to itself; node i sees positions < L and its ancestors and itself
    (lineages[b][i]), never its siblings or their subtrees. Padding columns see position 0 only."""
    allowed = torch.zeros((len(starts), width, kv_len), dtype=torch.bool)
    allowed[:, :, 0] = True
    for b, (start, tail, nodes) in enumerate(zip(starts, tails, lineages, strict=True)):
        first = width - tail - len(nodes)  # the row's first real column
        end = start + tail  # L
        for j in range(tail):
            allowed[b, first + j, : start + j + 1] = True
        for i, seen in enumerate(nodes):
            column = first + tail + i
            allowed[b, column, :end] = True
            allowed[b, column, [end + a for a in seen]] = True
    mask = torch.zeros((len(starts), width, kv_len), dtype=dtype)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask.unsqueeze(1).to(device)
