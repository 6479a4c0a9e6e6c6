"""Drafting with an EAGLE-3 head: a per-request cache of the head's own keys/values, batched steps, rollback.

A request's cache holds one entry per committed position t: the keys/values the head computed from the target's
feature of position t and the token at t+1 (so a sequence of n+1 tokens whose target features 0..n-1 are known has n
entries). `extend` appends the newly committed entries of many requests at once (different lengths, one batched
forward) and returns the head's logits for the token after the newest one. `chain` then drafts further steps: each
feeds the head's own last output (before its final norm) in place of fc(feature), one position on, attending over
the committed entries and the chain's own; the chain's entries are never committed (after verification the target's
features of the accepted tokens replace them, as in vLLM and SGLang). `rollback` cuts a request back to a length.

A cache may start later than position 0 (`restart`): a draft worker that lost a request's older features (it
restarted, or they were too many to ship) starts again from the features it has. Rotary positions stay absolute and
the head attends over the entries it holds: drafts may be worse for a while, outputs never change.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specserve.workers.errors import InvalidRequestError
from specserve.workers.speculation.eagle.head import Eagle3Head


@dataclass
class DraftStep:
    logits: torch.Tensor  # [B, draft_vocab_size]: the head's logits for the next token, over the draft vocabulary
    hidden: torch.Tensor  # [B, H]: the head's output before its final norm, what the next chained step takes


class RequestKV:
    """One request's committed entries: keys/values [nkv, capacity, hd], grown by doubling. Entry i is that of
    position offset + i (offset 0 unless the cache was restarted later)."""

    def __init__(self, kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device):
        self.keys = torch.empty(kv_heads, 64, head_dim, dtype=dtype, device=device)
        self.values = torch.empty_like(self.keys)
        self.offset = 0  # the position of entry 0
        self.count = 0  # entries held
        self.last_hidden: torch.Tensor | None = None  # [H]: output of the newest entry (None after a rollback)

    @property
    def end(self) -> int:
        """The position the next entry is for."""
        return self.offset + self.count

    def prefix_copy(self, n: int) -> RequestKV:
        """A cache of its own holding this one's first n entries (of a cache that starts at position 0): another
        request that shares the prefix they were built from."""
        copy = RequestKV(self.keys.shape[0], self.keys.shape[2], self.keys.dtype, self.keys.device)
        copy.append(self.keys[:, :n], self.values[:, :n])
        return copy

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """keys, values [nkv, m, hd]."""
        end = self.count + keys.shape[1]
        if end > self.keys.shape[1]:
            capacity = max(end, 2 * self.keys.shape[1])
            grown = self.keys.new_empty(self.keys.shape[0], capacity, self.keys.shape[2])
            grown_values = torch.empty_like(grown)
            grown[:, : self.count] = self.keys[:, : self.count]
            grown_values[:, : self.count] = self.values[:, : self.count]
            self.keys, self.values = grown, grown_values
        self.keys[:, self.count : end] = keys
        self.values[:, self.count : end] = values
        self.count = end


def padded_kv(states: Sequence[RequestKV]) -> tuple[torch.Tensor, torch.Tensor]:
    """The requests' committed keys and values, right-padded with zeros: [B, nkv, most entries, hd] each."""
    longest = max(s.count for s in states)
    first = states[0].keys
    keys = first.new_zeros(len(states), first.shape[0], longest, first.shape[2])
    values = torch.zeros_like(keys)
    for b, s in enumerate(states):
        keys[b, :, : s.count] = s.keys[:, : s.count]
        values[b, :, : s.count] = s.values[:, : s.count]
    return keys, values


def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """q [B, nh, Q, hd], keys/values [B, nkv, S, hd], mask [B, 1, Q, S] (True: attend) -> [B, nh, Q, hd]."""
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True)


