"""The in-process speculative engine: draft-then-verify rounds through the same interfaces the distributed workers
use (a Drafter, a TargetVerifier, RequestState), all in one process. Also the reference `--no-spec` path."""

from __future__ import annotations

import logging
import os
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specserve.workers.config.request import SamplingParams, SpecParams
from specserve.workers.config.settings import KVCacheConfig, NgramConfig
from specserve.workers.errors import InvalidRequestError
from specserve.workers.runtime.cost_probe import probe_context, verify_seconds
from specserve.workers.runtime.loading import LoadedModel, check_compatible
from specserve.workers.runtime.runner import ModelRunner
from specserve.workers.runtime.tree_rows import TreeRow
from specserve.workers.speculation.draft_model import ModelDrafter
from specserve.workers.speculation.draft_tree import TreeShape
from specserve.workers.speculation.drafter import Drafter, Proposal
from specserve.workers.speculation.eagle.drafter import EagleDrafter
from specserve.workers.speculation.eagle.head import Eagle3Head
from specserve.workers.speculation.eagle.loading import load_eagle_drafter
from specserve.workers.speculation.logprobs import TokenLogprob
from specserve.workers.speculation.methods import (
    DRAFT_MODEL,
    EAGLE,
    NGRAM,
    SUFFIX,
    method,
)
from specserve.workers.speculation.ngram import NgramDrafter
from specserve.workers.speculation.planner.acceptance import HEAD_PRIOR
from specserve.workers.speculation.planner.chain import ChainPlanner
from specserve.workers.speculation.planner.costs import DraftCost, PlannerCosts, VerifyCosts
from specserve.workers.speculation.planner.drafter_costs import drafter_cost
from specserve.workers.speculation.planner.goodput import MAX_AUTO_K
from specserve.workers.speculation.planner.round_plan import PLAIN
from specserve.workers.speculation.planner.tree import MAX_TREE_NODES
from specserve.workers.speculation.request import FinishReason, RequestState, RequestStats, check_request, encode_prompt
from specserve.workers.speculation.round_drafting import ChainRounds, TreeRounds
from specserve.workers.speculation.sampling import TARGET_SALT, make_generator
from specserve.workers.speculation.suffix import SuffixCache
from specserve.workers.speculation.target import TargetVerifier, TreeCall, Verdict, VerifyRow

log = logging.getLogger(__name__)
IN_PROCESS_GPU_SHARE = 0.4  # of a GPU, at most, for each of the engine's runners (below)


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]  # generated tokens only
    finish_reason: FinishReason
    stats: RequestStats
    logprobs: list[TokenLogprob] | None = None  # one per token id, when params.logprobs asked (logprobs.py)

    def to_dict(self) -> dict:
        out = {
            "text": self.text,
            "token_ids": self.token_ids,
            "finish_reason": self.finish_reason,
            "stats": self.stats.to_dict(),
        }
        if self.logprobs is not None:
            out["logprobs"] = [{"logprob": t.logprob, "top": [list(pair) for pair in t.top]} for t in self.logprobs]
        return out


