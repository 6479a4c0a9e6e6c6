"""Verification of a drafted token tree against the target: pure tensor functions, no I/O (the chain versions are in
verification.py, whose vocabulary this keeps: accepted, recovered, bonus).

A round may draft a tree instead of a chain: several candidates where the drafter is unsure. Node i holds a drafted
token and its parent: -1 for a child of the root (the last committed token), else the index of an earlier node
(parents[i] < i, so index order is a topological order). The target scores every node in one forward: its
distribution after the root and after each node. Verification walks down from the root and accepts at most one child
per level, so the accepted nodes form one root-to-node path; the round commits their tokens plus one more (recovered
where a node's children were all rejected, bonus where the deepest accepted node has none).

Sampling is lossless for candidates chosen deterministically (the top children of a head's distribution, prompt
lookup's continuations): at each accepted node, its children are tried in index order, each accepted with the
residual target probability of its token; a rejected child's token is removed from the residual (zeroed, the rest
renormalized). This is recursive rejection sampling (SpecInfer; SGLang's tree sampling for EAGLE's top-k trees) with
one-hot draft distributions: the committed tokens are distributed exactly as target-only sampling.

Shapes: B = rows (requests), N = nodes per tree (rows with fewer are padded: `valid` False), V = vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specserve.workers.runtime.tree_rows import ROOT
from specserve.workers.speculation.sampling import sample_with_noise


@dataclass(frozen=True)
class TreeVerifyOutput:
    path: torch.Tensor  # [B, N] int64: the accepted nodes root-down (accepted of them), then -1
    accepted: torch.Tensor  # [B] int64 in 0..N
    next_token: torch.Tensor  # [B] int64: recovered or bonus, after the deepest accepted node

    def accepted_nodes(self, row: int) -> list[int]:
        return self.path[row, : int(self.accepted[row])].tolist()


def _walk(parents: torch.Tensor, tokens: torch.Tensor, valid: torch.Tensor, accept_child) -> TreeVerifyOutput:
    """The shared walk: nodes in index order; a node is tried where its parent is the row's current node (and no
    sibling was accepted before it). accept_child(i, rows [R] int64) -> [R] bool decides the tried rows (and updates
    whatever distribution it keeps). Returns the path; next_token is filled by the caller (zeros here)."""
    batch, n = tokens.shape
    device = tokens.device
    current = torch.full((batch,), ROOT, dtype=torch.long, device=device)  # [B] deepest accepted node so far
    path = torch.full((batch, n), ROOT, dtype=torch.long, device=device)  # [B, N]
    depth = torch.zeros(batch, dtype=torch.long, device=device)  # [B]
    for i in range(n):
        rows = (valid[:, i] & (parents[:, i] == current)).nonzero().squeeze(1)  # [R]
        if rows.numel() == 0:
            continue
        accepted = rows[accept_child(i, rows)]  # [A]
        path[accepted, depth[accepted]] = i
        depth[accepted] += 1
        current[accepted] = i
    return TreeVerifyOutput(path=path, accepted=depth, next_token=torch.zeros_like(depth))


def greedy_tree_verify(
    parents: torch.Tensor, tokens: torch.Tensor, valid: torch.Tensor, target_argmax: torch.Tensor
) -> TreeVerifyOutput:
    """Greedy: accept a child whose token is the target's argmax after its parent (the first such sibling).

    parents, tokens [B, N] int64; valid [B, N] bool
    target_argmax [B, N + 1] int64: column 0 the target's choice after the root, column i + 1 after node i
    next_token: the argmax after the deepest accepted node (recovered if it has children, else bonus)."""

    def accept_child(i: int, rows: torch.Tensor) -> torch.Tensor:
        return tokens[rows, i] == target_argmax[rows, parents[rows, i] + 1]  # [R]

    out = _walk(parents, tokens, valid, accept_child)
    deepest = _deepest(out)  # [B]
    next_token = target_argmax.gather(1, (deepest + 1).unsqueeze(1)).squeeze(1)  # [B]
    return TreeVerifyOutput(out.path, out.accepted, next_token)


def rejection_tree_verify(
    parents: torch.Tensor,
    tokens: torch.Tensor,
    valid: torch.Tensor,
    target_probs: torch.Tensor,
    uniform: torch.Tensor,
    exp_noise: torch.Tensor,
) -> TreeVerifyOutput:
    """Recursive rejection sampling over deterministically chosen candidates.

    parents, tokens [B, N] int64; valid [B, N] bool
    target_probs [B, N + 1, V]: p after the root (column 0) and after each node (column i + 1)
    uniform [B, N]: U[0, 1) noise, one per node's acceptance test
    exp_noise [B, V]: Exp(1) noise for the one recovered or bonus token"""
    residual = target_probs[:, 0].clone()  # [B, V]: what the current node's next token is drawn from, so far

    def accept_child(i: int, rows: torch.Tensor) -> torch.Tensor:
        token = tokens[rows, i]  # [R]
        p_x = residual[rows, token]  # [R]
        accept = uniform[rows, i] < p_x  # [R]; q is one-hot at x: accept with probability p_res(x)
        taken, refused = rows[accept], rows[~accept]
        residual[taken] = target_probs[taken, i + 1]  # now drawing after node i
        if refused.numel():
            residual[refused, token[~accept]] = 0.0
            mass = residual[refused].sum(-1, keepdim=True)  # [R', 1]
            # mass is 0 only if p put all its mass on refused tokens, which then could not have been refused
            residual[refused] = residual[refused] / mass.clamp_min(1e-30)
        return accept

    out = _walk(parents, tokens, valid, accept_child)
    next_token = sample_with_noise(residual, exp_noise)  # [B]
    return TreeVerifyOutput(out.path, out.accepted, next_token)


def _deepest(out: TreeVerifyOutput) -> torch.Tensor:
    """[B] the deepest accepted node, ROOT where none (a tree of no nodes: every one pruned by a grammar)."""
    if out.path.shape[1] == 0:
        return torch.full_like(out.accepted, ROOT)
    last = (out.accepted - 1).clamp_min(0).unsqueeze(1)  # [B, 1]
    node = out.path.gather(1, last).squeeze(1)  # [B]
    return torch.where(out.accepted > 0, node, torch.full_like(node, ROOT))


def chain_tree(k: int, batch: int = 1, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """A chain of k drafted tokens as a tree: parents [B, k] (-1, 0, 1, ...) and valid [B, k]."""
    parents = (torch.arange(k, device=device) - 1).expand(batch, k).contiguous()
    return parents, torch.ones(batch, k, dtype=torch.bool, device=device)
