"""Dynamic draft trees from an EAGLE-3 head (EAGLE-2's expansion), batched across requests.

From the head's distribution after the committed tokens, the `topk` most likely tokens are the root's candidate
children. Each further level feeds the `topk` best frontier nodes (by path score: the head's log-probability of the
whole path) through the head at once, each attending to the request's committed entries and to its own ancestors
only, and scores their `topk` children each; the best `topk` of those become the next frontier. Finally the `budget`
best candidates of all levels form the tree: a path's score never rises along it, so the best candidates include
their parents (ties go to the shallower). The tree's nodes come out in depth order, each with its parent's index
(-1: the root), ready for tree verification; candidates are chosen deterministically (the head's top ones), so
sampled requests verify them by recursive rejection sampling with one-hot draft distributions, losslessly.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specserve.workers.runtime.tree_rows import ROOT
from specserve.workers.speculation.draft_tree import DraftTree, TreeShape
from specserve.workers.speculation.eagle.drafting import DraftStep, Eagle3Drafting, padded_kv
from specserve.workers.speculation.eagle.graphs import EagerLevels


@dataclass
class _Candidates:
    """One row's candidates of all levels, in the order they were scored."""

    tokens: list[int]
    parents: list[int]  # candidate index, or ROOT
    scores: list[float]
    depths: list[int]

    def add(self, token: int, parent: int, score: float, depth: int) -> int:
        self.tokens.append(token)
        self.parents.append(parent)
        self.scores.append(score)
        self.depths.append(depth)
        return len(self.tokens) - 1

    def best_tree(self, budget: int) -> DraftTree:
        """The `budget` best candidates (ancestor-closed), in depth order, with parents re-indexed."""
        order = sorted(range(len(self.tokens)), key=lambda c: (-self.scores[c], self.depths[c], c))[:budget]
        kept = sorted(order, key=lambda c: (self.depths[c], c))
        index = {c: i for i, c in enumerate(kept)}
        parents = [ROOT if self.parents[c] == ROOT else index[self.parents[c]] for c in kept]
        return DraftTree([self.tokens[c] for c in kept], parents, [self.scores[c] for c in kept])


@torch.no_grad()
def draft_trees(
    drafting: Eagle3Drafting, request_ids: Sequence[str], first: DraftStep, shape: TreeShape
) -> list[DraftTree]:
    """Trees for these requests after `extend` returned `first` for them (same order); their caches are read only."""
    head, embed = drafting.head, drafting.embed_weight
    states = drafting.states(request_ids)
    device = first.hidden.device
    batch, k = len(request_ids), min(shape.topk, head.config.draft_vocab_size)
    committed_keys, committed_values = padded_kv(states)  # [B, nkv, S, hd]
    counts = torch.tensor([s.count for s in states], device=device)
    committed = (torch.arange(committed_keys.shape[2], device=device)[None, :] < counts[:, None])[:, None, :]  # [B,1,S]
    starts = torch.tensor([s.end for s in states], device=device)  # [B]: the root's children's position

    top = first.logits.float().log_softmax(-1).topk(k, dim=-1)  # [B, K] each
    scores, draft_ids = top.values, top.indices  # [B, K]: the frontier: the root's children
    # Every level's candidates stay on the device until the last level: read back per candidate, they cost a host
    # synchronisation each (16 a row a level at topk 4), which on a GPU is most of a level's time.
    found = [(head.draft_to_target(draft_ids), scores, None)]  # per level: tokens, scores, the next frontier's picks
    hidden = first.hidden[:, None].expand(batch, k, -1)  # [B, K, H]: what each frontier node is fed with
    lineage = torch.zeros(batch, k, 0, dtype=torch.long, device=device)  # [B, K, d]: ancestors' frontier slots
    graphs = drafting.level_graphs
    static = graphs.levels(committed_keys, committed_values, committed, k, shape.depth) if graphs else None
    levels = static or EagerLevels(head, embed, committed_keys, committed_values, committed)
    slots = torch.arange(k, device=device)
    for depth in range(1, shape.depth):
        if shape.min_path_prob and float(scores.max()) < math.log(shape.min_path_prob):
            break  # no frontier node is likely enough to pay for another level of the head
        tokens = head.draft_to_target(draft_ids)  # [B, K] target ids
        positions = (starts + depth - 1)[:, None].expand(batch, k)  # [B, K]
        # each frontier node sees the committed entries, its ancestors at each earlier level, and itself
        ancestors = [lineage[:, :, level, None] == slots for level in range(depth - 1)]  # [B, K, K] each
        out, child_logp, child_ids = levels.run(depth, tokens, hidden, positions, ancestors)  # [B, K, H], [B, K, K]
        child_scores = (scores[:, :, None] + child_logp).reshape(batch, k * k)  # [B, K*K]
        child_ids = child_ids.reshape(batch, k * k)
        next_frontier = child_scores.topk(k, dim=-1).indices  # [B, K] into K*K
        found.append((head.draft_to_target(child_ids), child_scores, next_frontier))
        parent_slot = next_frontier // k  # [B, K]
        lineage = torch.cat([lineage.gather(1, parent_slot[:, :, None].expand(-1, -1, depth - 1)),
                             parent_slot[:, :, None]], dim=-1)  # fmt: skip
        scores = child_scores.gather(1, next_frontier)
        draft_ids = child_ids.gather(1, next_frontier)
        hidden = out.gather(1, parent_slot[:, :, None].expand(-1, -1, out.shape[-1]))  # each child is fed its parent's
    return _collect(found, batch, k, shape.budget)


def _collect(levels: list, batch: int, k: int, budget: int) -> list[DraftTree]:
    """Each row's tree from every level's candidates (tokens [B, n], path scores [B, n], and from the second level
    the picks of the next frontier [B, K] among the K*K), read back together."""
    host = [(tokens.tolist(), scores.tolist(), picks.tolist() if picks is not None else None)
            for tokens, scores, picks in levels]  # fmt: skip
    trees = []
    for b in range(batch):
        row = _Candidates([], [], [], [])
        tokens, scores, _ = host[0]
        frontier = [row.add(t, ROOT, s, 0) for t, s in zip(tokens[b], scores[b], strict=True)]
        for depth, (tokens, scores, picks) in enumerate(host[1:], start=1):
            added = [row.add(tokens[b][c], frontier[c // k], scores[b][c], depth) for c in range(k * k)]
            frontier = [added[c] for c in picks[b]]
        trees.append(row.best_tree(budget))
    return trees
