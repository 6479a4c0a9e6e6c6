"""The scheduler as a CPU-only state machine: which worker holds each request, what each worker has been told, each
round's plan (`plan_round` -> RoundPlan, docs/planner.md) and how a verified round is applied (`apply_round`). No
I/O: `pipeline.py` carries its calls over gRPC (one a model in `model_serving.py`). Per request: the committed
tokens, the sticky workers holding its KV caches, the tokens each has been sent (the KV state protocol's tails).
For k='auto' a target worker's requests draft the chain width that commits the most tokens per second of its
batches (0: plain steps), at its measured costs and its rounds' realized times; trees are pruned to what pays.
"""

from __future__ import annotations

import dataclasses
import logging
import uuid
from collections.abc import Sequence
from typing import NamedTuple

from specserve.cluster.scheduling.calls import Call
from specserve.cluster.scheduling.chunk_pacing import ChunkPacer
from specserve.cluster.scheduling.features import FeatureRelay, FeatureTraffic
from specserve.cluster.scheduling.placement import WorkerPlacement
from specserve.cluster.scheduling.prefixes import PrefixRecords
from specserve.cluster.scheduling.sched_request import SchedRequest
from specserve.cluster.scheduling.tree_rounds import TreeRounds
from specserve.workers.config.request import SamplingParams, SpecParams
from specserve.workers.config.settings import NgramConfig
from specserve.workers.errors import InvalidRequestError
from specserve.workers.runtime.worker_state import common_prefix_length
from specserve.workers.service.results import VerifyResult
from specserve.workers.speculation.draft_tree import DraftTree
from specserve.workers.speculation.methods import METHODS
from specserve.workers.speculation.ngram import NgramDrafter
from specserve.workers.speculation.planner.acceptance import model_head_acceptance, model_lookup_acceptance
from specserve.workers.speculation.planner.batch import BatchWidth
from specserve.workers.speculation.planner.chain import ChainPlanner
from specserve.workers.speculation.planner.costs import PlannerCosts
from specserve.workers.speculation.planner.goodput import MAX_AUTO_K, RowChoice, choose_row
from specserve.workers.speculation.planner.round_plan import PLAIN, RoundPlan
from specserve.workers.speculation.planner.tree import MAX_TREE_NODES
from specserve.workers.speculation.request import RequestState
from specserve.workers.speculation.suffix import SuffixCache

log = logging.getLogger(__name__)

FALLBACK_K = 3  # k='auto' when the workers could not report their costs: a chain length that pays on most hardware


class _NextChunk(NamedTuple):
    """A long prompt's next prefill chunk, before it is planned."""

    held: int  # positions its target worker holds
    size: int  # the chunk's tokens
    others: bool  # whether other requests decode on that worker
    cap: int | None  # the head's prefix cap (prefixes.head_prefix)


class NoTargetWorker(RuntimeError):
    """No healthy target worker is left to run a request on."""


