"""An EAGLE-3 head's drafting on static buffers (workers/speculation/eagle/graphs.py): the same extensions and trees
as the eager path, rows padded to their bucket, buffers reused by later calls; on CUDA they replay CUDA graphs."""

import pytest
import torch

from specserve.workers.speculation.draft_tree import TreeShape
from specserve.workers.speculation.eagle import graphs
from specserve.workers.speculation.eagle.drafting import Eagle3Drafting
from specserve.workers.speculation.eagle.graphs import ExtendBucket, ExtendGraphs, LevelBucket, LevelGraphs
from specserve.workers.speculation.eagle.tree import draft_trees
from tests.helpers.eagle_heads import random_head

H, FEATURES, VOCAB = 32, 96, 259
SHAPE = TreeShape(depth=6, topk=4, budget=16)  # k='auto''s shape: every level expanded (no least probability)


class _Config:
    hidden_size, intermediate_size, num_attention_heads, num_key_value_heads = H, 64, 4, 2
    vocab_size, rms_norm_eps, max_position_embeddings, num_hidden_layers = VOCAB, 1e-6, 512, 8
    rope_parameters = {"rope_type": "default", "rope_theta": 10000.0}


def _drafting(device: str, static: bool) -> Eagle3Drafting:
    head = random_head(_Config(), 48, seed=0, std=0.3).to(device)
    embed = (torch.randn(VOCAB, H, generator=torch.Generator().manual_seed(0)) * 0.5).to(device)
    drafting = Eagle3Drafting(head, embed)
    if static:
        drafting.level_graphs = LevelGraphs(head, embed, capture=device == "cuda")
        drafting.extend_graphs = ExtendGraphs(head, embed, capture=device == "cuda")
    return drafting


def _rows(lengths: list[int], seed: int):
    g = torch.Generator().manual_seed(seed)
    rows = []
    for i, n in enumerate(lengths):
        features = torch.randn(n, FEATURES, generator=g) * 3
        rows.append((f"r{seed}-{i}", features, torch.randint(3, VOCAB, (n,), generator=g).tolist()))
    return rows


def _trees(drafting: Eagle3Drafting, rows, shape: TreeShape = SHAPE):
    first = drafting.extend(rows)
    return draft_trees(drafting, [r for r, _, _ in rows], first, shape)


def _assert_same(static_trees, eager_trees):
    for a, b in zip(static_trees, eager_trees, strict=True):
        assert a.tokens == b.tokens and a.parents == b.parents
        torch.testing.assert_close(torch.tensor(a.scores), torch.tensor(b.scores), atol=1e-4, rtol=0)


def test_static_levels_draft_the_trees_the_eager_levels_draft(device):
    static, eager = _drafting(device, True), _drafting(device, False)
    # ragged rows padded to a bucket of 4, then other rows in the same bucket (its buffers hold the first trees'
    # keys), then one row alone, then the first rows again, one entry on
    for lengths, seed in (([9, 4, 13], 1), ([5, 6, 11], 2), ([7], 3), ([9, 4, 13], 1)):
        rows = _rows(lengths, seed)
        if seed == 1 and static.level_graphs.buffers:
            rows = [(r, f[-1:], t[-1:]) for r, f, t in _rows([10, 5, 14], 1)]
        _assert_same(_trees(static, rows), _trees(eager, rows))
    buckets = static.level_graphs.buffers
    assert set(buckets) == {LevelBucket(4, 256, 4, 6), LevelBucket(1, 256, 4, 6)}
    if device == "cuda":
        assert all(set(b.graphs) == set(range(1, SHAPE.depth)) for b in buckets.values())


def test_a_tree_past_every_bucket_or_the_cap_runs_the_eager_levels(device, monkeypatch):
    monkeypatch.setattr(graphs, "TREE_CONTEXT", (8,))
    static, eager = _drafting(device, True), _drafting(device, False)
    rows = _rows([13], 4)  # 13 committed entries: past the one context bucket
    _assert_same(_trees(static, rows), _trees(eager, rows))
    assert not static.level_graphs.buffers
    monkeypatch.setattr(graphs, "MAX_BUCKETS", 1)
    rows = _rows([5], 5)
    _assert_same(_trees(static, rows), _trees(eager, rows))
    rows = _rows([3, 6], 6)  # a second bucket: past the cap
    _assert_same(_trees(static, rows), _trees(eager, rows))
    assert list(static.level_graphs.buffers) == [LevelBucket(1, 8, 4, 6)]


@pytest.mark.parametrize("shape", [TreeShape(depth=3, topk=2, budget=6), TreeShape(depth=4, topk=3, budget=30)])
def test_other_shapes_take_buckets_of_their_own(device, shape):
    static, eager = _drafting(device, True), _drafting(device, False)
    rows = _rows([9, 4], 7)
    _assert_same(_trees(static, rows, shape), _trees(eager, rows, shape))
    assert list(static.level_graphs.buffers) == [LevelBucket(2, 256, shape.topk, shape.depth)]


