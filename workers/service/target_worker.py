"""A target worker: verifies drafted tokens for many requests, keeping each request's target KV cache. A target whose
model is served with an EAGLE-3 head also returns, to the calls that ask, the features of the positions each call
committed (captured in the same forward pass: a batch where no call asks keeps no hidden states). A call may bring a
drafted tree instead of a chain: a batch verifies its chains in one forward and its trees in another (tree attention
mask), keeping only each tree's accepted path in the cache."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specserve.workers.config.request import SamplingParams
from specserve.workers.errors import InvalidRequestError
from specserve.workers.runtime.cost_probe import batch_verify_seconds, probe_context, verify_seconds
from specserve.workers.runtime.tree_rows import TreeRow, check_parents
from specserve.workers.runtime.worker_state import CommittedTokens, check_token_ids, run_calls
from specserve.workers.service.results import VerifyResult
from specserve.workers.speculation.codec import encode_features
from specserve.workers.speculation.planner.costs import PROFILE_ROWS, VerifyCosts
from specserve.workers.speculation.planner.goodput import MAX_AUTO_K
from specserve.workers.speculation.planner.tree import MAX_TREE_NODES
from specserve.workers.speculation.sampling import TARGET_SALT, make_generator
from specserve.workers.speculation.target import TargetVerifier, TreeCall, VerifyRow


@dataclass
class VerifyCall:
    """One request's verification, as the KV state protocol delivers it."""

    request_id: str
    committed_len: int
    new_tokens: list[int]
    drafted: list[int]
    draft_probs: torch.Tensor | None  # [len(drafted), V] as decoded from the wire, None = one-hot
    params: SamplingParams
    want_features: bool = False  # EAGLE-3: return the features of the positions this call commits
    parents: list[int] | None = None  # the drafted tokens form a tree (ROOT or an earlier node each); None: a chain
    prompt_logprobs: int | None = None  # the committed tokens' logprobs too (the prompt's), with this many alternatives
    prefix_at_most: int | None = None  # a request new here: the most positions taken from a cached prefix (kv_cache)
    expected_len: int | None = None  # the length its sequence soon reaches (a chunked prompt's): its KV run's size


@dataclass
class _Row:
    verify: VerifyRow  # the chain to verify
    want_features: bool
    tree: TreeCall | None = None  # a tree to verify instead of `verify`'s chain


