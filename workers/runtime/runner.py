"""A model bound to a KV-cache store: forward passes that reuse and roll back each request's cache."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specserve.workers.config.settings import KVCacheConfig
from specserve.workers.runtime.kv_cache import KVCacheStore
from specserve.workers.runtime.lean_forward import CaptureForward, capture_forward, full_forward, lean_forward
from specserve.workers.runtime.loading import LoadedModel
from specserve.workers.runtime.memory_budget import kv_budget
from specserve.workers.runtime.slot_cache import BatchPlan, ScatterPlan, batch_mask, single_row_mask, tree_mask
from specserve.workers.runtime.tree_rows import TreeRow

# A pass attends over every row's slot up to the batch's longest row (and gathers that much of each slot when the
# slots are not consecutive): rows reaching less than this share of the longest go in their own pass. One 4K-token
# prompt's 16-position chunk batched with four chat rows of ~300 cost 0.5-0.6 s on 2 cores, ten times its own. On a
# CPU only: a GPU's forward is launch-bound (21 ms at any width on an H200, eager), so a second pass would cost more
# than the padded attention it saves, until measured there (docs/gpu.md).
EXTENT_SHARE = 0.5
PROFILE_TOKENS = 4096  # BatchingConfig.max_batch_tokens' default: the most positions one pass feeds


@dataclass(frozen=True)
class ForwardRow:
    """One request's row of a forward pass (`ModelRunner.forward_batch`): its tokens and how many logits it wants."""

    request_id: str
    sequence: Sequence[int]  # the request's whole sequence; only the positions its cache does not hold are fed
    n: int  # logits wanted: after each of the sequence's last n positions (1 <= n <= len(sequence))
    prefix_at_most: int | None = None  # a request new here: the most positions taken from a cached prefix (kv_cache)

    def check(self) -> None:
        """ValueError unless 1 <= n <= len(sequence)."""
        if not 1 <= self.n <= len(self.sequence):
            raise ValueError(f"need 1 <= n <= len(sequence), got n={self.n}, len={len(self.sequence)}")


@dataclass
class RowOutput:
    """One row of a forward pass."""

    logits: torch.Tensor  # [n, vocab_size] float32: predicting the token after each of the row's last n positions
    # [m, F]: the captured features of the m positions this pass computed for the row, positions start..start+m-1
    # (None unless captured)
    features: torch.Tensor | None
    start: int  # the row's cached length before the pass: the position of its first computed token