class SpecEngine:
    """Generates with speculative decoding in one process."""

    def __init__(
        self,
        target: LoadedModel,
        draft: LoadedModel | None = None,
        kv_config: KVCacheConfig | None = None,
        ngram_config: NgramConfig | None = None,
        eagle_head: str | os.PathLike | Eagle3Head | None = None,
        planner_costs: PlannerCosts | None = None,
        tree_costs: VerifyCosts | None = None,
    ):
        """eagle_head: an EAGLE-3 head (directory or loaded) for methods 'eagle' and 'eagle+ngram'; the target's
        forward passes then also capture the features the head reads. planner_costs: what k='auto' weighs for chains
        (the target's verify cost per width, the drafters' costs; default: measured here on first use; a seeded
        sampled request with k='auto' reproduces exactly under the same costs); tree_costs: likewise, the verify cost
        per width up to a whole tree's that the trees' k='auto' weighs."""
        # In process the target, the drafter and whatever else the process runs (the bench's cost probes and HF
        # rows) share a GPU: each runner takes 0.4 of it at most (vLLM's per-instance rule; a CPU ignores it).
        kv_config = kv_config or KVCacheConfig(gpu_memory_utilization=IN_PROCESS_GPU_SHARE)
        self.target = target
        self.verifier = TargetVerifier(ModelRunner(target, kv_config))
        self.drafters: dict[str, Drafter] = {NGRAM: NgramDrafter(ngram_config)}  # by proposer (methods.py)
        self.suffix_cache = SuffixCache()  # method "suffix": this engine's recent outputs
        if draft is not None:
            check_compatible(target, draft)
            runner = ModelRunner(draft, kv_config, vocab_size=self.verifier.vocab_size)
            self.drafters[DRAFT_MODEL] = ModelDrafter(runner)
        self.head_prior = HEAD_PRIOR
        if eagle_head is not None:
            eagle = load_eagle_drafter(target, eagle_head)
            self.verifier.runner.capture_features(eagle.feature_layers)
            self.drafters[EAGLE] = eagle
            self.head_prior = eagle.head.config.acceptance or HEAD_PRIOR
            self.eagle_source = "(in memory)" if isinstance(eagle_head, Eagle3Head) else str(eagle_head)
        self.max_auto_k = MAX_AUTO_K
        self._planner_costs = planner_costs
        self._tree_costs = tree_costs
        self._drafter_costs: dict[str, DraftCost] = {}  # drafter name -> measured cost

    @property
    def tokenizer(self):
        return self.target.tokenizer

    def _drafter(self, spec: SpecParams) -> Drafter | None:
        """The method's proposer (None: target-only, or suffix drafting, which the planner runs itself)."""
        proposer = method(spec.method).proposer
        if proposer in (None, SUFFIX):
            return None
        if proposer not in self.drafters:
            needs = "an EAGLE-3 head (eagle_head)" if proposer == EAGLE else "a draft model"
            raise InvalidRequestError("method", f"{spec.method!r} drafting needs {needs}, and none is loaded")
        return self.drafters[proposer]

    def _rounds(self, spec: SpecParams) -> ChainRounds | TreeRounds | None:
        m, auto = method(spec.method), spec.k == "auto"
        drafter = self._drafter(spec)
        if not m.drafts:
            return None
        lookups = None
        if m.tree and m.chain_sources:  # lookups beside a head's trees: no costs (they cost nothing to draft)
            lookups = ChainPlanner.for_method(m, self.suffix_cache, ngram=self.drafters[NGRAM].config)
        if m.tree and auto:  # the best nodes of a big tree, each round
            return TreeRounds(drafter, TreeShape.for_budget(MAX_TREE_NODES), self.tree_verify_costs(), lookups,
                              self.max_auto_k)  # fmt: skip
        if m.tree:
            return TreeRounds(drafter, TreeShape.for_budget(spec.k), None, lookups, spec.k)
        costs = self.planner_costs(spec.method) if auto else None  # suffix: the engine's recent outputs too
        planner = ChainPlanner.for_method(m, self.suffix_cache, ngram=self.drafters[NGRAM].config,
                                          head_prior=self.head_prior, costs=costs)  # fmt: skip
        model = drafter if m.needs_model else None  # lookups carry their tokens in the plan
        return ChainRounds(model, planner, None if auto else spec.k, self.max_auto_k)

    def forget_prefixes(self) -> None:
        """Give up every retained prefix, the target's and each drafter's: the next request starts cold (a bench's
        rows, so that a row after another on the same prompt does not skip its prefill)."""
        self.verifier.runner.store.forget_retained()
        for drafter in self.drafters.values():
            if isinstance(drafter, EagleDrafter):
                drafter.forget_retained()
            elif isinstance(drafter, ModelDrafter):
                drafter.runner.store.forget_retained()

    def tree_verify_costs(self) -> VerifyCosts:
        """The target's verify cost per width up to a whole k='auto' tree's, measured once."""
        if self._tree_costs is None:
            widest = MAX_TREE_NODES + 1
            context = probe_context(self.target.max_positions, widest)
            self._tree_costs = VerifyCosts(verify_seconds(self.verifier.runner, context, widest))
            log.info(
                "k='auto' costs: verify %s ms by width", " ".join(f"{1e3 * t:.1f}" for t in self._tree_costs.verify_s)
            )
        return self._tree_costs

    def planner_costs(self, method_name: str = EAGLE) -> PlannerCosts:
        """The target's verify cost per width (the trees' measurement, up to a chain's width) and the method's
        drafter's cost, each measured once on first use (k='auto' weighs them; prompt lookup costs nothing)."""
        if self._planner_costs is not None:
            return self._planner_costs
        verify = VerifyCosts(self.tree_verify_costs().verify_s[: self.max_auto_k + 1])
        m = method(method_name)
        if m.needs_model and m.proposer not in self._drafter_costs:
            self._drafter_costs[m.proposer] = drafter_cost(self.drafters[m.proposer], self.max_auto_k)
        cost = self._drafter_costs.get(m.proposer, DraftCost())
        return PlannerCosts(verify, head=cost, draft=cost)  # a method drafts with one of them

    def _verify(
        self,
        state: RequestState,
        drafter: Drafter | None,
        proposal: Proposal | None,
        params: SamplingParams,
        generator: torch.Generator,
    ) -> Verdict:
        """Verify this round's proposal (None: target-only); an EagleDrafter gets the target's new features."""
        drafted, probs = (proposal.tokens, proposal.probs) if proposal else ([], None)
        head = drafter if isinstance(drafter, EagleDrafter) else None
        row = VerifyRow(state.request_id, state.tokens, drafted, probs, params, generator,
                        prefix_at_most=_head_prefix(head, state))  # fmt: skip
        verdict = self.verifier.verify_rows([row], capture=head is not None)[0]
        if head is not None:
            head.add_features(state.request_id, verdict.feature_start, verdict.features)
        return verdict

    def _tree_round(
        self, state: RequestState, rounds: TreeRounds, params: SamplingParams, generator: torch.Generator
    ) -> None:
        """Draft the round's tree (none: a plain step, as before the head's first features), verify it, commit the
        accepted path and the recovered or bonus token; a head gets the committed positions' features. The round's
        time beyond its verify goes to the pruning of the head's next trees."""
        started, steady = time.perf_counter(), state.stats.drafted > 0
        plan = rounds.plan(state)
        tree = rounds.propose_tree(state, plan)
        if tree is None:
            verify_started = time.perf_counter()
            verdict = self._verify(state, rounds.drafter, None, params, generator)
            verify_s = time.perf_counter() - verify_started
            rounds.observe(plan, None, 0)
            state.commit_round([], verdict.accepted, verdict.next_token, logprobs=verdict.logprobs)
            rounds.took(plan, time.perf_counter() - started - verify_s, steady)
            return
        head = rounds.drafter if isinstance(rounds.drafter, EagleDrafter) else None
        row = TreeRow(state.request_id, list(state.tokens), tree.tokens, tree.parents, _head_prefix(head, state))
        call = TreeCall(row, params, generator)
        verify_started = time.perf_counter()
        verdict = self.verifier.verify_trees([call], capture=head is not None)[0]
        verify_s = time.perf_counter() - verify_started
        rounds.observe(plan, tree, len(verdict.path))
        if head is not None:
            head.add_features(state.request_id, verdict.feature_start, verdict.features)
        rounds.took(plan, time.perf_counter() - started - verify_s, steady)
        path = [tree.tokens[i] for i in verdict.path]
        shape = (len(tree.tokens), tree.depth)
        state.commit_round(path, len(path), verdict.next_token, tree=shape, logprobs=verdict.logprobs)

    def generate(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams,
        spec: SpecParams,
        request_id: str | None = None,
    ) -> GenerationResult:
        rounds = self._rounds(spec)
        drafter = rounds.drafter if rounds is not None else None
        prompt_ids = encode_prompt(self.tokenizer, prompt)
        check_request(prompt_ids, params, self.verifier.vocab_size, self.target.max_positions)
        params = params.for_request(len(prompt_ids), frozenset(self.target.eos_token_ids))
        state = RequestState(
            request_id=request_id or uuid.uuid4().hex,
            tokens=list(prompt_ids),
            prompt_len=len(prompt_ids),
            max_new_tokens=params.max_new_tokens,
            eos_token_ids=frozenset(self.target.eos_token_ids) if params.stop_at_eos else frozenset(),
        )
        try:
            while not state.finished:
                position = len(state.tokens)
                if isinstance(rounds, TreeRounds):
                    self._tree_round(state, rounds, params, make_generator(params.seed, TARGET_SALT, position))
                    continue
                plan = rounds.plan(state) if rounds is not None else PLAIN
                proposal = rounds.propose(state, plan, params) if rounds is not None else None
                drafted = proposal.tokens if proposal else []
                generator = make_generator(params.seed, TARGET_SALT, position)
                verdict = self._verify(state, drafter, proposal, params, generator)
                if rounds is not None:
                    rounds.observe(plan, len(drafted), verdict.accepted)
                state.commit_round(drafted, verdict.accepted, verdict.next_token, logprobs=verdict.logprobs)
        finally:
            self.verifier.release(state.request_id)
            if isinstance(drafter, EagleDrafter):  # its cache kept for later requests that start the same way
                drafter.release(state.request_id, state.tokens)
            elif drafter is not None:
                drafter.release(state.request_id)
        if method(spec.method).suffix:
            self.suffix_cache.remember_request(state.request_id, state.tokens, state.prompt_len)
        return GenerationResult(
            text=self.tokenizer.decode(state.generated, skip_special_tokens=True),
            token_ids=state.generated,
            finish_reason=state.finish_reason,
            stats=state.stats,
            logprobs=state.logprobs if params.logprobs is not None else None,
        )


def _head_prefix(head: EagleDrafter | None, state: RequestState) -> int | None:
    """A head's request's first verify takes from the target's prefix cache only what the head holds too (the target
    computes no features for cached positions); None: no cap (no head, or a later round)."""
    if head is None or state.generated:
        return None
    return head.held_prefix(state.tokens)
