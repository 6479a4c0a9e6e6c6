"""The scheduler's tree half (`Scheduler` inherits it): a tree round's nodes, prompt lookup's tree drafted with the
plan, and for k='auto' the nodes that pay at the verify cost of the worker's batch (planner/tree.py's TreePruning:
a head's trees judged by the worker's recent trees, every request's, and backed off together)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial

from specserve.cluster.scheduling.chunk_pacing import ChunkPacer
from specserve.cluster.scheduling.sched_request import SchedRequest
from specserve.workers.speculation.draft_tree import DraftTree, TreeShape
from specserve.workers.speculation.ngram import NgramDrafter
from specserve.workers.speculation.planner.batch import BatchWidth
from specserve.workers.speculation.planner.costs import ChunkBeside, PlannerCosts, VerifyCosts
from specserve.workers.speculation.planner.round_plan import PLAIN, RoundPlan
from specserve.workers.speculation.planner.tree import RecentTrees, TreePruning, TreeRow, best_chain_length


class TreeRounds:
    """Expects the scheduler's requests, batches, planner_costs, chunks, lookup, max_chain and max_tree_nodes."""

    requests: dict[str, SchedRequest]
    batches: dict[str, BatchWidth]
    planner_costs: PlannerCosts | None
    chunks: ChunkPacer
    lookup: NgramDrafter
    max_chain: int
    max_tree_nodes: int

    def _plan_tree(self, req: SchedRequest) -> RoundPlan:
        """A tree round: its most nodes, prompt lookup's tree drafted here (pruned for 'auto'; none: a plain step);
        with lookups beside a head's trees, their continuation where it is expected to accept more (not while the
        head's rounds are plain beside a prompt's chunk)."""
        nodes = self._tree_nodes(req)
        # Plain beside a prompt's chunk, its plain steps stream from one call; a lookup's round would end the stream,
        # and the step queued ahead and the new call's trip cost the request a whole pass (0.4-0.5 s beside a 4K
        # prompt's chunks on the CPU): the streams' p99 gap, for the few tokens a continuation there commits.
        streaming = req.pruning is not None and req.pruning.plain_beside
        if req.planner is not None and req.state.draft_budget(1) and req.prompt_logprobs is None and not streaming:
            limit = req.state.draft_budget(self.max_chain if req.spec.k == "auto" else req.spec.k)
            cut = self._lookup_cut(req) if req.spec.k == "auto" else None
            lookup = req.planner.lookup_round(req.state.tokens, limit, req.tree_yield if nodes else None, cut)
            if lookup is not None:
                return lookup
        if not nodes or req.method.draft_worker:
            return RoundPlan(nodes=nodes)
        drafted = self.lookup.propose_tree(req.request_id, req.state.tokens, TreeShape.for_budget(nodes))
        tree = self.prune_tree(req, drafted) if drafted is not None else None
        return RoundPlan(nodes=len(tree.tokens), tree=tree) if tree is not None else PLAIN

    def _tree_nodes(self, req: SchedRequest) -> int:
        """Nodes to draft this round: k, or for 'auto' max_tree_nodes (pruned once drafted); none when the round can
        commit one token only, for a head without a draft worker or new features, or in 'auto''s plain rounds."""
        head = req.method.needs_head
        if req.pruning is not None:
            req.pruning.plain_beside = False
        if head and (req.draft_worker is None or not req.head_ready) or not req.state.draft_budget(1):
            return 0
        if req.prompt_logprobs is not None:  # the call that brings the prompt's logprobs is a chain's (a plain step)
            return 0
        if req.spec.k != "auto":
            return req.spec.k
        if req.pruning is None and self.planner_costs is not None:
            # A head's trees are judged by the worker's recent trees, every request's: a short request's own few
            # (a first tree pruned to nothing counts 0) say little, and whether they pay is the batch's question.
            recent = self.batches.setdefault(req.target_worker, BatchWidth()).head_trees
            req.pruning = TreePruning(self.planner_costs.surface.for_rows(1, self.max_tree_nodes + 1), costly=head,
                                      recent=recent if head else RecentTrees())  # fmt: skip
            if head:  # it joins its batch's backoff: its first tree would hold every backed-off row's pass
                req.pruning.plain_rounds = max((r.pruning.plain_rounds for r in self._head_tree_peers(req)), default=0)
        if req.pruning is not None:
            # Beside a prompt's chunk a head's plain rounds, backed off or not paying there, stream until it leaves.
            chunk = self.chunks.beside(req.target_worker) if head else None
            if not req.pruning.wants_tree():
                req.pruning.plain_beside = chunk is not None
                return 0
            if chunk is not None and not self._tree_pays_beside(req, chunk):
                req.pruning.plain_beside = True
                return 0
        return self.max_tree_nodes

    def _tree_pays_beside(self, req: SchedRequest, beside: ChunkBeside) -> bool:
        """False where a prompt's chunk shares the worker's passes and a round with a tree like its recent ones would
        commit less a second there than a plain round (`TreePruning.pays_beside`). Drafted every round beside a 4K
        prompt's chunks only to be pruned to nothing, such trees held each of its passes ~55 ms for the streams'
        drafting, ~15% of the worker (results/2026-12-07-1510-smollm2-long-prompt-plain-beside)."""
        peers = self._batch_peers(req)
        others = [r.batch_row() for r in peers]
        req.pruning.verify = self._batch_verify(others)
        batch = self.batches.setdefault(req.target_worker, BatchWidth())
        return req.pruning.pays_beside(others, batch.tree_overhead.seconds, beside, batch.plain_overhead.seconds,
                                       [r.batch_row(drafting=True) for r in peers])  # fmt: skip

    def prune_tree(self, req: SchedRequest, tree: DraftTree) -> DraftTree | None:
        """The drafted tree as it is verified: for 'auto', its nodes that pay at the verify cost of the worker's
        batch of trees and of a prompt's chunk that shares its pass (None: none does, a plain step)."""
        if req.spec.k != "auto" or not tree.tokens:
            return tree if tree.tokens else None
        if req.pruning is None:
            return tree
        worker = req.target_worker
        peers = self._batch_peers(req)
        others = [r.batch_row() for r in peers]
        req.pruning.verify = self._batch_verify(others)
        batch = self.batches.setdefault(worker, BatchWidth())
        pruned = req.pruning.prune(tree, others, batch.tree_overhead.seconds, self.chunks.beside(worker),
                                   plain_s=batch.plain_overhead.seconds,
                                   others_drafting=[r.batch_row(drafting=True) for r in peers])  # fmt: skip
        if req.pruning.costly and req.pruning.plain_rounds:
            # The batch backs off together: a plain row beside another's tree waits for its drafting all the same
            # (the worker's batcher holds the pass for it), so it saves nothing and commits one token.
            for r in self._head_tree_peers(req):
                r.pruning.plain_rounds = max(r.pruning.plain_rounds, req.pruning.plain_rounds)
        return pruned

    def _lookup_cut(self, req: SchedRequest) -> Callable[[Sequence[float]], int] | None:
        """How much of a lookup's continuation pays at the verify cost of req's worker's batch, its other rows as they
        are and a prompt's chunk beside (None: no costs measured, all of it)."""
        if self.planner_costs is None:
            return None
        worker = req.target_worker
        others = [r.batch_row() for r in self._batch_peers(req)]
        plain_s = self.batches.setdefault(worker, BatchWidth()).plain_overhead.seconds
        return partial(best_chain_length, verify=self._batch_verify(others), others=others, fixed_s=plain_s,
                       beside=self.chunks.beside(worker))  # fmt: skip

    def _batch_peers(self, req: SchedRequest) -> list[SchedRequest]:
        """The other requests of req's target worker: the rows its verify pass shares."""
        return [r for r in self.requests.values() if r.target_worker == req.target_worker and r is not req]

    def _batch_verify(self, others: Sequence[TreeRow]) -> VerifyCosts:
        """The verify cost per width of a batch of a row and `others`, up to a whole k='auto' tree's."""
        return self.planner_costs.surface.for_rows(1 + len(others), self.max_tree_nodes + 1)

    def _head_tree_peers(self, req: SchedRequest) -> list[SchedRequest]:
        """The other requests on req's target worker whose head trees are pruned for 'auto'."""
        return [r for r in self._batch_peers(req) if r.pruning is not None and r.pruning.costly]
