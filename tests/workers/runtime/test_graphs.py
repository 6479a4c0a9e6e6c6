"""The static-shape pass (runtime/graphs.py): a batch padded to its bucket's rows, columns and attended length gives
the packed pass's logits, features and cache. On a CPU it runs eagerly over the static buffers, which checks the
padding, the masks and the column mapping; on CUDA a runner replays captured graphs, checked against enforce_eager.
"""

import dataclasses

import pytest
import torch

from specserve.workers.config.settings import KVCacheConfig, ModelConfig
from specserve.workers.runtime.graphs import BucketKey, GraphedForward
from specserve.workers.runtime.loading import load_model
from specserve.workers.runtime.runner import ForwardRow, ModelRunner
from specserve.workers.runtime.tree_rows import TreeRow

CLOSE = {"rtol": 1e-4, "atol": 1e-4}


@pytest.fixture(scope="module")
def target(tiny_target, device):
    return load_model(ModelConfig(path=tiny_target, device=device, dtype="float32"))  # graphs against eager: fp32


def _static(target) -> ModelRunner:
    """A runner whose passes go through the static buffers: replayed graphs on CUDA, eagerly on a CPU."""
    runner = ModelRunner(target, KVCacheConfig())
    if runner.graphs is None:
        runner.graphs = GraphedForward(runner.store.cache, runner.model.dtype, runner.device, capture=False)
    return runner


def _packed(target) -> ModelRunner:
    return ModelRunner(dataclasses.replace(target, enforce_eager=True), KVCacheConfig())


def _prompts():
    long = [3 + (7 * i) % 90 for i in range(300)]
    shorts = [[5 + (3 * i + r) % 80 for i in range(12 + 5 * r)] for r in range(3)]
    return long, shorts


def test_a_runner_graphs_its_passes_on_cuda_only_and_never_with_enforce_eager(target):
    assert (ModelRunner(target, KVCacheConfig()).graphs is not None) == (target.device.type == "cuda")
    assert _packed(target).graphs is None


def test_steps_and_chains_of_different_widths_and_depths_equal_the_packed_pass(target):
    long, shorts = _prompts()
    static, packed = _static(target), _packed(target)
    for runner in (static, packed):  # prompts prefill in the packed way (wider than any bucket)
        runner.forward_batch([ForwardRow("long", long, 1)] + [ForwardRow(f"s{r}", s, 1) for r, s in enumerate(shorts)])
    steps = [(long + [7], 1), (shorts[0] + [8, 9, 10], 3), (shorts[1] + [11, 12, 13, 14, 15], 5), (shorts[2] + [4], 1)]
    for _ in range(2):  # twice: the second pass reads what the first wrote through the static buffers
        outs = []
        for runner in (static, packed):
            rows = [ForwardRow(rid, seq, n) for rid, (seq, n) in zip(("long", "s0", "s1", "s2"), steps, strict=True)]
            outs.append(runner.forward_batch(rows))
        for a, b in zip(*outs, strict=True):
            torch.testing.assert_close(a.logits, b.logits, **CLOSE)
        steps = [(seq + [21], 1) for seq, _ in steps]  # then a step each
    graphs = static.graphs
    assert BucketKey(4, 8, 512, False) in graphs.passes  # 4 rows, 5 wide at most, 300 + 5 deep
    assert BucketKey(4, 1, 512, False) in graphs.passes  # then one step each


def test_trees_beside_chains_and_their_features_equal_the_packed_pass(target):
    long, shorts = _prompts()
    outs = []
    for runner in (_static(target), _packed(target)):
        runner.capture_features([0, 1])
        runner.forward_batch([ForwardRow("long", long, 1), ForwardRow("s", shorts[1], 1)], capture=True)
        chains = [ForwardRow("long", long + [4, 5, 6], 3)]
        trees = [TreeRow("s", shorts[1], tokens=[4, 5, 6, 7], parents=[-1, 0, 0, 1])]
        outs.append(runner.forward_mixed(chains, trees, capture=True))
    (static_chains, static_trees), (packed_chains, packed_trees) = outs
    for a, b in zip(static_chains + static_trees, packed_chains + packed_trees, strict=True):
        torch.testing.assert_close(a.logits, b.logits, **CLOSE)
        torch.testing.assert_close(a.features, b.features, **CLOSE)


