"""A packed, ragged pass (runtime/ragged.py): rows of very different lengths and widths run in one forward pass,
each row attending over its own run, and get the logits they get alone; row by row (CPU) and gathered in one padded
call (the CUDA way) agree."""

import pytest
import torch

from specserve.workers.config.settings import KVCacheConfig, ModelConfig
from specserve.workers.runtime.loading import load_model
from specserve.workers.runtime.runner import ForwardRow, ModelRunner
from specserve.workers.runtime.tree_rows import TreeRow


@pytest.fixture(scope="module")
def target(tiny_target):
    return load_model(ModelConfig(path=tiny_target, device="cpu"))


def _long_and_shorts():
    long = [3 + (7 * i) % 90 for i in range(200)]
    shorts = [[5 + (3 * i + r) % 80 for i in range(12)] for r in range(3)]
    return long, shorts


@pytest.mark.parametrize("per_row", [True, False], ids=["per-row", "gathered"])
def test_a_long_row_and_short_rows_run_in_one_pass_with_each_rows_alone_logits(target, per_row):
    runner = ModelRunner(target, KVCacheConfig())
    runner.per_row = per_row
    long, shorts = _long_and_shorts()
    alone = [runner.logits_for(f"alone-{r}", s, 2) for r, s in enumerate(shorts)]
    alone.append(runner.logits_for("alone-long", long, 2))
    before = runner.forward_calls
    rows = [ForwardRow(f"b-{r}", s, 2) for r, s in enumerate(shorts)] + [ForwardRow("b-long", long, 2)]
    batched = runner.logits_for_batch(rows)
    assert runner.forward_calls - before == 1
    for a, b in zip(alone, batched, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_a_prompts_chunk_beside_decoding_rows_costs_its_columns_not_a_padded_batch(target):
    """A 64-token chunk and three 1-token decode steps: 67 packed columns, and the chunk's cache goes on as if
    prefilled alone."""
    runner = ModelRunner(target, KVCacheConfig())
    long, shorts = _long_and_shorts()
    for r, s in enumerate(shorts):
        runner.logits_for(f"s-{r}", s[:-1], 1)
    runner.logits_for("long", long[:100], 1)
    before = runner.forward_positions
    rows = [ForwardRow(f"s-{r}", s, 1) for r, s in enumerate(shorts)] + [ForwardRow("long", long[:164], 1)]
    runner.logits_for_batch(rows)
    assert runner.forward_positions - before == 3 + 64
    reference = ModelRunner(target, KVCacheConfig())
    torch.testing.assert_close(runner.logits_for("long", long, 4), reference.logits_for("ref", long, 4),
                               rtol=1e-4, atol=1e-4)  # fmt: skip


def test_tree_rows_gathered_equal_tree_rows_row_by_row(target):
    long, shorts = _long_and_shorts()
    outs = []
    for per_row in (True, False):
        runner = ModelRunner(target, KVCacheConfig())
        runner.per_row = per_row
        rows = [
            TreeRow("t-long", long, tokens=[4, 5, 6, 7], parents=[-1, 0, 0, 1]),
            TreeRow("t-short", shorts[0], tokens=[8, 9], parents=[-1, -1]),
        ]
        outs.append(runner.forward_tree(rows))
    for a, b in zip(*outs, strict=True):
        torch.testing.assert_close(a.logits, b.logits, rtol=1e-4, atol=1e-4)


def test_chains_and_trees_in_one_pass_equal_each_in_its_own(target):
    long, shorts = _long_and_shorts()

    def rows(tag):
        chains = [ForwardRow(f"{tag}-chunk", long[:150], 1), ForwardRow(f"{tag}-step", shorts[1] + [7, 8, 9], 4)]
        trees = [TreeRow(f"{tag}-tree", shorts[2], tokens=[4, 5, 6], parents=[-1, 0, -1])]
        return chains, trees

    apart = ModelRunner(target, KVCacheConfig())
    chains, trees = rows("a")
    expected = apart.forward_batch(chains) + apart.forward_tree(trees)
    together = ModelRunner(target, KVCacheConfig())
    chains, trees = rows("t")
    got_chains, got_trees = together.forward_mixed(chains, trees)
    assert together.forward_calls == 1
    for a, b in zip(expected, got_chains + got_trees, strict=True):
        torch.testing.assert_close(a.logits, b.logits, rtol=1e-4, atol=1e-4)