class Scheduler(WorkerPlacement, TreeRounds):
    """One model's scheduling state machine: places requests on draft and target workers, plans each round's calls
    and applies their results. Plain data in, plain data out: `Pipeline` makes the calls. A Serve `SchedulerReplica`
    hosts one per model; it is not a scheduler itself."""

    def __init__(self, draft_workers: list[str], target_workers: list[str],
                 head_prior: tuple[float, ...] | None = None, max_k: int | None = None,
                 ngram: NgramConfig | None = None, prefill_chunk: int | None = None,
                 decode_steps: int = 1):  # fmt: skip
        """Workers may also join later (`add_worker`). head_prior: the EAGLE-3 head's measured acceptance by position,
        where planning starts; max_k: the most k='auto' drafts a round (None: the planner's caps); ngram: lookup's;
        prefill_chunk: a longer prompt prefills in calls of this many tokens (None: one call); decode_steps: the most
        plain steps a target worker runs in one call (`plain_steps`)."""
        self.decode_steps = decode_steps
        self.chunks = ChunkPacer(prefill_chunk)  # a long prompt's chunk sizes, by what they cost beside others
        self.head_acceptance = model_head_acceptance(head_prior)  # every request's, where new ones start
        self.lookup_acceptance = model_lookup_acceptance()  # likewise, by matched suffix length
        self.max_chain = min(MAX_AUTO_K, max_k or MAX_AUTO_K)
        self.max_tree_nodes = min(MAX_TREE_NODES, max_k or MAX_TREE_NODES)
        self.ngram = ngram or NgramConfig()
        self.suffix_cache = SuffixCache()  # the model's recent outputs, for method "suffix"
        self.lookup = NgramDrafter(self.ngram)  # prompt lookup's trees, drafted with the plan
        self.draft_workers = list(draft_workers)
        self.target_workers = list(target_workers)
        self.requests: dict[str, SchedRequest] = {}
        self.unhealthy: set[str] = set()
        self.feature_traffic = FeatureTraffic()  # EAGLE-3 features through this scheduler, over every request
        # What k='auto' weighs, measured by the workers (the pipeline asks them once, and refines the verify cost
        # from every reply); None: not known yet (or a worker could not report them: FALLBACK_K).
        self.planner_costs: PlannerCosts | None = None
        self.batches: dict[str, BatchWidth] = {}  # target worker -> its requests' planned chain width
        self.prefixes = PrefixRecords()  # which worker holds which prompt prefix

    # -- placement (placement.py: which workers, which holds each request) ------------------------------------------

    def add(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        spec: SpecParams,
        eos_token_ids: frozenset[int],
        request_id: str | None = None,
    ) -> SchedRequest:
        if spec.method not in METHODS:
            raise InvalidRequestError("method", f"{spec.method!r} is not served (only {', '.join(METHODS)})")
        method = METHODS[spec.method]
        target = self._least_loaded(self.target_workers, "target_worker", prompt_ids)
        if target is None:
            raise NoTargetWorker("no healthy target worker")
        draft = self._least_loaded(self.draft_workers, "draft_worker", prompt_ids) if method.draft_worker else None
        state = RequestState(request_id=request_id or uuid.uuid4().hex, tokens=list(prompt_ids),
                             prompt_len=len(prompt_ids), max_new_tokens=params.max_new_tokens,
                             eos_token_ids=eos_token_ids if params.stop_at_eos else frozenset())  # fmt: skip
        features = FeatureRelay(self.feature_traffic) if method.needs_head else None
        planner, plain = None, PLAIN
        if method.chain_sources:
            planner = ChainPlanner.for_method(method, self.suffix_cache, head_shared=self.head_acceptance,
                                              lookup_shared=self.lookup_acceptance, ngram=self.ngram)  # fmt: skip
        elif not method.drafts:
            plain = RoundPlan(row=RowChoice(()))  # a plain row of its target worker's batches
        params = params.for_request(len(prompt_ids), eos_token_ids)  # what penalties and min_tokens count from
        req = SchedRequest(state, params, spec, draft, target, features=features, planner=planner, round=plain)
        self.requests[state.request_id] = req
        return req

    # -- planning ---------------------------------------------------------------------------------------------------

    def plan_round(self, req: SchedRequest) -> RoundPlan:
        """The request's next round: a plain step, a chain (a fixed k's, or for 'auto' the goodput planner's at its
        target worker's batch) or a tree's nodes (prompt lookup's tree drafted here); `apply_round` takes it back."""
        req.chunk_epoch = self.chunks.epoch(req.target_worker)  # whether a prefill chunk ran beside this round
        if req.method.draft_worker and req.draft_worker is None:  # re-attach once a draft worker is back
            req.draft_worker = self._least_loaded(self.draft_workers, "draft_worker")
        if req.method.tree:
            req.round = self._plan_tree(req)
        elif req.method.drafts:
            req.round = self._plan_chain(req)
        return req.round  # "none": the plain row it was given

    def plain_steps(self, req: SchedRequest, plan: RoundPlan) -> int:
        """Plain rounds the request runs from here whatever they commit, at most `decode_steps` and to its length
        limit, for one call that runs them back to back (TargetClient.decode): a decoding request that never drafts
        (speculation off), a head's trees backed off for plain rounds (TreePruning: the rounds they still have), or
        a head's plain rounds beside a prompt's chunk (`plain_beside`: until it leaves); 1 for every other round."""
        if plan.k or plan.drafted or not req.state.generated or req.prompt_logprobs is not None:
            return 1
        ahead = req.state.remaining
        if req.method.drafts:
            if not req.method.tree or req.pruning is None:
                return 1
            # beside a prompt's chunk: plain until it leaves (each step's round is planned anew, and ends the call)
            ahead = self.decode_steps if req.pruning.plain_beside else 1 + req.pruning.plain_rounds
        return max(1, min(self.decode_steps, ahead, req.state.remaining))

    def _plan_chain(self, req: SchedRequest) -> RoundPlan:
        """This round's chain: a fixed k's, or for 'auto' the goodput planner's for the request's target worker."""
        # A model drafts only on a draft worker, and a head only from features that came since it last drafted.
        model = req.draft_worker is not None and (req.features is None or req.head_ready)
        fixed = None if req.spec.k == "auto" else req.spec.k
        if fixed is None and self.planner_costs is None:
            fixed = FALLBACK_K
        limit = req.state.draft_budget(fixed or self.max_chain)
        row = RowChoice(req.planner.options(req.state.tokens, limit, model), fixed, limit)
        if not row.options:
            return RoundPlan(row=row)
        if fixed is not None:
            return RoundPlan(choose_row(row, limit, 0.0, {}), row=row)
        costs = self.planner_costs
        rows, width = self._batch_width(req, row)
        share = costs.surface.at(rows, width + 1) / rows
        return RoundPlan(choose_row(row, width, share, costs.drafters), row=row,
                         forecast=self.batches[req.target_worker].forecast)  # fmt: skip

    def _batch_width(self, req: SchedRequest, row: RowChoice) -> tuple[int, int]:
        """(requests, planned chain width) of the batches of the request's target worker, `row` its own."""
        worker = req.target_worker
        peers = [row if r is req else r.round.row for r in self.requests.values() if r.target_worker == worker]
        peers = [p for p in peers if p is not None]
        width = self.batches.setdefault(worker, BatchWidth()).for_round(peers, self.planner_costs, self.max_chain,
                                                                        self.chunks.beside(worker))  # fmt: skip
        return len(peers), width

    def _features_paused(self, req: SchedRequest) -> bool:
        """A k='auto' chain on a worker whose batches have planned no drafting for a while (BatchWidth)."""
        batch = self.batches.get(req.target_worker)
        if req.spec.k != "auto" or req.method.tree or batch is None or not batch.quiet_below:
            return False
        return batch.features_paused(sum(r.target_worker == req.target_worker for r in self.requests.values()))

    def _call(self, req: SchedRequest, worker: str, sequence: list[int], **kw) -> Call:
        told = req.told.get(worker, [])
        start = common_prefix_length(told, sequence)
        sequence = list(sequence)
        req.told[worker] = sequence
        return Call(worker, req.request_id, len(sequence), sequence[start:], sequence=sequence, **kw)

    def resend(self, req: SchedRequest, call: Call) -> Call:
        """The worker lost the request: the same call with the whole sequence."""
        req.resent += 1
        req.told[call.worker] = call.sequence
        return dataclasses.replace(call, new_tokens=list(call.sequence))

    def plan_prefill_chunk(self, req: SchedRequest) -> Call | None:
        """The next chunk of a long prompt's prefill on its target worker, before its first round; None once the rest
        fits a round's call (and for a request that asks for its prompt's logprobs, which one call computes). A new
        request's first chunk starts past the prefix its worker likely caches (affinity.py: a later turn's history
        is one call's take-over, not a call a chunk)."""
        if (chunk := self._next_chunk(req)) is None:
            return None
        self.chunks.started(req.target_worker, chunk.others, req.request_id)
        want = req.features is not None and req.draft_worker is not None  # the head reads the prompt's features too
        return self._call(req, req.target_worker, req.state.tokens[: chunk.held + chunk.size], drafted=[],
                          draft_probs=b"", want_features=want, prefix_at_most=chunk.cap,
                          expected_len=req.state.prompt_len)  # fmt: skip

    def has_prefill_chunk(self, req: SchedRequest) -> bool:
        """Whether `plan_prefill_chunk` would plan one now (nothing planned or counted)."""
        return self._next_chunk(req) is not None

    def _next_chunk(self, req: SchedRequest) -> _NextChunk | None:
        if not self.chunks.max_tokens or req.state.generated or req.prompt_logprobs is not None:
            return None
        held = common_prefix_length(req.told.get(req.target_worker, []), req.state.tokens)
        cap = self._head_prefix(req)
        if not held:
            held = self.prefixes.target_held(req)
            held = held if cap is None else min(held, cap)
        # Others decoding there wait for each chunk; so do those about to (a short prompt's first round), else a
        # moment when every chat stream is between its requests gave a whole chunk: a 2 s pass deep in a 4K prompt.
        others = any(r.target_worker == req.target_worker and r is not req and self._decodes_soon(r)
                     for r in self.requests.values())  # fmt: skip
        size = self.chunks.size(req.target_worker, others, req.request_id)
        if req.state.prompt_len - held <= (size if req.told.get(req.target_worker) else self.chunks.max_tokens):
            return None  # the rest goes with the first round's call
        return _NextChunk(held, size, others, cap)

    def _decodes_soon(self, req: SchedRequest) -> bool:
        """Decoding, or its prompt goes with its first round (no chunks of its own to wait for)."""
        return bool(req.state.generated) or req.state.prompt_len <= (self.chunks.max_tokens or req.state.prompt_len)

    def _head_prefix(self, req: SchedRequest) -> int | None:
        return self.prefixes.head_prefix(req, self.requests.values())  # a head's request: what its head holds

    def prefilled(self, req: SchedRequest, call: Call, reply: VerifyResult) -> None:
        """A prefill chunk's reply: its features wait for its feed (its token is not committed)."""
        chunk = len(call.new_tokens)
        rows, base_s = reply.batch_rows - 1, None
        if rows > 0 and self.planner_costs is not None:  # the other rows alone, as the worker's profile measured them
            base_s = self.planner_costs.profiled(rows, max(1, round((reply.batch_tokens - chunk) / rows)))
        self.chunks.chunk_ran(call.worker, chunk, reply.batch_seconds, req.request_id, reply.batch_tokens,
                              depth=call.committed_len - chunk, base_s=base_s)  # fmt: skip
        if req.features is not None and reply.features:
            req.features.received(reply.features)

    def plan_feed(self, req: SchedRequest, chunk: Call) -> Call | None:
        """A prefilled chunk for the request's draft worker (its features for a head, its tokens for a draft model),
        drafting nothing: its drafter's catch-up over the prompt goes in the chunks' steps (prefill.py)."""
        if req.draft_worker is None or req.draft_worker in self.unhealthy:
            return None
        if req.features is not None and req.features.pending is None:
            return None
        features = req.features.to_send() if req.features is not None else b""
        sequence = req.state.tokens[: chunk.committed_len + 1]  # the head's entry of a position reads the next token
        return self._call(req, req.draft_worker, sequence, k=0, features=features)

    def fed(self, req: SchedRequest, call: Call) -> None:
        """A chunk's feed succeeded: its features are the head's (the prompt is not all there: no prefix record)."""
        if req.features is not None:
            req.features.delivered(call.features)

    def verified(self, reply: VerifyResult) -> None:
        """A round's verify reply: its batch's cost, for k='auto'."""
        if self.planner_costs is not None:
            self.planner_costs.observe_batch(reply.batch_rows, reply.batch_tokens, reply.batch_seconds)

    def plan_draft(self, req: SchedRequest, k: int) -> Call:
        features = req.features.to_send() if req.features is not None else b""
        return self._call(req, req.draft_worker, req.state.tokens, k=k, features=features, tree=req.method.tree)

    def plan_predraft(self, req: SchedRequest, drafted: list[int], k: int) -> Call | None:
        """Round r + 1's draft, assuming all of round r's drafted tokens are accepted (None when pointless, and for a
        head, which needs round r's features)."""
        if req.draft_worker is None or not drafted or req.state.remaining <= len(drafted) + 2:
            return None
        if req.features is not None:
            return None
        return self._call(req, req.draft_worker, req.state.tokens + drafted, k=k)

    def plan_verify(self, req: SchedRequest, drafted: list[int], draft_probs: bytes,
                    parents: list[int] | None = None) -> Call:  # fmt: skip
        """Verify the drafted chain, or with `parents` the drafted tree."""
        want = req.features is not None and req.draft_worker is not None and not self._features_paused(req)
        if req.features is not None and not want:
            req.features.drop()  # the head starts again later, from the features of a later round
        return self._call(req, req.target_worker, req.state.tokens, drafted=drafted, draft_probs=draft_probs,
                          want_features=want, parents=parents, prompt_logprobs=req.prompt_logprobs,
                          prefix_at_most=self._head_prefix(req))  # fmt: skip

    # -- applying results -------------------------------------------------------------------------------------------

    def apply_round(self, req: SchedRequest, plan: RoundPlan, reply: VerifyResult, drafted: Sequence[int] = (),
                    tree: DraftTree | None = None, round_s: float = 0.0) -> list[int]:  # fmt: skip
        """Commit a verified round: the chain's accepted drafted tokens (`drafted`) or the tree's path (`tree`, as
        verified; None: a plain step), then the reply's next token. Its features (EAGLE-3) wait for the next draft
        call; round_s: its wall time from plan to reply, against the plan's forecast (not a prompt's prefill), and for
        a head's tree the round's time beyond the target's forward."""
        if req.features is not None and reply.features:
            req.features.received(reply.features)
        self.chunks.ended(req.request_id)  # a prompt that prefilled in chunks: its first round is in
        self.prefixes.holds_prompt(req, req.target_worker, "target")
        # Not the prompt's round, nor the request's first drafting one: its drafter's catch-up over the prompt (a
        # head's extension over up to 910 positions of features, a draft model's prefill) is not a steady round.
        steady = req.state.generated and (req.state.stats.drafted or not (tree.tokens if tree else drafted))
        if steady and round_s > 0:  # chains and trees alike: the decoding round a prompt's chunks are paced by
            self.chunks.round_ran(req.target_worker, round_s, req.chunk_epoch)
        if req.method.tree:
            if plan.nodes and not plan.drafted and req.pruning is not None and round_s > 0 and req.state.stats.drafted:
                # a head's tree round (not its first: the head's catch-up) beyond the forward, for the next prunings
                beyond = round_s - reply.queued_seconds - reply.batch_seconds
                self.batches.setdefault(req.target_worker, BatchWidth()).tree_overhead.observe(beyond)
            elif not plan.nodes and not plan.chain.k and req.pruning is not None and round_s > 0 and steady:
                # a plain round of a head's trees: what drafting a tree is weighed against
                beyond = round_s - reply.queued_seconds - reply.batch_seconds
                self.batches.setdefault(req.target_worker, BatchWidth()).plain_overhead.observe(beyond)
            return req.commit_tree(plan, tree, list(reply.path or ()), reply)
        if plan.forecast is not None and round_s > 0 and steady and req.target_worker in self.batches:
            self.batches[req.target_worker].realized.observe(plan.forecast, round_s)
        if req.planner is not None:
            req.observe_round(plan, drafted, reply.accepted)
        return req.state.commit_round(list(drafted), reply.accepted, reply.next_token, logprobs=reply.logprobs)

    def wants_costs(self, req: SchedRequest) -> bool:
        """Whether the request's planning weighs the workers' costs, and they are not known yet."""
        return self.planner_costs is None and req.spec.k == "auto" and req.method.drafts

    def drafted(self, req: SchedRequest, call: Call) -> None:
        """A draft call succeeded: the features it carried are the head's now, and its worker holds the prompt."""
        if req.features is not None:
            req.features.delivered(call.features)
        self.prefixes.holds_prompt(req, call.worker, "draft")

    def release(self, req: SchedRequest) -> list[str]:
        """The request ended (finished, failed or cancelled): forget it. Returns the workers that hold its state, for
        the caller to release it there."""
        self.requests.pop(req.request_id, None)
        self.chunks.ended(req.request_id)
        self.prefixes.released(req, self.draft_workers)
        if req.method.suffix and req.state.finished:
            self.suffix_cache.remember_request(req.request_id, req.state.tokens, req.state.prompt_len)
        return list(req.told)
