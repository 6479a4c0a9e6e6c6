"""A packed, ragged forward pass: every row's new tokens in one sequence, attention per row over its own run.

A batch of requests runs as one packed sequence of N columns (row b's new tokens at columns offset_b ..), so a
prompt's 256-token chunk beside four decoding rows of 5 costs 276 columns, not 5 rows padded to 256, and each row
attends over its own cached length, not the batch's longest. The model's own modules run unchanged (embedding,
rotary positions per column, projections, MLP); only attention is ours, registered with transformers'
`AttentionInterface` so that any architecture whose layers call it runs this way (vLLM's flattened batches).

Attention, two ways over the same plan:
- per row (CPU): each row's queries against its run's keys and values, read as views of the arena; on a CPU the
  attention costs the same row by row as batched (measured on 2 cores: 4 rows x 5 queries over 300-2,800 keys).
- gathered (CUDA): every row's keys gathered into one padded batch and one SDPA call a layer; a GPU is bound by
  kernel launches, and a call per row and layer would multiply them.
Without a plan (a caller's own `generate` on the same model) the model's original attention runs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from specserve.workers.runtime.kv_arena import KVArena


@dataclass
class RaggedRow:
    """One request's columns of a packed pass."""

    base: int  # its run's first row in the arena
    start: int  # positions it holds before the pass: its new tokens are at positions start ..
    offset: int  # its first column in the packed sequence
    n: int  # its new tokens (columns)
    # which cached positions each new token sees, [n, start + n] bool; None: causal (token j sees 0 .. start + j)
    allowed: torch.Tensor | None = None

    @property
    def extent(self) -> int:
        return self.start + self.n


@dataclass
class RaggedPlan:
    """Where a packed pass writes and what each row attends over."""

    arena: KVArena
    rows: list[RaggedRow]
    write: torch.Tensor  # [N] long: the arena row of each packed column's keys/values
    per_row: bool  # attend row by row (CPU) or gathered into one padded batch (CUDA)
    # per row (the per-row way only): additive [1, 1, n, extent] in the model's dtype, None for one query
    masks: list[torch.Tensor | None]
    gathered: tuple[torch.Tensor, ...] | None = None  # the gathered way's indices and mask (see _gather_plan)

    @property
    def kv_len(self) -> int:
        return max(row.extent for row in self.rows)

    @classmethod
    def build(cls, arena: KVArena, rows: Sequence[RaggedRow], dtype: torch.dtype, device: torch.device,
              per_row: bool) -> RaggedPlan:  # fmt: skip
        write = torch.cat([torch.arange(r.base + r.start, r.base + r.extent, dtype=torch.long) for r in rows]).to(
            device
        )  # [N]
        if not per_row:  # one padded mask for the batch
            return cls(arena, list(rows), write, per_row, [], _gather_plan(rows, dtype, device))
        masks = [None if r.n == 1 and r.allowed is None else _additive(allowed_rows(r), dtype, device) for r in rows]
        return cls(arena, list(rows), write, per_row, masks)


def allowed_rows(row: RaggedRow) -> torch.Tensor:
    """[n, extent] bool: the row's own rule, else causal over its new tokens."""
    if row.allowed is not None:
        return row.allowed
    key = torch.arange(row.extent).view(1, -1)
    return key <= (row.start + torch.arange(row.n)).view(-1, 1)


def _additive(allowed: torch.Tensor, dtype: torch.dtype, device) -> torch.Tensor:
    mask = torch.zeros(allowed.shape, dtype=dtype)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask.view(1, 1, *allowed.shape).to(device)


def _gather_plan(rows: Sequence[RaggedRow], dtype, device) -> tuple[torch.Tensor, ...]:
    """For one SDPA call over B padded rows: keys [B, K] (arena rows; a row's tail past its extent repeats its last
    position, masked), queries [B, T] (packed columns; padding repeats the row's first, its output dropped), the
    additive mask [B, 1, T, K], and for each packed column its (row, query slot) flattened to [N]."""
    width, kv_len = max(r.n for r in rows), max(r.extent for r in rows)
    keys = torch.stack([r.base + torch.arange(kv_len).clamp(max=r.extent - 1) for r in rows])  # [B, K]
    queries = torch.stack([r.offset + torch.arange(width).clamp(max=r.n - 1) for r in rows])  # [B, T]
    allowed = torch.zeros((len(rows), width, kv_len), dtype=torch.bool)
    for b, r in enumerate(rows):
        allowed[b, : r.n, : r.extent] = allowed_rows(r)
        allowed[b, r.n :, 0] = True  # padding queries see one position: no row of NaNs
    back = torch.cat([b * width + torch.arange(r.n) for b, r in enumerate(rows)])  # [N]
    mask = torch.zeros(allowed.shape, dtype=dtype).masked_fill_(~allowed, torch.finfo(dtype).min).unsqueeze(1)
    return keys.to(device), queries.to(device), mask.to(device), back.to(device)


