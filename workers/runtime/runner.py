"""A model bound to a KV-cache store: forward passes that reuse and roll back each request's cache."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specserve.workers.config.settings import KVCacheConfig
from specserve.workers.runtime.graphs import GraphedForward
from specserve.workers.runtime.kv_cache import KVCacheStore
from specserve.workers.runtime.lean_forward import CaptureForward, capture_forward, full_forward, lean_forward
from specserve.workers.runtime.loading import LoadedModel
from specserve.workers.runtime.memory_budget import kv_budget
from specserve.workers.runtime.ragged import RaggedPlan, RaggedRow, tree_allowed, use_ragged_attention
from specserve.workers.runtime.tree_rows import TreeRow

ARENA_ROW = "kv-arena-allocation"  # the request id of the pass that allocates the arena
PROFILE_TOKENS = 4096  # BatchingConfig.max_batch_tokens' default: the most positions one pass feeds


def probe_ids(n: int, vocab: int) -> list[int]:
    """n token ids, varied and inside a vocabulary of `vocab` tokens, for the passes that allocate and profile memory:
    on a GPU an id past the embedding is a device-side assert that poisons the whole process, not an IndexError."""
    return [(3 + 7 * i) % vocab for i in range(n)]


@dataclass(frozen=True)
class ForwardRow:
    """One request's row of a forward pass (`ModelRunner.forward_batch`): its tokens and how many logits it wants."""

    request_id: str
    sequence: Sequence[int]  # the request's whole sequence; only the positions its cache does not hold are fed
    n: int  # logits wanted: after each of the sequence's last n positions (1 <= n <= len(sequence))
    prefix_at_most: int | None = None  # a request new here: the most positions taken from a cached prefix (kv_cache)
    expected_len: int | None = None  # the length the sequence soon reaches (a chunked prompt's): its KV run's size

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
    """Runs one model for many requests, each with its own KV cache (a run of the worker's KV arena).

    The primitive is `logits_for_batch([ForwardRow(request_id, sequence, n), ...])`: for each row, the model's logits
    at the last n positions of `sequence`, computing only the positions the request's cache does not already hold, all
    rows in one packed, ragged forward pass (ragged.py). Rejected draft tokens left in a cache are detected by token
    comparison and rolled back before anything is fed on top of them.
    """

    def __init__(self, loaded: LoadedModel, kv_config: KVCacheConfig, vocab_size: int | None = None):
        self.loaded = loaded
        self.model = loaded.model
        self.device = loaded.device
        self.vocab_size = vocab_size or loaded.vocab_size  # logits are cut/padded to this width
        use_ragged_attention(self.model)
        self.per_row = self.device.type == "cpu"  # attention row by row (CPU) or gathered in one call (ragged.py)
        lean = lean_forward(self.model)
        self.lean = lean is not None  # transformers' wrappers skipped, same logits (workers/runtime/lean_forward.py)
        self._forward = lean or full_forward(self.model)
        self._capture_forward: CaptureForward | None = None
        self.capture_layers: tuple[int, ...] | None = None  # set by capture_features
        self.forward_calls = 0
        self.forward_positions = 0
        self.forward_seconds = 0.0
        self.graphs: GraphedForward | None = None  # set once the arena is (below): the profiling passes run eagerly
        self._trees: dict[str, tuple[int, list[int]]] = {}  # request -> (its tree's first position, its tokens)
        bytes_per_token = loaded.kv_bytes_per_token
        self.store = KVCacheStore(kv_config, bytes_per_token, PROFILE_TOKENS)  # for the profiling forward only
        weights = sum(t.numel() * t.element_size() for t in (*self.model.parameters(), *self.model.buffers()))
        self.budget = kv_budget(kv_config, self.device, bytes_per_token, self._profile_forward, weights)
        self.store = KVCacheStore(kv_config, bytes_per_token, self.budget.capacity_tokens)
        if self.device.type == "cuda":  # a CPU's pages are touched only as positions are written: lazily there
            self.allocate_arena()
        # CUDA graphs over static buffers where the lean path runs (its layers are called directly, nothing host-side
        # depends on a tensor's values); eager on a CPU and with enforce_eager (vLLM's flag).
        # A tensor-parallel rank's pass holds collectives, which every rank would have to capture in step: eager.
        sharded = torch.distributed.is_available() and torch.distributed.is_initialized()
        if self.device.type == "cuda" and self.lean and not loaded.enforce_eager and not sharded:
            self.graphs = GraphedForward(self.store.cache, self.model.dtype, self.device, capture=True)
        self.forward_calls = self.forward_positions = 0
        self.forward_seconds = 0.0

    def allocate_arena(self) -> None:
        """Allocate the KV arena's buffers now, not at the first pass: on a GPU the budget was measured against the
        memory free when the runner was built, and runners built side by side would each count the same memory. A
        one-position pass allocates them in the shapes the model writes (a tensor-parallel rank's heads too); it
        leaves no request, prefix or count behind."""
        self.forward_batch([ForwardRow(ARENA_ROW, probe_ids(1, self._embedded_tokens()), 1)])
        self.store.release(ARENA_ROW)
        self.store.forget_retained()
        self.forward_calls = self.forward_positions = 0
        self.forward_seconds = 0.0

    def _embedded_tokens(self) -> int:
        return min(self.vocab_size, self.model.get_input_embeddings().num_embeddings)

    def _profile_forward(self) -> None:
        """The largest forward a worker runs (a batch's token budget of prompt), for the activations' peak memory."""
        n = min(PROFILE_TOKENS, self.loaded.max_positions or PROFILE_TOKENS)
        self.forward_batch([ForwardRow("memory-profile", probe_ids(n, self._embedded_tokens()), 1)])

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

    def forward_batch(self, rows: Sequence[ForwardRow], capture: bool = False) -> list[RowOutput]:
        """`logits_for_batch`, with each row's features too when `capture` (after `capture_features`)."""
        return self.forward_mixed(rows, (), capture)[0]

    def forward_tree(self, rows: Sequence[TreeRow], capture: bool = False) -> list[RowOutput]:
        """One forward pass over each row's uncached committed tokens and its drafted tree. A row's logits are
        [N + 1, vocab_size]: after its last committed token, then after each node; its features (with `capture`) are
        those of its uncached committed tokens, then of each node. Node i attends to the committed tokens and its
        own ancestors only, at rotary position L + its depth (L: committed tokens), as if its path were decoded
        alone. The tree is not kept as the request's: `keep_path` keeps the accepted nodes."""
        return self.forward_mixed((), rows, capture)[1]

    @torch.inference_mode()
    def forward_mixed(self, chains: Sequence[ForwardRow], trees: Sequence[TreeRow],
                      capture: bool = False) -> tuple[list[RowOutput], list[RowOutput]]:  # fmt: skip
        """Chain rows (`forward_batch`'s) and tree rows (`forward_tree`'s) in one packed pass: a prompt's chunk, plain
        steps, drafted chains and drafted trees of many requests pay for one reading of the weights."""
        ids = [row.request_id for row in (*chains, *trees)]
        self._check_batch(ids, capture)
        for row in (*chains, *trees):
            row.check()
        entries = [self.store.sync(r.request_id, r.sequence, len(r.sequence) - r.n, r.prefix_at_most) for r in chains]
        entries += [self.store.sync(r.request_id, r.sequence, len(r.sequence) - 1, r.prefix_at_most) for r in trees]
        starts = [e.length for e in entries]
        tails = [list(row.sequence[start:]) for row, start in zip((*chains, *trees), starts, strict=True)]
        news = tails[: len(chains)] + [t + list(r.tokens) for t, r in zip(tails[len(chains) :], trees, strict=True)]
        self.store.reserve_batch(ids, [len(new) for new in news])  # a tree's positions too, while it is verified
        expected = [r.expected_len for r in chains] + [None] * len(trees)
        self.store.fit_runs(ids, [start + len(new) for start, new in zip(starts, news, strict=True)], expected)
        positions = [list(range(start, start + len(tail))) for start, tail in zip(starts, tails, strict=True)]
        allowed: list[torch.Tensor | None] = [None] * len(chains)
        for i, row in enumerate(trees, start=len(chains)):  # a node sits at its depth below the last committed token
            positions[i] += [starts[i] + len(tails[i]) + d for d in row.depths()]
            allowed.append(tree_allowed(starts[i], len(tails[i]), row.lineages()))
        keeps = [row.n for row in chains] + [len(row.tokens) + 1 for row in trees]
        outputs = self._run(entries, starts, news, positions, allowed, keeps, capture)
        for i, row in enumerate((*chains, *trees)):
            self.store.commit(row.request_id, tails[i])
            self.store.written(row.request_id, tails[i], overwrote=i >= len(chains))
            if i >= len(chains):
                self._trees[row.request_id] = (starts[i] + len(tails[i]), list(row.tokens))
        return outputs[: len(chains)], outputs[len(chains) :]

    @torch.inference_mode()  # the cache's buffers are inference tensors
    def keep_path(self, request_id: str, nodes: Sequence[int]) -> None:
        """After the request's tree was verified: its cache also holds the accepted nodes (a root-down path, in that
        order), their keys/values moved next to the committed ones. The rest of the tree is forgotten."""
        start, tokens = self._trees.pop(request_id)
        entry = self.store.get(request_id)
        if entry.length != start:
            raise ValueError(f"{request_id!r}: its cache changed since its tree's forward pass")
        if nodes:
            self.store.cache.move(entry.run.base, [start + i for i in nodes], start)
            self.store.commit(request_id, [tokens[i] for i in nodes])

    def _check_batch(self, ids: list[str], capture: bool) -> None:
        if len(set(ids)) != len(ids):
            raise ValueError("a request may appear only once in a batch")
        if capture and self._capture_forward is None:
            raise ValueError("capture=True needs capture_features(layers) first")

    def _run(self, entries, starts: list[int], news: list[list[int]], positions: list[list[int]],
             allowed: list[torch.Tensor | None], keeps: list[int], capture: bool) -> list[RowOutput]:  # fmt: skip
        """One packed pass over the rows' new tokens (at `positions`, seeing what `allowed` says, else causal); each
        row's logits at its last keeps[b] tokens (and its features)."""
        t0 = time.perf_counter()
        rows, offset = [], 0
        for entry, start, new, seen in zip(entries, starts, news, allowed, strict=True):
            rows.append(RaggedRow(base=entry.run.base, start=start, offset=offset, n=len(new), allowed=seen))
            offset += len(new)
        ends = [(r.offset + r.n, k) for r, k in zip(rows, keeps, strict=True)]
        columns = [c for end, k in ends for c in range(end - k, end)]  # the kept columns, packed
        # Only the lean forward is graph-safe: a runner whose forward was swapped for transformers' own runs eagerly.
        graphed = self.graphs is not None and self.lean
        bucket = self.graphs.key_for(rows, capture) if graphed else None
        if bucket is not None:
            forward = self._capture_forward if capture else self._forward
            out, features = self.graphs.run(bucket, forward, rows, news, positions, columns)
        else:
            plan = RaggedPlan.build(self.store.cache, rows, self.model.dtype, self.device, self.per_row)
            self.store.cache.plan = plan
            input_ids = torch.tensor([[t for new in news for t in new]], device=self.device)  # [1, N]
            position_ids = torch.tensor([[p for row in positions for p in row]], device=self.device)  # [1, N]
            kept = torch.tensor(columns, device=self.device)  # [K] columns
            cache = self.store.cache
            try:
                if capture:
                    out, features = self._capture_forward(input_ids, position_ids, None, cache, kept, ragged=plan)
                else:
                    out, features = self._forward(input_ids, position_ids, None, cache, kept, ragged=plan), None
            finally:
                cache.plan = None
        self.forward_calls += 1
        self.forward_positions += offset
        # The pass's host time: its plan and its layers' calls. On a GPU that is launching the kernels (they finish
        # at the first read of the logits, counted by whoever reads them): what graph capture would cut.
        self.forward_seconds += time.perf_counter() - t0
        logits = out[0].float()  # [K, V]
        outputs, first = [], 0
        for row, start, keep in zip(rows, starts, keeps, strict=True):
            outputs.append(RowOutput(
                logits=self._fit_vocab(logits[first : first + keep]),  # [keep, V]
                features=features[0, row.offset : row.offset + row.n] if features is not None else None,  # [n, F]
                start=start,
            ))  # fmt: skip
            first += keep
        return outputs

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