def _same_caches(static: Eagle3Drafting, eager: Eagle3Drafting, request_ids: list[str]) -> None:
    for a, b in zip(static.states(request_ids), eager.states(request_ids), strict=True):
        assert (a.offset, a.count) == (b.offset, b.count)
        torch.testing.assert_close(a.keys[:, : a.count], b.keys[:, : b.count], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(a.values[:, : a.count], b.values[:, : b.count], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(a.last_hidden, b.last_hidden, atol=1e-5, rtol=1e-5)


def test_the_static_extension_appends_what_the_eager_one_does(device):
    """Rows that extend by different counts on caches of different lengths: a prompt's entries (wider than every
    bucket: eager), then rounds of 1-4 new entries, a rolled-back row and one started again later."""
    static, eager = _drafting(device, True), _drafting(device, False)
    g = torch.Generator().manual_seed(8)

    def extend(rows):
        steps = [d.extend(rows) for d in (static, eager)]
        torch.testing.assert_close(steps[0].logits, steps[1].logits, atol=1e-4, rtol=1e-4)
        _same_caches(static, eager, [r for r, _, _ in rows])

    def new(request_id: str, n: int):
        return (
            request_id,
            torch.randn(n, FEATURES, generator=g) * 3,
            torch.randint(3, VOCAB, (n,), generator=g).tolist(),
        )

    extend([new("a", 30), new("b", 5), new("c", 12)])
    assert not static.extend_graphs.buffers  # 30 new entries: past the widest bucket
    extend([new("a", 1), new("b", 4), new("c", 2)])
    extend([new("a", 3), new("b", 1), new("c", 1)])
    for d in (static, eager):
        d.rollback("b", 7)
        d.restart("c", 40)
    extend([new("b", 2), new("c", 3)])  # b from 7 on; c's cache starts again at 40
    extend([new("a", 1)])
    assert set(static.extend_graphs.buffers) >= {ExtendBucket(4, 4, 256), ExtendBucket(2, 4, 256)}
    rows = [new("a", 2), new("b", 1)]
    _assert_same(_trees(static, rows), _trees(eager, rows))


def test_a_static_chain_drafts_what_a_draft_chain_drafts(device):
    """Chained steps after ragged rows' caches, fed each step's greedy token: the same logits step by step, for a
    chain as long as a bucket holds, on buffers a shorter chain used before."""
    static, eager = _drafting(device, True), _drafting(device, False)
    static.chain_graphs = graphs.ChainGraphs(static.head, static.embed_weight, capture=device == "cuda")
    for lengths, seed, steps in (([6, 3], 9, 4), ([9, 4, 13], 10, graphs.CHAIN_STEPS)):
        rows = _rows(lengths, seed)
        chains = []
        for d in (static, eager):
            first = d.extend(rows)
            chains.append((d.chain([r for r, _, _ in rows], first), first.logits))
        (static_chain, logits), (eager_chain, eager_logits) = chains
        assert isinstance(static_chain, graphs.StaticChain)
        for _ in range(steps):
            tokens = static.head.draft_to_target(logits.argmax(-1))
            torch.testing.assert_close(tokens, eager.head.draft_to_target(eager_logits.argmax(-1)))
            logits, eager_logits = static_chain.step(tokens).logits, eager_chain.step(tokens).logits
            torch.testing.assert_close(logits, eager_logits, atol=1e-4, rtol=1e-4)
    assert set(static.chain_graphs.buffers) == {graphs.ChainBucket(2, 256), graphs.ChainBucket(4, 256)}


def test_past_the_byte_cap_every_step_runs_eagerly(device, monkeypatch):
    """Buffers within MAX_BUFFER_BYTES a kind of step: a bucket too big for what is left runs eagerly, the same."""
    static, eager = _drafting(device, True), _drafting(device, False)
    static.chain_graphs = graphs.ChainGraphs(static.head, static.embed_weight, capture=device == "cuda")
    monkeypatch.setattr(graphs, "MAX_BUFFER_BYTES", 64 * 1024)  # a one-row bucket's (~36 KB), not two rows'
    for lengths, seed in (([7], 11), ([5, 9], 12)):
        rows = _rows(lengths, seed)
        _assert_same(_trees(static, rows), _trees(eager, rows))
        first = static.extend([(r, f[-1:], t[-1:]) for r, f, t in _rows([n + 1 for n in lengths], seed)])
        chain = static.chain([r for r, _, _ in rows], first)
        assert isinstance(chain, graphs.StaticChain) == (len(lengths) == 1)
    for held in (static.level_graphs, static.extend_graphs, static.chain_graphs):
        assert [key.rows for key in held.buffers] == [1] and held.held.bytes <= 64 * 1024
