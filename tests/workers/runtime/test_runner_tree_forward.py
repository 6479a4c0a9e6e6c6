"""The target's forward over drafted trees (ModelRunner.forward_tree): each node's logits and features are those of
its root-to-node path decoded alone, in ragged batches on partly cached requests; keeping the accepted path moves its
keys/values next to the committed tokens, so decoding on from it equals target-only; tensor-parallel trees equal the
single process's."""

import multiprocessing as mp

import pytest
import torch

from specserve.workers.config.settings import KVCacheConfig, ModelConfig
from specserve.workers.runtime.loading import load_model
from specserve.workers.runtime.runner import ModelRunner
from specserve.workers.runtime.tree_rows import ROOT, TreeRow
from specserve.workers.service.local_processes import free_port
from specserve.workers.service.tensor_parallel import Rendezvous
from tests.helpers.workers import save_tiny_llama

# node:     0   1   2   3   4   5   6
PARENTS = [ROOT, ROOT, 0, 0, 2, 1, 4]  # depths 0 0 1 1 2 1 3
TOKENS = [11, 12, 13, 14, 15, 16, 17]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = save_tiny_llama(tmp_path_factory.mktemp("tree_forward") / "target", seed=3, layers=3, hidden=32)
    return load_model(ModelConfig(path=path, device="cpu"))


def path_to(row: TreeRow, node: int) -> list[int]:
    return [row.tokens[i] for i in row.lineages()[node]]


@torch.no_grad()
def alone(model, tokens: list[int]) -> torch.Tensor:
    """The model's logits after the last token, with no cache at all."""
    return model.model(torch.tensor([tokens])).logits[0, -1].float()


def test_each_nodes_logits_are_its_paths_decoded_alone_in_ragged_batches(model):
    runner = ModelRunner(model, KVCacheConfig())
    first = TreeRow("a", list(range(20, 35)), TOKENS, PARENTS)
    second = TreeRow("b", [40, 41, 42], [50, 51, 52], [ROOT, 0, ROOT])
    runner.logits_for("a", first.sequence[:10], 1)  # "a" has part of its sequence cached already
    outputs = runner.forward_tree([first, second])
    for row, out in zip((first, second), outputs, strict=True):
        assert out.logits.shape == (len(row.tokens) + 1, runner.vocab_size)
        torch.testing.assert_close(out.logits[0], alone(model, list(row.sequence)), atol=1e-4, rtol=1e-4)
        for node in range(len(row.tokens)):
            want = alone(model, list(row.sequence) + path_to(row, node))
            torch.testing.assert_close(out.logits[node + 1], want, atol=1e-4, rtol=1e-4)
    assert outputs[0].start == 10 and outputs[1].start == 0


def test_keeping_the_accepted_path_then_decoding_equals_target_only(model):
    runner = ModelRunner(model, KVCacheConfig())
    row = TreeRow("r", list(range(20, 32)), TOKENS, PARENTS)
    runner.forward_tree([row])
    runner.keep_path("r", [0, 2, 4])  # 11 13 15
    kept = list(row.sequence) + [11, 13, 15]
    assert runner.store.get("r").tokens == kept
    fed = runner.forward_positions
    logits = runner.logits_for("r", kept + [7], 1)[0]
    assert runner.forward_positions - fed == 1  # the kept path's keys/values were reused
    torch.testing.assert_close(logits, alone(model, kept + [7]), atol=1e-4, rtol=1e-4)

    # a second round's tree on top, none of it kept: the next round decodes from the committed tokens only
    runner.forward_tree([TreeRow("r", kept + [7], [9, 10], [ROOT, ROOT])])
    runner.keep_path("r", [])
    torch.testing.assert_close(runner.logits_for("r", kept + [7, 8], 1)[0], alone(model, kept + [7, 8]), atol=1e-4,
                               rtol=1e-4)  # fmt: skip
    with pytest.raises(KeyError):
        runner.keep_path("r", [0])  # no tree is waiting


def test_features_of_the_nodes_are_those_of_their_paths(model):
    runner = ModelRunner(model, KVCacheConfig())
    runner.capture_features((1, 2))
    row = TreeRow("f", [5, 6, 7, 8], TOKENS[:4], PARENTS[:4])
    out = runner.forward_tree([row], capture=True)[0]
    assert out.features.shape == (len(row.sequence) + 4, 2 * 32)  # nothing was cached: the whole sequence, then nodes
    for node in range(4):
        tokens = list(row.sequence) + path_to(row, node)
        with torch.no_grad():
            hidden = model.model(torch.tensor([tokens]), output_hidden_states=True).hidden_states
        want = torch.cat([hidden[1][0, -1], hidden[2][0, -1]])
        torch.testing.assert_close(out.features[len(row.sequence) + node], want, atol=1e-4, rtol=1e-4)


def test_malformed_trees_are_refused_before_the_cache_changes(model):
    runner = ModelRunner(model, KVCacheConfig())
    for row, message in (
        (TreeRow("x", [1, 2], [3, 4], [ROOT, 1]), "node 1's parent 1"),
        (TreeRow("x", [1, 2], [3], [ROOT, 0]), "1 tokens for 2 parents"),
        (TreeRow("x", [], [3], [ROOT]), "needs a committed token"),
    ):
        with pytest.raises(ValueError, match=message):
            runner.forward_tree([row])
    assert runner.store.used_tokens == 0


def tensor_parallel_trees(rank: int, rendezvous, path: str, results) -> None:
    """One rank: a tree, its path kept, one decoding step, through the mirrored runner; rank 0 reports logits."""
    import torch.distributed as dist

    from specserve.workers.service.tensor_parallel import TensorParallelRunner, follow, init_rank, load_sharded

    init_rank(rank, rendezvous)
    runner = ModelRunner(load_sharded(ModelConfig(path=path, device="cpu")), KVCacheConfig())
    try:
        if rank == 0:
            tp = TensorParallelRunner(runner)
            sequence = list(range(20, 32))
            tree = tp.forward_tree([TreeRow("r", sequence, TOKENS, PARENTS)])[0].logits
            tp.keep_path("r", [1, 5])
            step = tp.logits_for("r", sequence + [12, 16, 7], 1)
            results.put((tree.tolist(), step.tolist()))
            tp.shutdown()
        else:
            follow(runner)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_tensor_parallel_trees_equal_the_single_process(model):
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    rendezvous = Rendezvous("127.0.0.1", free_port(), 2, timeout_s=60)
    procs = [ctx.Process(target=tensor_parallel_trees, args=(r, rendezvous, model.path, results)) for r in range(2)]
    for p in procs:
        p.start()
    tree, step = results.get(timeout=180)
    for p in procs:
        p.join(30)
    runner = ModelRunner(model, KVCacheConfig())
    sequence = list(range(20, 32))
    want_tree = runner.forward_tree([TreeRow("r", sequence, TOKENS, PARENTS)])[0].logits
    runner.keep_path("r", [1, 5])
    want_step = runner.logits_for("r", sequence + [12, 16, 7], 1)
    torch.testing.assert_close(torch.tensor(tree), want_tree, atol=1e-5, rtol=0)
    torch.testing.assert_close(torch.tensor(step), want_step, atol=1e-5, rtol=0)