class ModelRunner:
    """Runs one model for many requests, each with its own KV cache (a slot of one shared buffer).

    The primitive is `logits_for_batch([ForwardRow(request_id, sequence, n), ...])`: for each row, the model's logits
    at the last n positions of `sequence`, computing only the positions the request's cache does not already hold, all
    rows in one forward pass. Rejected draft tokens left in a cache are detected by token comparison and rolled back
    before anything is fed on top of them.
    """

    def __init__(self, loaded: LoadedModel, kv_config: KVCacheConfig, vocab_size: int | None = None):
        self.loaded = loaded
        self.model = loaded.model
        self.device = loaded.device
        self.vocab_size = vocab_size or loaded.vocab_size  # logits are cut/padded to this width
        lean = lean_forward(self.model)
        self.lean = lean is not None  # transformers' wrappers skipped, same logits (workers/runtime/lean_forward.py)
        self._forward = lean or full_forward(self.model)
        self._capture_forward: CaptureForward | None = None
        self.capture_layers: tuple[int, ...] | None = None  # set by capture_features
        self.forward_calls = 0
        self.forward_positions = 0
        self._trees: dict[str, tuple[int, list[int]]] = {}  # request -> (its tree's first position, its tokens)
        bytes_per_token = loaded.kv_bytes_per_token
        self.store = KVCacheStore(kv_config, bytes_per_token, PROFILE_TOKENS)  # for the profiling forward only
        self.budget = kv_budget(kv_config, self.device, bytes_per_token, profile=self._profile_forward)
        self.store = KVCacheStore(kv_config, bytes_per_token, self.budget.capacity_tokens)
        self.forward_calls = self.forward_positions = 0

    def _profile_forward(self) -> None:
        """The largest forward a worker runs (a batch's token budget of prompt), for the activations' peak memory."""
        n = min(PROFILE_TOKENS, self.loaded.max_positions or PROFILE_TOKENS)
        self.forward_batch([ForwardRow("memory-profile", [3 + (7 * i) % 100 for i in range(n)], 1)])

    def capture_features(self, layers: Sequence[int]) -> None:
        """Let `forward_batch(..., capture=True)` return the residual stream entering `layers` (Hugging Face's
        `hidden_states[i]`) at every position it computes, concatenated. Without this no hidden state is kept."""
        layers = tuple(layers)
        self._capture_forward = capture_forward(self.model, layers, self.lean)
        self.capture_layers = layers

    def logits_for(self, request_id: str, sequence: Sequence[int], n: int) -> torch.Tensor:
        """Logits predicting the token after each of the last n positions of `sequence`: [n, vocab_size] float32."""
        return self.logits_for_batch([ForwardRow(request_id, sequence, n)])[0]

    def logits_for_batch(self, rows: Sequence[ForwardRow]) -> list[torch.Tensor]:
        """One forward pass for many requests: each row's [n, vocab_size] logits.

        Rows are ragged (own cached length, own number of new tokens) and independent: a row's logits are those it
        would get alone. Raises KVCapacityError, reserving nothing, when the batch's new positions do not fit."""
        return [out.logits for out in self.forward_batch(rows)]

    @torch.inference_mode()
    def forward_batch(self, rows: Sequence[ForwardRow], capture: bool = False) -> list[RowOutput]:
        """`logits_for_batch`, with each row's features too when `capture` (after `capture_features`)."""
        ids = [row.request_id for row in rows]
        self._check_batch(ids, capture)
        for row in rows:
            row.check()
        entries = [self.store.sync(r.request_id, r.sequence, len(r.sequence) - r.n, r.prefix_at_most) for r in rows]
        starts = [e.length for e in entries]
        news = [list(row.sequence[start:]) for row, start in zip(rows, starts, strict=True)]
        lengths = [len(new) for new in news]
        self.store.reserve_batch(ids, lengths)
        self.store.fit_buffers(ids, max(start + n for start, n in zip(starts, lengths, strict=True)) - 1)
        outputs: list[RowOutput | None] = [None] * len(rows)
        extents = [start + n for start, n in zip(starts, lengths, strict=True)]
        for group in by_extent(extents) if self.device.type == "cpu" else [list(range(len(rows)))]:
            slots = [entries[i].slot for i in group]  # read after fit_buffers: it may move them
            g_starts, g_news = [starts[i] for i in group], [news[i] for i in group]
            input_ids, positions, mask = self._plan(g_starts, g_news, slots)
            ran = self._run(input_ids, positions, mask, g_news, g_starts, [rows[i].n for i in group], capture)
            for i, out in zip(group, ran, strict=True):
                outputs[i] = out
        for rid, new in zip(ids, news, strict=True):
            self.store.commit(rid, new)
            self.store.written(rid, new)
        return outputs

    @torch.inference_mode()
    def forward_tree(self, rows: Sequence[TreeRow], capture: bool = False) -> list[RowOutput]:
        """One forward pass over each row's uncached committed tokens and its drafted tree. A row's logits are
        [N + 1, vocab_size]: after its last committed token, then after each node; its features (with `capture`) are
        those of its uncached committed tokens, then of each node. Node i attends to the committed tokens and its
        own ancestors only, at rotary position L + its depth (L: committed tokens), as if its path were decoded
        alone. The tree is not kept as the request's: `keep_path` keeps the accepted nodes."""
        ids = [row.request_id for row in rows]
        self._check_batch(ids, capture)
        for row in rows:
            row.check()
        entries = [self.store.sync(r.request_id, r.sequence, len(r.sequence) - 1, r.prefix_at_most) for r in rows]
        starts = [e.length for e in entries]
        tails = [list(row.sequence[start:]) for row, start in zip(rows, starts, strict=True)]
        news = [tail + list(row.tokens) for tail, row in zip(tails, rows, strict=True)]
        self.store.reserve_batch(ids, [len(new) for new in news])  # the tree's positions, while it is verified
        self.store.fit_buffers(ids, max(start + len(new) for start, new in zip(starts, news, strict=True)) - 1)
        input_ids, pads, plan = self._left_padded(starts, news, [e.slot for e in entries])
        positions = torch.tensor(
            [
                [0] * p + list(range(st, st + len(tail))) + [st + len(tail) + d for d in row.depths()]
                for p, st, tail, row in zip(pads, starts, tails, rows, strict=True)
            ],
            device=self.device,
        )  # fmt: skip  [B, T]: a node sits at its depth below the last committed token
        mask = tree_mask(starts, [len(t) for t in tails], [row.lineages() for row in rows], input_ids.shape[1],
                         plan.kv_len, self.model.dtype, self.device)  # fmt: skip
        outputs = self._run(input_ids, positions, mask, news, starts, [len(row.tokens) + 1 for row in rows], capture)
        for row, tail, start in zip(rows, tails, starts, strict=True):
            self.store.commit(row.request_id, tail)
            self.store.written(row.request_id, tail, overwrote=True)
            self._trees[row.request_id] = (start + len(tail), list(row.tokens))
        return outputs

    @torch.inference_mode()  # the cache's buffers are inference tensors
    def keep_path(self, request_id: str, nodes: Sequence[int]) -> None:
        """After the request's tree was verified: its cache also holds the accepted nodes (a root-down path, in that
        order), their keys/values moved next to the committed ones. The rest of the tree is forgotten."""
        start, tokens = self._trees.pop(request_id)
        entry = self.store.get(request_id)
        if entry.length != start:
            raise ValueError(f"{request_id!r}: its cache changed since its tree's forward pass")
        if nodes:
            self.store.cache.move(entry.slot, [start + i for i in nodes], start)
            self.store.commit(request_id, [tokens[i] for i in nodes])

    def _check_batch(self, ids: list[str], capture: bool) -> None:
        if len(set(ids)) != len(ids):
            raise ValueError("a request may appear only once in a batch")
        if capture and self._capture_forward is None:
            raise ValueError("capture=True needs capture_features(layers) first")

    def _plan(self, starts: list[int], news: list[list[int]], slots: list[int]) -> tuple[torch.Tensor, ...]:
        """Plan the cache for the batch's new positions; returns input_ids [B, T], positions [B, T] and the mask."""
        lengths = [len(new) for new in news]
        width = max(lengths)
        B = len(news)
        kv_len = max(start + n for start, n in zip(starts, lengths, strict=True))
        if B == 1:  # the common decode step: plain slices, no index tensors
            start = starts[0]
            input_ids = torch.tensor([news[0]], device=self.device)  # [1, T]
            positions = torch.arange(start, start + width, device=self.device).unsqueeze(0)  # [1, T]
            plan = BatchPlan(slots=None, write=None, kv_len=kv_len, contiguous=slice(slots[0], slots[0] + 1),
                             single_start=start)  # fmt: skip
            mask = single_row_mask(start, width, self.model.dtype, self.device)
            self.store.plan_buffers(plan, max_slot=slots[0], max_position=start + width - 1)
            return input_ids, positions, mask
        input_ids, pads, plan = self._left_padded(starts, news, slots)
        positions = torch.tensor(
            [[0] * p + list(range(st, st + n)) for p, st, n in zip(pads, starts, lengths, strict=True)],
            device=self.device,
        )  # [B, T]
        return input_ids, positions, batch_mask(starts, lengths, width, plan.kv_len, self.model.dtype, self.device)

    def _left_padded(
        self, starts: list[int], news: list[list[int]], slots: list[int]
    ) -> tuple[torch.Tensor, list[int], BatchPlan]:
        """Left-padded rows, built as lists and converted once: input_ids [B, T], each row's padding, and the cache
        planned for them (padding columns write nothing: a row's positions past its end may be spare, kv_cache.py)."""
        width = max(len(new) for new in news)
        pads = [width - len(new) for new in news]
        input_ids = torch.tensor([[0] * p + new for p, new in zip(pads, news, strict=True)], device=self.device)
        rows, columns, positions = [], [], []
        for b, (st, new, pad) in enumerate(zip(starts, news, pads, strict=True)):
            rows += [b] * len(new)
            columns += range(pad, width)
            positions += range(st, st + len(new))
        consecutive = slots == list(range(slots[0], slots[0] + len(slots)))
        plan = BatchPlan(
            slots=torch.tensor(slots, device=self.device),
            write=ScatterPlan.of(rows, columns, [slots[b] for b in rows], positions, self.device),
            kv_len=max(st + len(new) for st, new in zip(starts, news, strict=True)),
            contiguous=slice(slots[0], slots[0] + len(slots)) if consecutive else None,
        )
        self.store.plan_buffers(plan, max_slot=max(slots), max_position=plan.kv_len - 1)
        return input_ids, pads, plan

    def _run(self, input_ids, positions, mask, news: list[list[int]], starts: list[int], keeps: list[int],
             capture: bool) -> list[RowOutput]:  # fmt: skip
        """The planned forward pass; each row's logits at its last keeps[b] positions (and its features)."""
        keep = max(keeps)
        if capture:
            out, features = self._capture_forward(input_ids, positions, mask, self.store.cache, keep)
        else:
            out, features = self._forward(input_ids, positions, mask, self.store.cache, keep), None  # [B, keep, V]
        self.forward_calls += 1
        self.forward_positions += sum(len(new) for new in news)
        logits = out.float()  # [B, keep, V]
        width = input_ids.shape[1]
        return [
            RowOutput(
                logits=self._fit_vocab(logits[b, keep - n :]),  # [n, V]
                features=features[b, width - len(news[b]) :] if features is not None else None,  # left-padded rows
                start=starts[b],
            )
            for b, n in enumerate(keeps)
        ]

    def _fit_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """[n, V_model] -> [n, vocab_size]: drop padded rows, or pad with -inf (never sampled)."""
        v = logits.shape[-1]
        if v == self.vocab_size:
            return logits
        if v > self.vocab_size:
            return logits[:, : self.vocab_size]
        pad = logits.new_full((logits.shape[0], self.vocab_size - v), float("-inf"))
        return torch.cat([logits, pad], dim=-1)

    def release(self, request_id: str) -> bool:
        self._trees.pop(request_id, None)
        return self.store.release(request_id)


def by_extent(extents: Sequence[int]) -> list[list[int]]:
    """The rows (indices) of a batch in passes: longest first, each pass's rows reaching at least EXTENT_SHARE of its
    longest one's extent (cached length + new positions)."""
    order = sorted(range(len(extents)), key=lambda i: -extents[i])
    groups: list[list[int]] = []
    for i in order:
        if groups and extents[i] >= EXTENT_SHARE * extents[groups[-1][0]]:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups
