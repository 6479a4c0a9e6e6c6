"""CUDA graphs for an EAGLE-3 head's drafting: the per-round extension over the new committed entries
(Eagle3Drafting.extend) and the levels of a draft tree (eagle/tree.py). Eager otherwise, as drafting always ran.

A tree level feeds the frontier's K nodes of each row through the head's layer (attending over the row's committed
entries, its ancestors at the earlier levels and itself), then its LM head, and keeps each node's K best children. On
the H200 (2026-12-04) a level ran ~1.4 ms eagerly in a draft worker, a third of a graphed target step: launches.

`EagerLevels` is what drafting always ran: the keys grow by concatenation. `StaticLevels` runs the same computation
on buffers of fixed shape per bucket (rows, committed entries, K): keys and values [B, nkv, S + depth K, hd] with
level d's written at S + (d - 1) K, a mask of the same width, padded rows that see only themselves. `ExtendGraphs`
does the same for the extension, per (rows, new entries, entries held) bucket. With `capture` (CUDA) each bucket (and
tree depth) is recorded once as a CUDA graph and replayed; without it (the CPU tests) the static path runs eagerly,
so that identity with the eager path is tested in CI, as the target's graphs are (runtime/graphs.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specserve.workers.runtime.graphs import bucket, record_graph
from specserve.workers.speculation.eagle.drafting import DraftStep, attend
from specserve.workers.speculation.eagle.head import Eagle3Head

TREE_ROWS = (1, 2, 4, 8, 16, 32, 64)
TREE_CONTEXT = (256, 512, 1024, 2048, 4096)  # committed entries, the longest row's
MAX_LEVEL_GRAPHS = 96  # (bucket, depth) graphs held; later ones run the static path eagerly
MAX_BUCKETS = 16  # buckets' buffers held by each kind of step; past them, eager
# ...and their keys' and values' bytes: the largest bucket, 64 rows x 4K entries, holds ~200 MB in bf16, and a draft
# worker shares its GPU. Past it, eager: memory stays bounded whatever mix of batches and contexts comes.
MAX_BUFFER_BYTES = 512 * 2**20


class _Held:
    """One kind of step's buffers by bucket, within MAX_BUCKETS and MAX_BUFFER_BYTES."""

    def __init__(self):
        self.buffers: dict = {}
        self.bytes = 0

    def get(self, key, head: Eagle3Head, rows: int, width: int, make):
        """The bucket's buffers (`make()` them when new and within the caps: keys and values of `rows` x `width`
        entries), or None."""
        if key in self.buffers:
            return self.buffers[key]
        cfg = head.config
        size = 2 * rows * cfg.num_key_value_heads * width * cfg.head_dim * head.fc.weight.element_size()
        if len(self.buffers) >= MAX_BUCKETS or self.bytes + size > MAX_BUFFER_BYTES:
            return None
        self.buffers[key] = make()
        self.bytes += size
        return self.buffers[key]


@dataclass(frozen=True)
class LevelBucket:
    rows: int
    context: int
    topk: int
    depth: int  # the tree's deepest level: the buffers hold the committed entries and that many levels