class Eagle3Drafting:
    """Per-request head caches and the batched drafting steps. `embed_weight` [V, H] is the target's embedding."""

    def __init__(self, head: Eagle3Head, embed_weight: torch.Tensor):
        self.head = head
        self.embed_weight = embed_weight
        self._requests: dict[str, RequestKV] = {}
        # eagle/graphs.py, on CUDA: a tree's levels (LevelGraphs), the extension (ExtendGraphs) and a chain's steps
        # on static buffers replayed as CUDA graphs
        self.level_graphs = None
        self.extend_graphs = None
        self.chain_graphs = None  # ChainGraphs: a chain's steps

    def length(self, request_id: str) -> int:
        """The position of the request's next entry (its entries are those of positions before it)."""
        state = self._requests.get(request_id)
        return state.end if state is not None else 0

    def rollback(self, request_id: str, length: int) -> None:
        """Keep the request's entries of positions before `length` (after a rejection); the next entry is that of
        position `length` (also when the cache started later: it then holds none)."""
        state = self._requests.get(request_id)
        current = state.end if state is not None else 0
        if not 0 <= length <= current:
            raise InvalidRequestError("length", f"cannot roll {request_id!r} back to {length}: it has {current}")
        if state is not None and length < current:
            state.offset, state.count = min(state.offset, length), max(0, length - state.offset)
            state.last_hidden = None

    def restart(self, request_id: str, position: int) -> None:
        """Drop the request's entries; the next one is that of `position` (the older features are gone)."""
        state = self._state(request_id)
        state.offset, state.count, state.last_hidden = position, 0, None

    def release(self, request_id: str) -> RequestKV | None:
        """Forget the request; returns its cache (for prefix reuse), None when it held none."""
        return self._requests.pop(request_id, None)

    def held(self, request_id: str) -> RequestKV | None:
        """The request's cache, None when it holds none."""
        return self._requests.get(request_id)

    def install(self, request_id: str, state: RequestKV) -> None:
        """Give the request a cache released by another (the caller rolls it back to the prefix they share)."""
        self._requests[request_id] = state

    def _state(self, request_id: str) -> RequestKV:
        if request_id not in self._requests:
            cfg, weight = self.head.config, self.head.fc.weight
            self._requests[request_id] = RequestKV(cfg.num_key_value_heads, cfg.head_dim, weight.dtype, weight.device)
        return self._requests[request_id]

    @torch.no_grad()
    def extend(self, rows: Sequence[tuple[str, torch.Tensor, Sequence[int]]]) -> DraftStep:
        """rows: (request_id, features [m, 3Ht] of the request's next m committed positions, the m tokens that follow
        each of them). Appends the entries and returns, per row, the head's logits for the token after the newest
        committed one. A row with m = 0 reuses its newest entry's output (an error after a rollback)."""
        for request_id, features, tokens in rows:
            if features.ndim != 2 or features.shape[0] != len(tokens):
                raise InvalidRequestError(
                    "features", f"{request_id!r}: {list(features.shape)} features for {len(tokens)} tokens"
                )
        states = [self._state(request_id) for request_id, _, _ in rows]
        active = [b for b, (_, features, _) in enumerate(rows) if features.shape[0] > 0]
        for b, (request_id, _, _) in enumerate(rows):
            if b not in active and states[b].last_hidden is None:
                raise InvalidRequestError("features", f"{request_id!r} has no newest entry to draft from: extend it")
        if active:
            newest = self._forward_new([rows[b] for b in active], [states[b] for b in active])
            for i, b in enumerate(active):
                states[b].last_hidden = newest[i]
        hidden = torch.stack([state.last_hidden for state in states])  # [B, H]
        return DraftStep(self.head.logits(hidden), hidden)

    def _forward_new(self, rows, states: list[RequestKV]) -> torch.Tensor:
        """The new entries of each row in one forward; appends their keys/values; returns the newest outputs [B, H]."""
        head, device = self.head, self.head.fc.weight.device
        counts = [features.shape[0] for _, features, _ in rows]
        entries = [s.count for s in states]  # held before these
        key = self.extend_graphs.bucket(counts, max(entries)) if self.extend_graphs is not None else None
        static = None
        if key is not None:
            keys, values = padded_kv(states)  # the entries held before these
            static = self.extend_graphs.run(key, [f for _, f, _ in rows], [t for _, _, t in rows],
                                            [s.end for s in states], keys, values, entries)  # fmt: skip
        if static is not None:
            k, v, newest = static
            for b, state in enumerate(states):
                state.append(k[b, :, : counts[b]], v[b, :, : counts[b]])
            return newest[: len(rows)].clone()  # the buffers are the next replay's
        starts = torch.tensor([s.end for s in states], device=device)
        offsets = torch.tensor([s.offset for s in states], device=device)
        width = max(counts)
        features = torch.zeros(len(rows), width, rows[0][1].shape[1], device=device)
        tokens = torch.zeros(len(rows), width, dtype=torch.long, device=device)
        for b, (_, row_features, row_tokens) in enumerate(rows):
            features[b, : counts[b]] = row_features.to(device=device, dtype=features.dtype)
            tokens[b, : counts[b]] = torch.as_tensor(list(row_tokens), dtype=torch.long, device=device)
        positions = starts[:, None] + torch.arange(width, device=device)  # [B, M]
        q, k, v, residual = head.qkv(F.embedding(tokens, self.embed_weight), head.project(features), positions)
        for b, state in enumerate(states):
            state.append(k[b, :, : counts[b]], v[b, :, : counts[b]])
        keys, values = padded_kv(states)
        # entry at position p attends to the request's entries of positions offset..p (padding rows beyond a row's
        # count are dropped)
        held = offsets[:, None, None] + torch.arange(keys.shape[2], device=device)[None, None, :]  # [B, 1, S]
        mask = held <= positions[:, :, None]  # [B, M, S]
        out = head.finish(attend(q, keys, values, mask[:, None]), residual)  # [B, M, H]
        return out[torch.arange(len(rows), device=device), torch.tensor(counts, device=device) - 1]

    def states(self, request_ids: Sequence[str]) -> list[RequestKV]:
        """The requests' caches (read by the chain and tree drafting beyond them)."""
        return [self._requests[r] for r in request_ids]

    def chain(self, request_ids: Sequence[str], first: DraftStep):
        """Chained steps after `extend` returned `first` for these requests (same order): a DraftChain, or on CUDA
        its static twin (eagle/graphs.py: StaticChain) where a bucket fits."""
        states = [self._requests[r] for r in request_ids]
        if self.chain_graphs is not None:
            keys, values = padded_kv(states)
            positions = torch.tensor([s.end for s in states], device=first.hidden.device)
            static = self.chain_graphs.chain(keys, values, [s.count for s in states], first.hidden, positions)
            if static is not None:
                return static
        return DraftChain(self, states, first.hidden)