class TargetWorker:
    def __init__(self, verifier: TargetVerifier, model_name: str):
        self.verifier = verifier
        self.model_name = model_name
        self.committed = CommittedTokens()
        self._verify_costs: VerifyCosts | None = None
        self._verify_profile: dict[int, tuple[float, ...]] | None = None

    @property
    def vocab_size(self) -> int:
        return self.verifier.vocab_size

    pads_rows = False  # a packed pass (runtime/ragged.py): a prompt's chunk beside decoding rows costs its columns

    def verify(
        self,
        request_id: str,
        committed_len: int,
        new_tokens: Sequence[int],
        drafted: Sequence[int],
        draft_probs: torch.Tensor | None,
        params: SamplingParams,
    ) -> VerifyResult:
        """One chain call alone. Raises RequestNotFoundError (re-send the committed sequence)."""
        call = VerifyCall(request_id, committed_len, list(new_tokens), list(drafted), draft_probs, params)
        result = self.verify_batch([call])[0]
        if isinstance(result, Exception):
            raise result
        return result

    def verify_batch(self, calls: Sequence[VerifyCall]) -> list[VerifyResult | Exception]:
        """Verify many requests in one target forward pass. Each call gets its own result or its own error (bad
        input, lost request, no KV room), never another row's. Request ids must be distinct."""
        t0 = time.perf_counter()
        fed, forward_s = self.verifier.runner.forward_positions, self.verifier.runner.forward_seconds

        def prepare(call: VerifyCall) -> _Row:
            check_token_ids("new_tokens", call.new_tokens, self.vocab_size)
            check_token_ids("drafted", call.drafted, self.vocab_size)
            if call.want_features and self.verifier.runner.capture_layers is None:
                raise InvalidRequestError("want_features", "this target worker captures no features: its model is "
                                          "served without an EAGLE-3 head")  # fmt: skip
            _check_tree(call)  # before the call's tokens are taken as committed
            _check_fits(call.committed_len + len(call.drafted), self.verifier.runner.store.capacity_tokens)
            tokens = self.committed.advance(call.request_id, call.committed_len, call.new_tokens)
            generator = make_generator(call.params.seed, TARGET_SALT, len(tokens))
            verify = VerifyRow(call.request_id, tokens, call.drafted, call.draft_probs, call.params, generator,
                               call.prompt_logprobs, call.prefix_at_most, call.expected_len)  # fmt: skip
            tree = None
            if call.parents is not None:
                row = TreeRow(call.request_id, tokens, call.drafted, call.parents, call.prefix_at_most)
                tree = TreeCall(row, call.params, generator)
            return _Row(verify, call.want_features, tree)

        results, rows = run_calls(self.committed, calls, prepare, self._verify_rows, self.release)
        seconds, tokens = time.perf_counter() - t0, self.verifier.runner.forward_positions - fed
        forward_s = self.verifier.runner.forward_seconds - forward_s
        batch = {
            "batch_seconds": seconds,
            "batch_rows": rows,
            "batch_tokens": tokens,
            "batch_forward_seconds": forward_s,
        }
        return [r if isinstance(r, Exception) else dataclasses.replace(r, **batch) for r in results]

    def _verify_rows(self, rows: list[_Row]) -> list[VerifyResult]:
        """The chains and the trees in one forward pass (the batch's fields are set by verify_batch)."""
        chains = [i for i, row in enumerate(rows) if row.tree is None]
        trees = [i for i, row in enumerate(rows) if row.tree is not None]
        capture = any(row.want_features for row in rows)
        chained, treed = self.verifier.verify_mixed([rows[i].verify for i in chains], [rows[i].tree for i in trees],
                                                    capture=capture)  # fmt: skip
        out: list[VerifyResult | None] = [None] * len(rows)
        for i, v in zip(chains, chained, strict=True):
            features = encode_features(v.feature_start, v.features) if rows[i].want_features else b""
            out[i] = VerifyResult(v.accepted, v.next_token, features=features, logprobs=v.logprobs,
                                  prompt_logprobs=v.prompt_logprobs)  # fmt: skip
        for i, v in zip(trees, treed, strict=True):
            features = encode_features(v.feature_start, v.features) if rows[i].want_features else b""
            out[i] = VerifyResult(v.accepted, v.next_token, features=features, path=v.path, logprobs=v.logprobs)
        return out

    def release(self, request_id: str) -> bool:
        self.verifier.release(request_id)
        return self.committed.release(request_id)

    def verify_costs(self) -> VerifyCosts:
        """Seconds of one forward over w = 1..MAX_TREE_NODES + 1 new positions (the widest a k='auto' chain or tree
        verifies), measured once here (k='auto' weighs them: on a CPU verifying 2-3 positions can cost more than 5)."""
        if self._verify_costs is None:
            runner, widest = self.verifier.runner, max(MAX_AUTO_K, MAX_TREE_NODES) + 1
            context = probe_context(runner.loaded.max_positions, widest)
            self._verify_costs = VerifyCosts(verify_seconds(runner, context, widest))
        return self._verify_costs

    def verify_profile(self) -> dict[int, tuple[float, ...]]:
        """Batch size -> seconds of one batched forward over that many requests, w = 1..MAX_AUTO_K + 1 new positions
        each, for the profile's batch sizes past one (the goodput planner interpolates between them), measured once."""
        if self._verify_profile is None:
            runner, widest = self.verifier.runner, MAX_AUTO_K + 1
            context = probe_context(runner.loaded.max_positions, widest)
            self._verify_profile = {
                rows: batch_verify_seconds(runner, context, rows, widest) for rows in PROFILE_ROWS if rows > 1
            }
        return self._verify_profile

    def health(self, costs: bool = False) -> dict:
        """Liveness and capacity; with `costs`, also the verify cost per width (measured on first use: call it on the
        model thread)."""
        store = self.verifier.runner.store
        failed = getattr(self.verifier.runner, "failed", None)  # a tensor-parallel replica that lost a rank
        report = {
            "healthy": failed is None,
            "requests": len(self.committed),
            "kv_used_tokens": store.used_tokens,
            "kv_capacity_tokens": store.capacity_tokens,
            "kv_capacity_bytes": store.capacity_bytes,
            "kv_allocated_bytes": store.allocated_bytes,
            "kv_cached_tokens": store.cached_tokens,
            "prefix_cache_queries": store.prefix_queries,
            "prefix_cache_hits": store.prefix_hits,
            "model": self.model_name,
        }
        if costs and failed is None:
            report["verify_seconds_by_width"] = list(self.verify_costs().verify_s)
            profile = self.verify_profile()
            report["verify_profile_rows"] = list(profile)
            report["verify_seconds_by_rows"] = [t for row in profile.values() for t in row]
        return report


def _check_fits(positions: int, capacity: int) -> None:
    """A request that cannot fit the KV cache even alone is the client's to shorten (INVALID_ARGUMENT, 400), not a
    full cache to wait for."""
    if positions > capacity:
        raise InvalidRequestError("prompt", f"the request needs {positions} KV cache positions, more than a target "
                                  f"worker holds ({capacity}, kv_cache.capacity_tokens)")  # fmt: skip


def _check_tree(call: VerifyCall) -> None:
    """A tree call's parents and draft probs (none: its candidates are deterministic); InvalidRequestError names the
    field."""
    if call.parents is None:
        return
    if call.prompt_logprobs is not None:
        raise InvalidRequestError("prompt_logprobs", "a tree call cannot keep the prompt's logits: ask on a chain call")
    if call.draft_probs is not None:
        raise InvalidRequestError("draft_probs", "a tree's candidates are deterministic: it takes no draft probs")
    try:
        check_parents(call.drafted, call.parents)
    except ValueError as e:
        raise InvalidRequestError("parents", str(e)) from None