class EagerLevels:
    """A tree's levels as drafting ran them before graphs: keys and values concatenated level by level."""

    def __init__(self, head: Eagle3Head, embed: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                 committed: torch.Tensor):  # fmt: skip
        """keys, values [B, nkv, S, hd]: the rows' committed entries, right-padded; committed [B, 1, S] (True: held)."""
        self.head, self.embed = head, embed
        self.keys, self.values, self.committed = [keys], [values], committed

    def run(self, depth: int, tokens: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
            ancestors: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
        """Level `depth` (1..): tokens [B, K] (target ids), hidden [B, K, H], positions [B, K]; ancestors: per earlier
        level, [B, K, K] (True: that level's node is this node's ancestor) -> the nodes' outputs [B, K, H] and their K
        best children: log-probabilities [B, K, K] and draft ids [B, K, K]."""
        head = self.head
        batch, k = tokens.shape
        q, key, value, residual = head.qkv(F.embedding(tokens, self.embed), hidden, positions)
        self.keys.append(key)
        self.values.append(value)
        itself = torch.eye(k, dtype=torch.bool, device=tokens.device).expand(batch, k, k)
        mask = torch.cat([self.committed.expand(batch, k, -1), *ancestors, itself], dim=-1)[:, None]
        out = head.finish(attend(q, torch.cat(self.keys, dim=2), torch.cat(self.values, dim=2), mask), residual)
        child = head.logits(out).float().log_softmax(-1).topk(k, dim=-1)
        return out, child.values, child.indices


class _Buffers:
    """One bucket's static inputs and keys/values; per depth its graph (CUDA) and the outputs it writes."""

    def __init__(self, head: Eagle3Head, key: LevelBucket, device: torch.device):
        cfg, dtype = head.config, head.fc.weight.dtype
        B, S, K, D = key.rows, key.context, key.topk, key.depth
        width = S + D * K
        self.key = key
        self.keys = torch.zeros(B, cfg.num_key_value_heads, width, cfg.head_dim, dtype=dtype, device=device)
        self.values = torch.zeros_like(self.keys)
        self.mask = torch.zeros(B, 1, K, width, dtype=torch.bool, device=device)
        self.tokens = torch.zeros(B, K, dtype=torch.long, device=device)
        self.hidden = torch.zeros(B, K, cfg.hidden_size, dtype=dtype, device=device)
        self.positions = torch.zeros(B, K, dtype=torch.long, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}


class StaticLevels:
    """A tree's levels on one bucket's static buffers (see the module's docstring)."""

    def __init__(self, graphs: LevelGraphs, buffers: _Buffers, batch: int, keys: torch.Tensor, values: torch.Tensor,
                 committed: torch.Tensor):  # fmt: skip
        self.graphs, self.buffers, self.batch = graphs, buffers, batch
        b, S = buffers, buffers.key.context
        held = keys.shape[2]
        # entries past a row's own are masked (weight 0): what earlier trees left there is never read into an output
        b.keys[:batch, :, :held] = keys
        b.values[:batch, :, :held] = values
        b.mask.zero_()
        b.mask[:batch, :, :, :held] = committed[:, :, None, :]
        eye = torch.eye(buffers.key.topk, dtype=torch.bool, device=keys.device)
        b.mask[batch:, 0, :, S : S + buffers.key.topk] = eye  # padded rows see themselves at level 1 (no empty rows)

    def run(self, depth: int, tokens: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
            ancestors: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
        """As `EagerLevels.run`."""
        b, batch, S, K = self.buffers, self.batch, self.buffers.key.context, self.buffers.key.topk
        b.tokens[:batch] = tokens
        b.hidden[:batch] = hidden
        b.positions[:batch] = positions
        for level, seen in enumerate(ancestors):
            b.mask[:batch, 0, :, S + level * K : S + (level + 1) * K] = seen
        low = S + (depth - 1) * K
        b.mask[:batch, 0, :, low : low + K] = torch.eye(K, dtype=torch.bool, device=tokens.device)
        if depth > 1:  # padded rows: themselves only, at this level too
            b.mask[batch:, 0, :, low : low + K] = torch.eye(K, dtype=torch.bool, device=tokens.device)
        out, values, indices = self.graphs.level(b, depth)
        return out[:batch], values[:batch], indices[:batch]


class _StepGraphs:
    """What the three kinds of static step share: the head and the embedding they run, whether they record CUDA
    graphs, their buffers by bucket within the caps, and one memory pool for their graphs."""

    def __init__(self, head: Eagle3Head, embed: torch.Tensor, capture: bool):
        self.head, self.embed, self.capture = head, embed, capture
        self.held = _Held()
        self.pool = torch.cuda.graph_pool_handle() if capture else None

    @property
    def buffers(self) -> dict:
        return self.held.buffers


class LevelGraphs(_StepGraphs):
    """A head's static tree levels by bucket; with `capture` (CUDA), each (bucket, depth) a CUDA graph."""

    def __init__(self, head: Eagle3Head, embed: torch.Tensor, capture: bool):
        super().__init__(head, embed, capture)
        self.recorded = 0

    def levels(self, keys: torch.Tensor, values: torch.Tensor, committed: torch.Tensor, topk: int,
               depth: int) -> StaticLevels | None:  # fmt: skip
        """The static levels for a tree of these rows (keys, values [B, nkv, S, hd]; committed [B, 1, S]), or None
        when no bucket fits (more rows, a longer context)."""
        rows, context = bucket(keys.shape[0], TREE_ROWS), bucket(keys.shape[2], TREE_CONTEXT)
        if rows is None or context is None:
            return None
        key = LevelBucket(rows, context, topk, depth)
        made = self.held.get(
            key, self.head, rows, context + depth * topk, lambda: _Buffers(self.head, key, keys.device)
        )
        return StaticLevels(self, made, keys.shape[0], keys, values, committed) if made is not None else None

    def level(self, b: _Buffers, depth: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if not self.capture:
            return self._compute(b, depth)
        if depth not in b.graphs:
            if self.recorded >= MAX_LEVEL_GRAPHS:
                return self._compute(b, depth)
            self._record(b, depth)
        b.graphs[depth].replay()
        return b.outputs[depth]

    def _compute(self, b: _Buffers, depth: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        head, K, end = self.head, b.key.topk, b.key.context + depth * b.key.topk
        q, key, value, residual = head.qkv(F.embedding(b.tokens, self.embed), b.hidden, b.positions)
        b.keys[:, :, end - K : end] = key
        b.values[:, :, end - K : end] = value
        attn = attend(q, b.keys[:, :, :end], b.values[:, :, :end], b.mask[..., :end])
        out = head.finish(attn, residual)
        child = head.logits(out).float().log_softmax(-1).topk(K, dim=-1)
        return out, child.values, child.indices

    @torch.no_grad()
    def _record(self, b: _Buffers, depth: int) -> None:
        b.graphs[depth], b.outputs[depth] = record_graph(lambda: self._compute(b, depth), b.tokens.device, self.pool)
        self.recorded += 1


EXTEND_WIDTHS = (1, 2, 4, 8, 17)  # new entries a row a round: 1 + the accepted tokens of a 16-node tree at most


@dataclass(frozen=True)
class ExtendBucket:
    rows: int
    width: int
    context: int  # the rows' entries held before this extension, the longest row's


class _ExtendBuffers:
    def __init__(self, head: Eagle3Head, key: ExtendBucket, feature_size: int, device: torch.device):
        cfg, dtype = head.config, head.fc.weight.dtype
        B, M, S = key.rows, key.width, key.context
        self.key = key
        self.features = torch.zeros(B, M, feature_size, device=device)
        self.tokens = torch.zeros(B, M, dtype=torch.long, device=device)
        self.positions = torch.zeros(B, M, dtype=torch.long, device=device)
        self.keys = torch.zeros(B, cfg.num_key_value_heads, S + M, cfg.head_dim, dtype=dtype, device=device)
        self.values = torch.zeros_like(self.keys)
        self.mask = torch.zeros(B, 1, M, S + M, dtype=torch.bool, device=device)
        self.newest = torch.zeros(B, dtype=torch.long, device=device)  # each row's last new entry
        self.graph: torch.cuda.CUDAGraph | None = None
        self.outputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None


class ExtendGraphs(_StepGraphs):
    """The head's per-round extension over the rows' new committed entries (Eagle3Drafting.extend) on static buffers
    per (rows, new entries, entries held) bucket: a row's new entries see its held ones and the new ones up to
    themselves; a padded row or column sees its own entry only. With `capture` (CUDA), a graph per bucket."""

    def bucket(self, counts: list[int], held: int) -> ExtendBucket | None:
        rows, width = bucket(len(counts), TREE_ROWS), bucket(max(counts), EXTEND_WIDTHS)
        context = bucket(max(held, 1), TREE_CONTEXT)
        if rows is None or width is None or context is None:
            return None
        return ExtendBucket(rows, width, context)

    def run(self, key: ExtendBucket, features: list[torch.Tensor], tokens: list[list[int]], starts: list[int],
            keys: torch.Tensor, values: torch.Tensor, held: list[int]) -> tuple[torch.Tensor, ...] | None:  # fmt: skip
        """Rows' new entries: features [m_b, F] each, their tokens, the position of the first; keys, values [B, nkv,
        S, hd] the entries held (right-padded), `held` per row -> the new entries' keys and values [B, nkv, M, hd]
        and the rows' newest outputs [B, H] (the padded rows' too: the caller keeps its own); None past the caps
        (the caller runs the eager extension)."""
        b = self.held.get(key, self.head, key.rows, key.context + key.width,
                          lambda: _ExtendBuffers(self.head, key, features[0].shape[-1], keys.device))  # fmt: skip
        if b is None:
            return None
        batch, S, M = len(features), key.context, key.width
        device = keys.device
        b.features.zero_()
        b.tokens.zero_()
        b.mask.zero_()
        b.keys[:batch, :, : keys.shape[2]] = keys
        b.values[:batch, :, : values.shape[2]] = values
        causal = torch.ones(M, M, dtype=torch.bool, device=device).tril()
        b.mask[:, 0, :, S:] = causal  # the new entries: each sees those up to itself (padding columns too)
        counts = []
        for r, (row_features, row_tokens) in enumerate(zip(features, tokens, strict=True)):
            m = row_features.shape[0]
            counts.append(m)
            b.features[r, :m] = row_features.to(device=device, dtype=b.features.dtype)
            b.tokens[r, :m] = torch.as_tensor(list(row_tokens), dtype=torch.long, device=device)
            b.mask[r, 0, :, : held[r]] = True
        first = torch.tensor(starts + [0] * (key.rows - batch), device=device)
        b.positions.copy_(first[:, None] + torch.arange(M, device=device))
        b.newest.copy_(torch.tensor(counts + [1] * (key.rows - batch), device=device) - 1)
        if not self.capture:
            return self._compute(b)
        if b.graph is None:
            self._record(b)
        b.graph.replay()
        return b.outputs

    def _compute(self, b: _ExtendBuffers) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        head, S = self.head, b.key.context
        q, k, v, residual = head.qkv(F.embedding(b.tokens, self.embed), head.project(b.features), b.positions)
        b.keys[:, :, S:] = k
        b.values[:, :, S:] = v
        out = head.finish(attend(q, b.keys, b.values, b.mask), residual)  # [B, M, H]
        newest = out.gather(1, b.newest[:, None, None].expand(-1, 1, out.shape[-1]))[:, 0]  # [B, H]
        return k, v, newest

    @torch.no_grad()
    def _record(self, b: _ExtendBuffers) -> None:
        b.graph, b.outputs = record_graph(lambda: self._compute(b), b.tokens.device, self.pool)


CHAIN_STEPS = 16  # chained steps a bucket holds: a chain of k drafts takes k - 1 (SpecParams' k is at most 16)


@dataclass(frozen=True)
class ChainBucket:
    rows: int
    context: int  # the rows' committed entries, the longest row's


class _ChainBuffers:
    def __init__(self, head: Eagle3Head, key: ChainBucket, device: torch.device):
        cfg, dtype = head.config, head.fc.weight.dtype
        B, S = key.rows, key.context
        self.key = key
        self.keys = torch.zeros(B, cfg.num_key_value_heads, S + CHAIN_STEPS, cfg.head_dim, dtype=dtype, device=device)
        self.values = torch.zeros_like(self.keys)
        self.mask = torch.zeros(B, 1, 1, S + CHAIN_STEPS, dtype=torch.bool, device=device)
        self.tokens = torch.zeros(B, dtype=torch.long, device=device)
        self.hidden = torch.zeros(B, cfg.hidden_size, dtype=dtype, device=device)
        self.positions = torch.zeros(B, dtype=torch.long, device=device)  # of the chain's first entry
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}


class StaticChain:
    """DraftChain's steps (eagle/drafting.py) on a bucket's static buffers: step j writes its entry at S + j - 1 and
    attends over the row's committed entries and the chain's entries up to its own; a padded row sees the chain's."""

    def __init__(self, graphs: ChainGraphs, b: _ChainBuffers, keys: torch.Tensor, values: torch.Tensor,
                 counts: list[int], hidden: torch.Tensor, positions: torch.Tensor):  # fmt: skip
        self.graphs, self.b, self.batch, self.j = graphs, b, len(counts), 0
        S, device = b.key.context, keys.device
        b.keys[: self.batch, :, : keys.shape[2]] = keys
        b.values[: self.batch, :, : values.shape[2]] = values
        b.mask.zero_()
        b.mask[: self.batch, 0, 0, :S] = (
            torch.arange(S, device=device)[None, :] < torch.tensor(counts, device=device)[:, None]
        )
        b.mask[:, 0, 0, S:] = True  # the chain's own entries (a step attends those up to its own only)
        b.hidden.zero_()
        b.hidden[: self.batch] = hidden
        b.positions.zero_()
        b.positions[: self.batch] = positions

    def step(self, tokens: torch.Tensor) -> DraftStep:
        """As DraftChain.step: tokens [B] the rows' last drafted tokens (target ids) -> the DraftStep after them."""
        self.j += 1
        if self.j > CHAIN_STEPS:
            raise ValueError(f"a static chain holds {CHAIN_STEPS} steps")
        self.b.tokens[: self.batch] = tokens.to(self.b.tokens.device)
        logits, hidden = self.graphs.step(self.b, self.j)
        self.b.hidden.copy_(hidden)  # the next step's input (outside the graph: its warm-ups must not move it)
        return DraftStep(logits[: self.batch], hidden[: self.batch])


class ChainGraphs(_StepGraphs):
    """A head's chained drafting steps on static buffers per (rows, committed entries) bucket; with `capture` (CUDA),
    a graph per (bucket, step)."""

    def chain(self, keys: torch.Tensor, values: torch.Tensor, counts: list[int], hidden: torch.Tensor,
              positions: torch.Tensor) -> StaticChain | None:  # fmt: skip
        """A chain after the rows' committed entries (keys, values [B, nkv, S, hd], right-padded; counts per row),
        from their newest outputs `hidden` [B, H] at `positions` [B] (the first chained entry's); None where no
        bucket fits."""
        rows, context = bucket(len(counts), TREE_ROWS), bucket(max(keys.shape[2], 1), TREE_CONTEXT)
        if rows is None or context is None:
            return None
        key = ChainBucket(rows, context)
        made = self.held.get(
            key, self.head, rows, context + CHAIN_STEPS, lambda: _ChainBuffers(self.head, key, keys.device)
        )
        return StaticChain(self, made, keys, values, counts, hidden, positions) if made is not None else None

    def step(self, b: _ChainBuffers, j: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.capture:
            return self._compute(b, j)
        if j not in b.graphs:
            b.graphs[j], b.outputs[j] = record_graph(lambda: self._compute(b, j), b.tokens.device, self.pool)
        b.graphs[j].replay()
        return b.outputs[j]

    def _compute(self, b: _ChainBuffers, j: int) -> tuple[torch.Tensor, torch.Tensor]:
        head, end = self.head, b.key.context + j
        positions = (b.positions + (j - 1))[:, None]  # [B, 1]
        q, k, v, residual = head.qkv(F.embedding(b.tokens[:, None], self.embed), b.hidden[:, None], positions)
        b.keys[:, :, end - 1 : end] = k
        b.values[:, :, end - 1 : end] = v
        hidden = head.finish(attend(q, b.keys[:, :, :end], b.values[:, :, :end], b.mask[..., :end]), residual)[:, 0]
        return head.logits(hidden), hidden
