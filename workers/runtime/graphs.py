"""Forward passes replayed as CUDA graphs over static buffers (issue 56 item 2).

On a GPU a small model's step is bound by kernel launches: an eager SmolLM2-135M step took 21 ms on an H200 at any
width, where HF's compiled static cache ran 7.2-7.6x its eager generate. Like SGLang's and vLLM's decode graphs, a
batch that fits a bucket runs as a replay of a graph captured once for that bucket, over buffers whose addresses do
not change: the KV arena (allocated once when a GPU runner is built) and this module's static inputs.

A bucket is (B rows, T columns a row, K attended positions, capture). In a bucket the packed pass is regular: row b's
new tokens sit at columns b*T .. b*T + n_b - 1 (a padding column or row writes its keys to the arena's scratch rows
and sees one position, never a NaN), so the gathered attention's indices (ragged.py) become static tensors whose
values a step copies in. The lm_head runs on every column; the caller's kept columns are picked after the replay.
Prefill chunks wider than the widest bucket, and longer contexts than the largest, run eagerly as before.

The same code runs eagerly (`capture=False`): on a CPU the tests run the padded static path against the packed one,
so the padding, the masks and the column mapping are checked in CI; on CUDA the cuda-marked tests compare replays
with eager passes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch
from torch import Tensor

from specserve.workers.runtime.kv_arena import KVArena
from specserve.workers.runtime.ragged import RaggedPlan, RaggedRow, allowed_rows

T = TypeVar("T")

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
# New positions a row: a step, a chain's k + 1, a tree's root and nodes. 17: k='auto''s 16-node trees (planner/
# tree.py's MAX_TREE_NODES + 1), which ran eagerly at ~28 ms on the H200 under a widest bucket of 16.
WIDTH_BUCKETS = (1, 2, 4, 8, 17)
KV_BUCKETS = (256, 512, 1024, 2048, 4096, 8192)  # attended positions, the longest row's
# Graphs captured at most: each holds its outputs (a bucket of 64 x 17 columns: 107 MB of SmolLM2's bf16 logits)
# outside the KV budget, within the memory it leaves free (memory_budget.LEFT_FREE); past it, new buckets run eagerly.
MAX_GRAPHS = 48
# ...and the outputs they hold, at most this share of the GPU (of LEFT_FREE's 5%): 48 graphs of the widest buckets
# would hold a few GB, more than 5% of a 24 GB GPU.
GRAPH_OUTPUT_SHARE = 0.02


def bucket(n: int, sizes: Sequence[int]) -> int | None:
    return next((s for s in sizes if s >= n), None)


@dataclass(frozen=True)
class BucketKey:
    rows: int
    width: int
    kv_len: int
    capture: bool


class StaticPass:
    """One bucket's static inputs, its plan over them, and (captured) its graph and outputs."""

    def __init__(self, key: BucketKey, arena: KVArena, dtype: torch.dtype, device: torch.device):
        B, T, K, N = key.rows, key.width, key.kv_len, key.rows * key.width
        self.key, self.dtype, self.scratch = key, dtype, arena.scratch_row
        self.input_ids = torch.zeros((1, N), dtype=torch.long, device=device)  # [1, N]
        self.position_ids = torch.zeros((1, N), dtype=torch.long, device=device)  # [1, N]
        self.write = torch.full((N,), arena.scratch_row, dtype=torch.long, device=device)  # [N]
        self.key_rows = torch.full((B, K), arena.scratch_row, dtype=torch.long, device=device)  # [B, K]
        self.mask = torch.zeros((B, 1, T, K), dtype=dtype, device=device)  # [B, 1, T, K] additive
        self.kept = torch.arange(N, device=device)  # [N]: every column's logits
        query_columns = torch.arange(N, device=device).view(B, T)  # [B, T]: regular, no padding to repeat
        gathered = (self.key_rows, query_columns, self.mask, torch.arange(N, device=device))
        self.plan = RaggedPlan(arena, [], self.write, False, [], gathered)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.outputs: tuple[torch.Tensor, torch.Tensor | None] | None = None

    def fill(
        self, rows: Sequence[RaggedRow], news: Sequence[Sequence[int]], positions: Sequence[Sequence[int]]
    ) -> None:
        """Copy a batch into the buffers: real columns where its rows are, padding elsewhere (built on the host,
        one copy a buffer)."""
        B, T, K, scratch, dtype = self.key.rows, self.key.width, self.key.kv_len, self.scratch, self.dtype
        ids = torch.zeros((B, T), dtype=torch.long)
        pos = torch.zeros((B, T), dtype=torch.long)
        write = torch.full((B, T), scratch, dtype=torch.long)
        keys = torch.full((B, K), scratch, dtype=torch.long)
        allowed = torch.zeros((B, T, K), dtype=torch.bool)
        allowed[:, :, 0] = True  # padding rows and columns see one (scratch) position: no row of NaNs
        for b, (row, new, seen) in enumerate(zip(rows, news, positions, strict=True)):
            n, extent = row.n, row.extent
            ids[b, :n] = torch.tensor(new, dtype=torch.long)
            pos[b, :n] = torch.tensor(seen, dtype=torch.long)
            write[b, :n] = torch.arange(row.base + row.start, row.base + extent)
            keys[b] = row.base + torch.arange(K).clamp(max=extent - 1)
            allowed[b, :n] = False
            allowed[b, :n, :extent] = allowed_rows(row)
        mask = torch.zeros((B, T, K), dtype=dtype).masked_fill_(~allowed, torch.finfo(dtype).min)
        self.input_ids.copy_(ids.view(1, -1), non_blocking=True)
        self.position_ids.copy_(pos.view(1, -1), non_blocking=True)
        self.write.copy_(write.view(-1), non_blocking=True)
        self.key_rows.copy_(keys, non_blocking=True)
        self.mask.copy_(mask.unsqueeze(1), non_blocking=True)


