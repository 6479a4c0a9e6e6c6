"""A batch whose rows reach very different lengths runs as several passes (runner.by_extent): a short row does not
attend over (or gather) a long row's length of its slot. Each row's logits are still those it gets alone."""

import pytest
import torch

from specserve.workers.config.settings import KVCacheConfig, ModelConfig
from specserve.workers.runtime.loading import load_model
from specserve.workers.runtime.runner import EXTENT_SHARE, ForwardRow, ModelRunner, by_extent


@pytest.fixture(scope="module")
def target(tiny_target):
    return load_model(ModelConfig(path=tiny_target, device="cpu"))


def test_rows_group_by_extent_longest_first():
    assert by_extent([300, 4170, 280, 310]) == [[1], [3, 0, 2]]
    assert by_extent([100, 100]) == [[0, 1]]
    assert by_extent([100, int(100 * EXTENT_SHARE) - 1]) == [[0], [1]]
    assert by_extent([8, 4, 2, 1]) == [[0, 1], [2, 3]]


def test_a_long_row_and_short_rows_in_one_batch_give_each_row_its_alone_logits(target):
    runner = ModelRunner(target, KVCacheConfig())
    long = [3 + (7 * i) % 90 for i in range(200)]
    shorts = [[5 + (3 * i + r) % 80 for i in range(12)] for r in range(3)]
    alone = [runner.logits_for(f"alone-{r}", s, 2) for r, s in enumerate(shorts)]
    alone.append(runner.logits_for("alone-long", long, 2))
    before = runner.forward_calls
    rows = [ForwardRow(f"b-{r}", s, 2) for r, s in enumerate(shorts)] + [ForwardRow("b-long", long, 2)]
    batched = runner.logits_for_batch(rows)
    assert runner.forward_calls - before == 2  # the long row alone, the short ones together
    for a, b in zip(alone, batched, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