def _attend_per_row(plan: RaggedPlan, layer: int, query: torch.Tensor, scaling) -> torch.Tensor:
    """query [1, H, N, D] -> [1, H, N, D], each row against its run."""
    keys, values = plan.arena.layer(layer)
    outs = []
    for row, mask in zip(plan.rows, plan.masks, strict=True):
        q = query[:, :, row.offset : row.offset + row.n]  # [1, H, n, D]
        k = keys[row.base : row.base + row.extent].transpose(0, 1).unsqueeze(0)  # [1, H_kv, extent, D], a view
        v = values[row.base : row.base + row.extent].transpose(0, 1).unsqueeze(0)
        outs.append(F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scaling, enable_gqa=True))
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)


def _attend_gathered(plan: RaggedPlan, layer: int, query: torch.Tensor, scaling) -> torch.Tensor:
    """query [1, H, N, D] -> [1, H, N, D], in one padded call."""
    key_rows, query_columns, mask, back = plan.gathered
    keys, values = plan.arena.layer(layer)
    k = keys[key_rows].permute(0, 2, 1, 3)  # [B, H_kv, K, D]
    v = values[key_rows].permute(0, 2, 1, 3)
    q = query[0][:, query_columns].transpose(0, 1)  # [B, H, T, D]
    groups = q.shape[1] // k.shape[1]
    if groups > 1:  # CUDA's fused kernels take a mask but not grouped heads (masked GQA falls back to math)
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)  # [B, H, K, D]
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scaling)  # [B, H, T, D]
    B, H, T, D = out.shape
    return out.transpose(0, 1).reshape(H, B * T, D)[:, back].unsqueeze(0)  # [1, H, N, D]


def _ragged_attention(fallback: str):
    original = ALL_ATTENTION_FUNCTIONS[fallback]

    def attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, ragged=None, **kwargs):
        if ragged is None:
            return original(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
        attend = _attend_per_row if ragged.per_row else _attend_gathered
        out = attend(ragged, module.layer_idx, query, scaling)  # [1, H, N, D]
        return out.transpose(1, 2).contiguous(), None  # [1, N, H, D], as transformers' attention functions return

    return attention


def use_ragged_attention(model) -> None:
    """Make `model`'s attention layers attend by a RaggedPlan when a pass passes one (`ragged=`), and as before
    otherwise. Its attention implementation must be one transformers registers (sdpa, eager, ...)."""
    current = model.config._attn_implementation or "sdpa"
    if current.startswith("specserve_ragged"):
        return
    name = f"specserve_ragged_{current}"
    if name not in ALL_ATTENTION_FUNCTIONS:
        AttentionInterface.register(name, _ragged_attention(current))
        AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[current])
    model.set_attn_implementation(name)


def single_row_mask(start: int, width: int, dtype: torch.dtype, device) -> torch.Tensor:
    """Additive mask [1, 1, width, start + width] for one unpadded row: causal over its new positions."""
    mask = torch.zeros((width, start + width), dtype=dtype, device=device)
    if width > 1:
        mask[:, start:] = torch.full((width, width), torch.finfo(dtype).min, dtype=dtype, device=device).triu(1)
    return mask.view(1, 1, width, start + width)


def tree_allowed(start: int, tail: int, lineage: list[list[int]]) -> torch.Tensor:
    """[tail + nodes, start + tail + nodes] bool for a row of `tail` committed tokens at positions start .. then
    drafted tree nodes at L + i (L = start + tail): a tail token sees the cache up to itself; node i sees positions
    < L, its ancestors and itself (lineage[i]), never its siblings or their subtrees."""
    n, end = tail + len(lineage), start + tail
    allowed = torch.zeros((n, start + n), dtype=torch.bool)
    for j in range(tail):
        allowed[j, : start + j + 1] = True
    for i, seen in enumerate(lineage):
        allowed[tail + i, :end] = True
        allowed[tail + i, [end + a for a in seen]] = True
    return allowed
