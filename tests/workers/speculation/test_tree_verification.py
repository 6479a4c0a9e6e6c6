"""Tree verification alone: greedy against a brute-force walk on random ragged trees, chains equal to the chain
verifiers, malformed trees refused, and sampling whose committed tokens follow the target's distribution."""

import numpy as np
import pytest
import torch

from specserve.workers.runtime.tree_rows import check_parents
from specserve.workers.speculation.tree_verification import ROOT, chain_tree, greedy_tree_verify, rejection_tree_verify
from specserve.workers.speculation.verification import greedy_verify, rejection_verify
from tests.helpers.sampling_oracle import chi2_pvalue


def random_trees(batch: int, nodes: int, vocab: int, seed: int) -> tuple[torch.Tensor, ...]:
    """parents, tokens, valid [B, N]: each row a random tree of a random size (padding after its nodes)."""
    g = torch.Generator().manual_seed(seed)
    parents = torch.full((batch, nodes), ROOT, dtype=torch.long)
    for i in range(1, nodes):
        parents[:, i] = torch.randint(ROOT, i, (batch,), generator=g)
    sizes = torch.randint(0, nodes + 1, (batch,), generator=g)
    valid = torch.arange(nodes)[None, :] < sizes[:, None]
    tokens = torch.randint(0, vocab, (batch, nodes), generator=g)
    return parents, tokens, valid


def reference_greedy(parents, tokens, valid, argmax) -> tuple[list[int], int]:
    """One row, walked by hand: from the root, the first child whose token is the argmax after its parent."""
    path, current = [], ROOT
    while True:
        children = [i for i in range(len(tokens)) if valid[i] and parents[i] == current]
        match = [i for i in children if tokens[i] == argmax[current + 1]]
        if not match:
            return path, argmax[current + 1]
        current = match[0]
        path.append(current)


def test_greedy_equals_a_walk_by_hand_on_random_ragged_trees():
    parents, tokens, valid = random_trees(batch=400, nodes=12, vocab=3, seed=0)
    argmax = torch.randint(0, 3, (400, 13), generator=torch.Generator().manual_seed(1))
    out = greedy_tree_verify(parents, tokens, valid, argmax)
    depths = []
    for b in range(400):
        n = int(valid[b].sum())  # its nodes, then padding
        check_parents(tokens[b, :n].tolist(), parents[b, :n].tolist())  # well formed, as a target worker checks a tree
        path, next_token = reference_greedy(parents[b].tolist(), tokens[b].tolist(), valid[b].tolist(),
                                            argmax[b].tolist())  # fmt: skip
        assert out.accepted_nodes(b) == path and int(out.next_token[b]) == next_token
        assert (out.path[b, len(path) :] == ROOT).all()
        depths.append(len(path))
    assert max(depths) >= 3 and min(depths) == 0  # the trees accepted paths of many lengths


@pytest.mark.parametrize("seed", range(3))
def test_a_chain_verifies_as_the_chain_verifiers_do(seed):
    g = torch.Generator().manual_seed(seed)
    batch, k, vocab = 64, 4, 6
    drafted = torch.randint(0, vocab, (batch, k), generator=g)
    parents, valid = chain_tree(k, batch)
    argmax = torch.randint(0, vocab, (batch, k + 1), generator=g)
    argmax[: batch // 2, :2] = drafted[: batch // 2, :2]  # some rows accept a few
    tree, chain = greedy_tree_verify(parents, drafted, valid, argmax), greedy_verify(drafted, argmax)
    assert torch.equal(tree.accepted, chain.accepted) and torch.equal(tree.next_token, chain.next_token)
    assert all(tree.accepted_nodes(b) == list(range(int(chain.accepted[b]))) for b in range(batch))

    probs = torch.softmax(torch.randn(batch, k + 1, vocab, generator=g) * 2, -1)
    one_hot = torch.nn.functional.one_hot(drafted, vocab).float()  # deterministic drafts, as prompt lookup's
    uniform, noise = torch.rand(batch, k, generator=g), torch.empty(batch, vocab).exponential_(generator=g)
    tree = rejection_tree_verify(parents, drafted, valid, probs, uniform, noise)
    chain = rejection_verify(drafted, one_hot, probs, uniform, noise)
    assert torch.equal(tree.accepted, chain.accepted) and torch.equal(tree.next_token, chain.next_token)


def test_a_tree_is_refused_unless_each_parent_is_the_root_or_an_earlier_node():
    """What a target worker checks of a tree call before verifying it (an invalid one: INVALID_ARGUMENT naming
    parents, tests/integration/workers/test_trees.py)."""
    check_parents([5, 6, 7], [ROOT, 0, 0])
    for parents in ([ROOT, 1, 0], [0, ROOT, 1], [ROOT, -2, 0]):
        with pytest.raises(ValueError, match="is not the root or an earlier node"):
            check_parents([5, 6, 7], parents)
    with pytest.raises(ValueError, match="3 tokens for 2 parents"):
        check_parents([5, 6, 7], [ROOT, 0])


def test_sampling_commits_tokens_distributed_as_the_target_samples_them():
    """A fixed tree (the root's candidates 1, 3 and 1 again; node 0's candidates 2 and 0; node 3's 4), 40,000 rows:
    the committed tokens, up to three of them, follow the target's distribution after the root, after node 0 and after
    node 3, as sampling from the target alone would draw them (chi-square on the exact joint)."""
    vocab, rows = 5, 40_000
    parents = torch.tensor([[ROOT, ROOT, ROOT, 0, 0, 3]]).expand(rows, 6)
    tokens = torch.tensor([[1, 3, 1, 2, 0, 4]]).expand(rows, 6)
    valid = torch.ones(rows, 6, dtype=torch.bool)
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(7, vocab, generator=g)  # after the root and after each node
    logits[0, 1] += 1.5  # the path 1 -> 2 -> 4 is likely enough to be sampled often
    logits[1, 2] += 1.5
    logits[4, 4] += 1.5
    probs = torch.softmax(logits, -1)
    target_probs = probs.expand(rows, 7, vocab)
    uniform, noise = torch.rand(rows, 6, generator=g), torch.empty(rows, vocab).exponential_(generator=g)
    out = rejection_tree_verify(parents, tokens, valid, target_probs, uniform, noise)

    after = {(): 0, (1,): 1, (3,): 2, (1, 2): 4, (1, 0): 5, (1, 2, 4): 6}  # committed prefix -> its distribution
    samples, joint = [], {}
    for b in range(rows):
        nodes = out.accepted_nodes(b)
        committed = tuple(tokens[0, nodes].tolist()) + (int(out.next_token[b]),)
        samples.append(committed)
    for committed in set(samples):
        prob = 1.0
        for n in range(len(committed)):
            prob *= float(probs[after[committed[:n]], committed[n]])
        joint[committed] = prob
    # the exact probability of every outcome the tree can produce sums to 1: no outcome is missing from the samples
    assert abs(sum(joint.values()) - 1.0) < 0.02
    assert chi2_pvalue(samples, joint) > 1e-3
    first = np.bincount([s[0] for s in samples], minlength=vocab) / rows
    assert 0.5 * np.abs(first - probs[0].numpy()).sum() < 0.015
    assert max(len(s) for s in samples) == 4  # some rows accepted the path 1 -> 2 -> 4 and took a bonus token