class DraftChain:
    """Drafting steps beyond the committed entries; the requests' caches are read, never changed."""

    def __init__(self, drafting: Eagle3Drafting, states: list[RequestKV], hidden: torch.Tensor):
        self.head, self.embed_weight = drafting.head, drafting.embed_weight
        device = hidden.device
        counts = torch.tensor([s.count for s in states], device=device)
        keys, values = padded_kv(states)
        self.keys, self.values = [keys], [values]
        self.mask = (torch.arange(keys.shape[2], device=device)[None, :] < counts[:, None])[:, None, None]  # [B,1,1,S]
        self.positions = torch.tensor([s.end for s in states], device=device)  # of the next chained entry, per row
        self.hidden = hidden  # [B, H]

    @torch.no_grad()
    def step(self, tokens: torch.Tensor) -> DraftStep:
        """tokens [B]: the token each row drafted last (target ids). Returns the logits for the one after it."""
        head = self.head
        embeds = F.embedding(tokens.to(self.positions.device)[:, None], self.embed_weight)  # [B, 1, H]
        q, k, v, residual = head.qkv(embeds, self.hidden[:, None], self.positions[:, None])
        self.keys.append(k)
        self.values.append(v)
        chained = torch.ones(*self.mask.shape[:3], len(self.keys) - 1, dtype=torch.bool, device=self.mask.device)
        mask = torch.cat([self.mask, chained], dim=-1)
        attn = attend(q, torch.cat(self.keys, dim=2), torch.cat(self.values, dim=2), mask)
        self.hidden = head.finish(attn, residual)[:, 0]
        self.positions = self.positions + 1
        return DraftStep(head.logits(self.hidden), self.hidden)