class GraphedForward:
    """Runs a runner's packed pass through a bucket's static buffers: replayed as a CUDA graph (`capture`), or eagerly
    over the same buffers (the CPU tests' way)."""

    def __init__(self, arena: KVArena, dtype: torch.dtype, device: torch.device, capture: bool,
                 max_output_bytes: int | None = None):  # fmt: skip
        """max_output_bytes: what the captured graphs' outputs may hold together (default: GRAPH_OUTPUT_SHARE of the
        GPU; no limit without one); new buckets past it run eagerly."""
        self.arena, self.dtype, self.device, self.capture = arena, dtype, device, capture
        self.passes: dict[BucketKey, StaticPass] = {}
        self.pool = torch.cuda.graph_pool_handle() if capture else None
        if max_output_bytes is None and device.type == "cuda":
            max_output_bytes = int(GRAPH_OUTPUT_SHARE * torch.cuda.get_device_properties(device).total_memory)
        self.max_output_bytes = max_output_bytes
        self.output_bytes = 0  # what the recorded graphs' outputs hold

    def key_for(self, rows: Sequence[RaggedRow], capture_features: bool) -> BucketKey | None:
        """The bucket a batch fits, or None (run it eagerly): too many rows, a row too wide (a prompt's chunk), a
        context too long."""
        B = bucket(len(rows), BATCH_BUCKETS)
        T = bucket(max(r.n for r in rows), WIDTH_BUCKETS)
        K = bucket(max(r.extent for r in rows), KV_BUCKETS)
        if B is None or T is None or K is None:
            return None
        key = BucketKey(B, T, K, capture_features)
        if key in self.passes:
            return key
        full = self.max_output_bytes is not None and self.output_bytes >= self.max_output_bytes
        return None if full or len(self.passes) >= MAX_GRAPHS else key

    def run(self, key: BucketKey, forward: Callable, rows: Sequence[RaggedRow], news: Sequence[Sequence[int]],
            positions: Sequence[Sequence[int]], kept: Sequence[int]) -> tuple[torch.Tensor, Tensor | None]:  # fmt: skip
        """The pass as `forward` computes it on the packed batch: logits [1, len(kept), V] at the packed columns
        `kept`, features [1, N, F] (or None) in packed order."""
        static = self.passes.get(key)
        if static is None:
            static = self.passes[key] = StaticPass(key, self.arena, self.dtype, self.device)
        static.fill(rows, news, positions)
        if not self.capture:
            logits, features = self._call(static, forward)
        else:
            if static.graph is None:
                self._record(static, forward)
            static.graph.replay()
            logits, features = static.outputs
        T = key.width
        regular = [b * T + j for b, row in enumerate(rows) for j in range(row.n)]  # packed column -> its column here
        index = torch.tensor([regular[c] for c in kept], device=self.device)
        features = features[:, torch.tensor(regular, device=self.device)] if features is not None else None
        return logits[:, index], features

    def _call(self, static: StaticPass, forward: Callable) -> tuple[torch.Tensor, torch.Tensor | None]:
        self.arena.plan = static.plan
        try:
            out = forward(static.input_ids, static.position_ids, None, self.arena, static.kept, ragged=static.plan)
        finally:
            self.arena.plan = None
        return out if isinstance(out, tuple) else (out, None)

    def _record(self, static: StaticPass, forward: Callable) -> None:
        """Capture the bucket's graph. The warm-up passes run for real on the batch just filled in: they write the
        keys and values its replay writes again."""
        static.graph, static.outputs = record_graph(lambda: self._call(static, forward), self.device, self.pool)
        self.output_bytes += sum(t.nbytes for t in static.outputs if t is not None)


def record_graph(compute: Callable[[], T], device: torch.device, pool) -> tuple[torch.cuda.CUDAGraph, T]:
    """`compute` captured as a CUDA graph, with what it returns (the tensors each replay writes again):
    torch.cuda.graphs' recipe, two warm-up calls on a side stream, then the recording in the memory `pool`."""
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for _ in range(2):
            compute()
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        outputs = compute()
    return graph, outputs