def test_a_whole_auto_tree_fits_a_bucket(target):
    """k='auto' drafts 16-node trees: their verify (the last committed token and 16 nodes, 17 positions) replays a
    graph, not eagerly."""
    from specserve.workers.speculation.planner.tree import MAX_TREE_NODES

    long, _ = _prompts()
    outs, runners = [], (_static(target), _packed(target))
    for runner in runners:
        runner.forward_batch([ForwardRow("a", long, 1)])  # the prompt: wider than any bucket, packed
        nodes = list(range(4, 4 + MAX_TREE_NODES))
        # as in decoding, the last round's recovered or bonus token (3) is not cached yet: 1 + 16 new positions
        parents = [-1] + [i // 2 for i in range(MAX_TREE_NODES - 1)]
        outs.append(runner.forward_mixed([], [TreeRow("a", long + [3], tokens=nodes, parents=parents)])[1][0])
    torch.testing.assert_close(outs[0].logits, outs[1].logits, **CLOSE)
    assert [key.width for key in runners[0].graphs.passes] == [MAX_TREE_NODES + 1]


def test_a_batch_past_every_bucket_runs_packed(target):
    long, _ = _prompts()
    runner = _static(target)
    runner.forward_batch([ForwardRow("a", long[:40], 1)])  # 40 new positions: wider than the widest bucket
    assert not runner.graphs.passes
    runner.forward_batch([ForwardRow("a", long[:41], 1)])
    assert list(runner.graphs.passes) == [BucketKey(1, 1, 256, False)]


def test_past_the_most_graphs_new_buckets_run_packed(target, monkeypatch):
    from specserve.workers.runtime import graphs

    monkeypatch.setattr(graphs, "MAX_GRAPHS", 1)
    long, _ = _prompts()
    runner, packed = _static(target), _packed(target)
    outs = []
    for r in (runner, packed):
        r.forward_batch([ForwardRow("a", long[:40], 1)])  # the prompt: packed
        r.forward_batch([ForwardRow("a", long[:41], 1)])  # a step: the first bucket
        outs.append(r.forward_batch([ForwardRow("a", long[:44], 3)])[0])  # 3 new positions: a second bucket
    assert list(runner.graphs.passes) == [BucketKey(1, 1, 256, False)]
    torch.testing.assert_close(outs[0].logits, outs[1].logits, **CLOSE)


def test_past_the_output_bytes_new_buckets_run_packed(target):
    """The graphs' outputs sit outside the KV budget: past `max_output_bytes` (a share of the GPU by default) no new
    bucket is made, and the buckets made go on replaying."""
    long, _ = _prompts()
    runner, packed = _static(target), _packed(target)
    runner.graphs.max_output_bytes = 1
    outs = []
    for r in (runner, packed):
        r.forward_batch([ForwardRow("a", long[:40], 1)])  # the prompt: packed
        r.forward_batch([ForwardRow("a", long[:41], 1)])  # a step: the first bucket, recorded on CUDA
        if r is runner:
            runner.graphs.output_bytes = max(runner.graphs.output_bytes, 1)  # as a recording adds its outputs' bytes
        r.forward_batch([ForwardRow("a", long[:42], 1)])  # the same bucket: it goes on
        outs.append(r.forward_batch([ForwardRow("a", long[:45], 3)])[0])  # 3 new positions: no new bucket
    assert list(runner.graphs.passes) == [BucketKey(1, 1, 256, False)]
    torch.testing.assert_close(outs[0].logits, outs[1].logits, **CLOSE)
    if target.device.type == "cuda":
        assert 0 < runner.graphs.output_bytes < 1 << 30
