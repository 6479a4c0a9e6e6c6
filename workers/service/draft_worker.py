"""A draft worker: proposes tokens for many requests, keeping each request's draft KV cache between rounds. Its
drafter is a draft model, or an EAGLE-3 head (EagleDrafter), which every call hands the target's features of the
newly committed positions; a head's worker also drafts trees (EAGLE-2's dynamic trees) for calls that ask."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass

from specserve.workers.config.request import SamplingParams
from specserve.workers.errors import InvalidRequestError
from specserve.workers.runtime.kv_cache import KVCacheStore
from specserve.workers.runtime.worker_state import CommittedTokens, check_token_ids, run_calls
from specserve.workers.service.results import ProposeResult
from specserve.workers.speculation.codec import encode_probs
from specserve.workers.speculation.draft_tree import DraftTree, TreeShape
from specserve.workers.speculation.drafter import Drafter, DraftRow, TreeDraftRow
from specserve.workers.speculation.eagle.drafter import EagleDrafter
from specserve.workers.speculation.planner.costs import DraftCost
from specserve.workers.speculation.planner.drafter_costs import drafter_cost
from specserve.workers.speculation.planner.goodput import MAX_AUTO_K
from specserve.workers.speculation.wire_format import FeatureBlock


@dataclass
class ProposeCall:
    """One request's drafting, as the KV state protocol delivers it."""

    request_id: str
    committed_len: int
    new_tokens: list[int]
    k: int
    params: SamplingParams
    features: FeatureBlock | None = None  # EAGLE-3: the target's features of the newly committed positions
    tree: bool = False  # EAGLE-3: draft a tree of up to k nodes instead of a chain


@dataclass
class _Row:
    request_id: str
    tokens: list[int]  # the committed sequence
    k: int  # a chain's tokens or a tree's nodes
    params: SamplingParams
    tree: bool

    def chain(self) -> DraftRow:
        """The drafter's propose_batch row."""
        return DraftRow(self.request_id, self.tokens, self.k, self.params)

    def tree_row(self) -> TreeDraftRow:
        """The head's propose_trees row: a tree of up to k nodes."""
        return TreeDraftRow(self.request_id, self.tokens, TreeShape.for_budget(self.k))


class DraftWorker:
    def __init__(self, drafter: Drafter, vocab_size: int, model_name: str, store: KVCacheStore | None = None):
        self.drafter = drafter
        self.vocab_size = vocab_size
        self.model_name = model_name
        self.store = store  # the drafter's KV store, for capacity reports (None for n-gram and EAGLE-3 drafting)
        self.committed = CommittedTokens()
        # Values per position of the features an EAGLE-3 head takes; None: a draft model, which takes none.
        self.feature_size = drafter.feature_size if isinstance(drafter, EagleDrafter) else None
        self._draft_cost: DraftCost | None = None

    @property
    def pads_rows(self) -> bool:
        """Whether a batch's rows are padded to its widest: an EAGLE-3 head's are; a draft model's pass is packed."""
        return self.feature_size is not None

    def propose(
        self,
        request_id: str,
        committed_len: int,
        new_tokens: Sequence[int],
        k: int,
        params: SamplingParams,
        features: FeatureBlock | None = None,
        tree: bool = False,
    ) -> ProposeResult:
        """Raises RequestNotFoundError (re-send)."""
        call = ProposeCall(request_id, committed_len, list(new_tokens), k, params, features, tree)
        result = self.propose_batch([call])[0]
        if isinstance(result, Exception):
            raise result
        return result

    def propose_batch(self, calls: Sequence[ProposeCall]) -> list[ProposeResult | Exception]:
        """Draft for many requests at once (one draft forward pass per step, chains and trees apart); each call gets
        its own result or its own error. Request ids must be distinct."""
        t0 = time.perf_counter()

        def prepare(call: ProposeCall) -> _Row:
            check_token_ids("new_tokens", call.new_tokens, self.vocab_size)
            self._check_features(call)
            if call.tree and self.feature_size is None:
                raise InvalidRequestError("tree", "this draft worker drafts with a model: trees come from an EAGLE-3 "
                                          "head's worker")  # fmt: skip
            tokens = self.committed.advance(call.request_id, call.committed_len, call.new_tokens)
            if call.features is not None:
                self.drafter.add_features(call.request_id, call.features.start, call.features.to_tensor())
            return _Row(call.request_id, tokens, call.k, call.params, call.tree)

        results, _ = run_calls(self.committed, calls, prepare, self._draft_rows, self.release)
        seconds = time.perf_counter() - t0
        return [r if isinstance(r, Exception) else dataclasses.replace(r, batch_seconds=seconds) for r in results]

    def _draft_rows(self, rows: list[_Row]) -> list[ProposeResult]:
        out: list[ProposeResult | None] = [None] * len(rows)
        chains = [i for i, row in enumerate(rows) if not row.tree]
        trees = [i for i, row in enumerate(rows) if row.tree]
        if chains:
            proposals = self.drafter.propose_batch([rows[i].chain() for i in chains])
            for i, proposal in zip(chains, proposals, strict=True):
                out[i] = ProposeResult(proposal.tokens, encode_probs(proposal.probs))
        if trees:
            drafted = self.drafter.propose_trees([rows[i].tree_row() for i in trees])
            for i, tree in zip(trees, drafted, strict=True):  # None: no features yet, nothing drafted
                out[i] = ProposeResult.of_tree(tree or DraftTree([], [], []))
        return out

    def _check_features(self, call: ProposeCall) -> None:
        """An EAGLE-3 head needs, with every call, the features of the positions committed since its last one: a
        block ending at the committed sequence's second newest position. A draft model takes none."""
        block = call.features
        if self.feature_size is None:
            if block is not None:
                raise InvalidRequestError("features", "this draft worker drafts with a model: it takes no features")
            return
        if block is None:
            raise InvalidRequestError("features", "an EAGLE-3 head's draft worker needs the target's features of the "
                                      "newly committed positions with every call")  # fmt: skip
        if block.cols != self.feature_size or block.end != call.committed_len - 1:
            raise InvalidRequestError(
                "features",
                f"positions {block.start}..{block.end - 1} of {block.cols} values: {call.committed_len} committed "
                f"tokens need them up to position {call.committed_len - 2}, of {self.feature_size} values",
            )

    def release(self, request_id: str) -> bool:
        if isinstance(self.drafter, EagleDrafter):  # the head's cache is kept for later prefixes (a model's: its store)
            self.drafter.release(request_id, self.committed.tokens(request_id))
        else:
            self.drafter.release(request_id)
        return self.committed.release(request_id)

    def draft_cost(self) -> DraftCost | None:
        """The drafter's cost (fixed per call + per drafted token), measured once here: an EAGLE-3 head's, or a draft
        model's (one cached step per drafted token); None for prompt lookup (free)."""
        if self._draft_cost is None:
            self._draft_cost = drafter_cost(self.drafter, MAX_AUTO_K)
        return self._draft_cost

    def _prefix_cache(self) -> dict:
        """A draft model's store's prefix cache counters, or an EAGLE-3 head's (positions a new request's target did
        not send features for, and of those found in a released request's head cache)."""
        if self.store is not None:
            return {"kv_cached_tokens": self.store.cached_tokens, "prefix_cache_queries": self.store.prefix_queries,
                    "prefix_cache_hits": self.store.prefix_hits}  # fmt: skip
        if isinstance(self.drafter, EagleDrafter):
            return {"prefix_cache_queries": self.drafter.prefix_queries, "prefix_cache_hits": self.drafter.prefix_hits}
        return {}

    def health(self, costs: bool = False) -> dict:
        """Liveness and capacity; with `costs`, also the drafting cost (measured on first use: call it on the
        model thread)."""
        report = {
            "healthy": True,
            "requests": len(self.committed),
            "kv_used_tokens": self.store.used_tokens if self.store is not None else 0,
            "kv_capacity_tokens": self.store.capacity_tokens if self.store is not None else 0,
            "kv_capacity_bytes": self.store.capacity_bytes if self.store is not None else 0,
            "kv_allocated_bytes": self.store.allocated_bytes if self.store is not None else 0,
            "model": self.model_name,
            **self._prefix_cache(),
        }
        cost = self.draft_cost() if costs else None
        if cost is not None:
            report["draft_fixed_seconds"], report["draft_step_seconds"] = cost.fixed_s, cost.step_s
        return report
