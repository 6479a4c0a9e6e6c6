"""Dynamic draft trees from an EAGLE-3 head (workers/speculation/eagle3_tree.py): every node's score is the head's
log-probability of its path as a chain drafting that path computes it (so each node saw exactly the committed
entries and its ancestors, at the right positions), each level expands the best nodes, the tree keeps the best
candidates with their parents, in ragged batches."""

import torch

from specserve.workers.runtime.tree_rows import ROOT
from specserve.workers.speculation.draft_tree import TreeShape
from specserve.workers.speculation.eagle.drafting import Eagle3Drafting
from specserve.workers.speculation.eagle.tree import draft_trees
from tests.helpers.eagle_heads import random_head

H, FEATURES = 32, 96
VOCAB = 259


class _Config:
    hidden_size, intermediate_size, num_attention_heads, num_key_value_heads = H, 64, 4, 2
    vocab_size, rms_norm_eps, max_position_embeddings, num_hidden_layers = VOCAB, 1e-6, 512, 8
    rope_parameters = {"rope_type": "default", "rope_theta": 10000.0}


def setup_requests(lengths: list[int], seed: int = 0):
    head = random_head(_Config(), 48, seed=seed, std=0.3)
    embed = torch.randn(VOCAB, H, generator=torch.Generator().manual_seed(seed)) * 0.5
    drafting = Eagle3Drafting(head, embed)
    g = torch.Generator().manual_seed(seed + 1)
    rows = [(f"r{i}", torch.randn(n, FEATURES, generator=g) * 3, torch.randint(3, VOCAB, (n,), generator=g).tolist())
            for i, n in enumerate(lengths)]  # fmt: skip
    return head, drafting, rows


def path_of(tree, node: int) -> list[int]:
    path = []
    while node != ROOT:
        path.append(node)
        node = tree.parents[node]
    return path[::-1]


def chain_score(head, drafting, request_id: str, first_logits, first, tokens: list[int]) -> float:
    """The head's log-probability of `tokens` drafted as a chain (DraftChain) after `first`."""
    t2d = torch.full((VOCAB,), -1, dtype=torch.long)
    t2d[head.draft_to_target(torch.arange(head.config.draft_vocab_size))] = torch.arange(head.config.draft_vocab_size)
    chain = drafting.chain([request_id], first)
    logits, score = first_logits, 0.0
    for token in tokens:
        score += float(logits.float().log_softmax(-1)[0, t2d[token]])
        logits = chain.step(torch.tensor([token])).logits
    return score


def test_every_nodes_score_is_its_path_drafted_as_a_chain_in_ragged_batches():
    head, drafting, rows = setup_requests([9, 4, 13])
    first = drafting.extend(rows)
    shape = TreeShape(depth=4, topk=3, budget=30)  # every candidate: 3, then 9 per expanded level
    trees = draft_trees(drafting, [r for r, _, _ in rows], first, shape)
    for b, ((request_id, _, _), tree) in enumerate(zip(rows, trees, strict=True)):
        assert len(tree.tokens) == len(tree.parents) == 30
        assert all(ROOT <= p < i for i, p in enumerate(tree.parents))
        depths = [len(path_of(tree, i)) for i in range(30)]
        assert depths == sorted(depths) and max(depths) == 4
        row_first = type(first)(first.logits[b : b + 1], first.hidden[b : b + 1])
        for node in range(30):
            tokens = [tree.tokens[i] for i in path_of(tree, node)]
            want = chain_score(head, drafting, request_id, row_first.logits, row_first, tokens)
            assert abs(tree.scores[node] - want) < 1e-4, (b, node)
        # the root's children are the head's 3 best tokens (every tree keeps them: no path scores higher)
        best = first.logits[b].float().log_softmax(-1).topk(3).values
        root = sorted((s for s, p in zip(tree.scores, tree.parents, strict=True) if p == ROOT), reverse=True)
        torch.testing.assert_close(torch.tensor(root), best, atol=1e-6, rtol=0)


def test_the_tree_keeps_the_best_candidates_and_their_parents():
    head, drafting, rows = setup_requests([7])
    first = drafting.extend(rows)
    big = draft_trees(drafting, ["r0"], first, TreeShape(depth=3, topk=4, budget=100))[0]
    assert len(big.tokens) == 4 + 2 * 16  # every candidate: the root's 4, then 16 per expanded level
    small = draft_trees(drafting, ["r0"], first, TreeShape(depth=3, topk=4, budget=6))[0]
    assert sorted(small.scores, reverse=True) == sorted(big.scores, reverse=True)[:6]
    for i, parent in enumerate(small.parents):
        assert parent == ROOT or small.scores[parent] >= small.scores[i]


def test_levels_stop_where_no_frontier_path_is_likely_enough():
    """A level is expanded only while the best frontier path's probability reaches min_path_prob: the tree is the
    full one's nodes above the levels it skipped."""
    head, drafting, rows = setup_requests([7])
    first = drafting.extend(rows)
    full = draft_trees(drafting, ["r0"], first, TreeShape(depth=4, topk=3, budget=100))[0]
    depths = [len(path_of(full, i)) for i in range(len(full.tokens))]
    best_at = [max(s for s, d in zip(full.scores, depths, strict=True) if d == level) for level in (1, 2, 3)]
    assert best_at == sorted(best_at, reverse=True)
    for levels in (1, 2, 3):  # a threshold just above the best path of level `levels`: no deeper level
        above = float(torch.tensor(best_at[levels - 1]).exp()) * 1.01
        cut = draft_trees(drafting, ["r0"], first, TreeShape(depth=4, topk=3, budget=100, min_path_prob=above))[0]
        kept = [i for i, d in enumerate(depths) if d <= levels]
        assert cut.tokens == [full.tokens[i] for i in kept] and cut.parents == full.parents[: len(kept)]
    assert draft_trees(drafting, ["r0"], first, TreeShape(depth=4, topk=3, budget=100, min_path_prob=0.0))[0] == full
