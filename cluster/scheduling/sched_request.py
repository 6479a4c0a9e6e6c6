"""The scheduler's record of one request (`SchedRequest`): its committed state, its workers, what each was told, its
drafting plan for the round under way. Plain data: scheduler.py plans and applies, pipeline.py carries the calls."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field

from specserve.cluster.scheduling.calls import PreDraft
from specserve.cluster.scheduling.features import FeatureRelay
from specserve.workers.config.request import SamplingParams, SpecParams
from specserve.workers.service.results import ProposeResult, VerifyResult
from specserve.workers.speculation.draft_tree import DraftTree
from specserve.workers.speculation.methods import METHODS, Method
from specserve.workers.speculation.planner.chain import ChainPlanner
from specserve.workers.speculation.planner.goodput import NO_DRAFT
from specserve.workers.speculation.planner.round_plan import PLAIN, RoundPlan
from specserve.workers.speculation.planner.tree import TreePruning, TreeRow, TreeYield
from specserve.workers.speculation.request import RequestState
from specserve.workers.speculation.wire_format import slice_rows


@dataclass
class SchedRequest:
    state: RequestState
    params: SamplingParams
    spec: SpecParams
    draft_worker: str | None
    target_worker: str
    features: FeatureRelay | None = None  # a head's methods: the target's features on their way to the draft worker
    planner: ChainPlanner | None = None  # chain methods: what its drafters offer each round, and their acceptance
    round: RoundPlan = PLAIN  # the latest plan (its row: the request's in its target worker's batch planning)
    tree_yield: TreeYield = field(default_factory=TreeYield)  # a head's trees' accepted nodes, beside lookups
    pruning: TreePruning | None = None  # "eagle-tree" with k='auto', once the target's verify costs are known
    told: dict[str, list[int]] = field(default_factory=dict)  # worker -> tokens it has been sent, in order
    recorded: set[str] = field(default_factory=set)  # workers whose holding its prompt the prefix records know
    chunk_epoch: int = 0  # its target worker's prefill chunks when this round was planned (chunk_pacing.py)
    pipelined_rounds: int = 0  # rounds whose draft was ready when the previous verification ended
    resent: int = 0  # calls that re-sent a whole prefix after a worker lost the request

    @property
    def request_id(self) -> str:
        return self.state.request_id

    @property
    def method(self) -> Method:
        return METHODS[self.spec.method]  # what it drafts with and can do (workers/speculation/methods.py)

    @property
    def prompt_logprobs(self) -> int | None:
        """The prompt's logprobs still to ask the target for (top-n), until a verify reply brought them; else None."""
        return self.params.prompt_logprobs if self.state.prompt_logprobs is None else None

    @property
    def head_ready(self) -> bool:
        """A head's features came since it last drafted, up to the newest committed position (a prompt's prefill
        chunks bring its first positions' only: the round that verifies the rest of the prompt is a plain step)."""
        pending = self.features.pending if self.features is not None else None
        return pending is not None and pending.end >= len(self.state.tokens) - 1

    def batch_row(self, drafting: bool = False) -> TreeRow:
        """The request as a row of its target worker's verify batch, for another's tree pruning: its head's last tree
        (pruned to the batch's cap) where its round drafts one, else the width its round verifies. `drafting`: as
        it would be in a round where the head's trees are drafted, a request whose head trees are backed off then
        verifying as its recent trees were."""
        if self.round.nodes and not self.round.drafted and self.pruning is not None and self.pruning.by_size:
            return TreeRow(by_size=self.pruning.by_size)
        recent = self.pruning.recent if self.pruning is not None and self.pruning.costly else None
        if drafting and recent is not None and recent.accepted is not None and not self.round.k:
            return TreeRow(width=recent.width, expected=recent.accepted)
        return TreeRow(width=self.round.k, expected=self.round.expected)

    def observe_round(self, plan: RoundPlan, drafted: Sequence[int], accepted: int) -> None:
        """The round's outcome into the request's planner, by the chain drafted (a pre-draft may be shorter)."""
        drafted_by = plan.chain.source if drafted else NO_DRAFT.source
        if plan.row is not None:
            self.planner.passed_over(plan.row.options, drafted_by)
        if drafted_by != NO_DRAFT.source:
            self.planner.observe(dataclasses.replace(plan.chain, k=len(drafted)), accepted)

    def commit_tree(self, plan: RoundPlan, tree: DraftTree | None, path: list[int], reply: VerifyResult) -> list[int]:
        """Commit a verified tree round (tree None: a plain step): the accepted path's tokens and the next token; the
        outcome to what planned it (a lookup's chain verified as a tree, or the head's tree and its pruning)."""
        if tree is None:
            if plan.nodes and not plan.chain.k:  # a head's tree pruned to nothing: its drafting spent for no node
                self.tree_yield.observe(0)
            return self.state.commit_round([], 0, reply.next_token, logprobs=reply.logprobs)
        if plan.chain.k:
            self.observe_round(plan, tree.tokens, len(path))
        else:
            self.tree_yield.observe(len(path))
            if self.pruning is not None:
                self.pruning.observe(len(path))
        accepted, shape = [tree.tokens[node] for node in path], (len(tree.tokens), tree.depth)
        return self.state.commit_round(accepted, len(accepted), reply.next_token, tree=shape, logprobs=reply.logprobs)

    def predrafted(self, pre: PreDraft | None, k: int) -> ProposeResult | None:
        """This round's k-token draft from a pre-draft, if its assumption held: the committed sequence now continues
        exactly as the pre-draft assumed and its first token equals the bonus token. Its first token is dropped
        (already committed as the bonus token); the rest are a valid proposal for this round."""
        if pre is None or self.state.finished:
            return None
        tokens = self.state.tokens
        ahead = pre.draft.drafted
        if len(tokens) != len(pre.after) + 1 or tokens[:-1] != pre.after or len(ahead) < 2 or ahead[0] != tokens[-1]:
            return None
        drafted = ahead[1 : 1 + k]
        probs = slice_rows(pre.draft.draft_probs, 1, 1 + len(drafted))
        return ProposeResult(drafted, probs) if drafted else None
