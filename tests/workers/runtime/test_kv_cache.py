import pytest
import torch

from specserve.workers.config.settings import KVCacheConfig, ModelConfig
from specserve.workers.errors import KVCapacityError, RequestNotFoundError
from specserve.workers.runtime.kv_arena import BLOCK
from specserve.workers.runtime.loading import load_model
from specserve.workers.runtime.runner import ForwardRow, ModelRunner
from specserve.workers.runtime.worker_state import common_prefix_length
from tests.helpers.greedy_oracle import full_logits


@pytest.fixture(scope="module")
def target(tiny_target):
    return load_model(ModelConfig(path=tiny_target, device="cpu"))


def test_rollback_after_rejection_matches_full_recompute(target):
    runner = ModelRunner(target, KVCacheConfig())
    committed = [10, 20, 30, 40, 50]
    drafted = [60, 70, 80, 90]
    runner.logits_for("r", committed + drafted, len(drafted) + 1)
    assert runner.store.get("r").length == len(committed) + len(drafted)

    # Two drafted tokens accepted, the third rejected and replaced by a recovered token.
    seq = committed + drafted[:2] + [33]
    next_drafts = [44, 55]
    logits = runner.logits_for("r", seq + next_drafts, len(next_drafts) + 1)
    expected = full_logits(target.model, seq + next_drafts)[-(len(next_drafts) + 1) :]
    assert torch.allclose(logits, expected, atol=1e-5, rtol=0)
    # Only the new positions were computed: the cache kept the 7 agreeing positions.
    assert runner.forward_positions == 9 + 3
    assert runner.store.get("r").tokens == seq + next_drafts


def test_explicit_rollback_then_extend_matches_full_recompute(target):
    runner = ModelRunner(target, KVCacheConfig())
    seq = list(range(3, 40))
    runner.logits_for("r", seq, 1)
    runner.store.rollback("r", 20)
    assert runner.store.get("r").length == 20
    assert runner.store.used_tokens == 20
    logits = runner.logits_for("r", seq[:20] + [7, 8, 9], 3)
    assert torch.allclose(logits, full_logits(target.model, seq[:20] + [7, 8, 9])[-3:], atol=1e-5, rtol=0)


def test_capacity_is_enforced_and_release_frees(target):
    runner = ModelRunner(target, KVCacheConfig(capacity_tokens=16))
    runner.logits_for("a", list(range(3, 13)), 1)  # 10 positions
    with pytest.raises(KVCapacityError, match="capacity exceeded.*'b' needs 10 more positions, 10 of 16"):
        runner.logits_for("b", list(range(3, 13)), 1)
    assert runner.store.used_tokens == 10  # the failed request reserved nothing
    assert runner.release("a")
    assert runner.store.used_tokens == 0
    runner.logits_for("b", list(range(3, 13)), 1)
    assert runner.store.used_tokens == 10 and runner.store.bytes_per_token == target.kv_bytes_per_token


def test_unknown_request_is_a_distinct_error(target):
    runner = ModelRunner(target, KVCacheConfig())
    with pytest.raises(RequestNotFoundError, match="no KV cache for request 'ghost'"):
        runner.store.rollback("ghost", 0)
    assert not runner.release("ghost")


@pytest.mark.parametrize(
    "a, b, n", [([1, 2, 3], [1, 2, 3, 4], 3), ([1, 2, 3], [1, 5, 3], 1), ([], [1], 0), ([4], [5], 0)]
)
def test_common_prefix_length(a, b, n):
    assert common_prefix_length(a, b) == n


def test_a_ragged_batch_gives_every_row_its_own_logits(target):
    """Rows with different cached lengths, new-token counts and n, some rolled back, in one forward pass: each row's
    logits equal a full recompute of that row alone."""
    runner = ModelRunner(target, KVCacheConfig())
    runner.logits_for("a", list(range(3, 30)), 1)
    runner.logits_for("b", list(range(5, 25)), 1)
    rows = [
        ForwardRow("a", list(range(3, 20)) + [90, 91, 92], 4),  # rolled back to 17 cached positions, 3 new
        ForwardRow("b", list(range(5, 25)) + [8], 2),  # 20 cached, 1 new
        ForwardRow("c", list(range(40, 75)), 1),  # nothing cached: a 35-token prefill next to 1-token rows
    ]
    before = runner.forward_calls
    out = runner.logits_for_batch(rows)
    assert runner.forward_calls == before + 1
    for row, logits in zip(rows, out, strict=True):
        assert logits.shape == (row.n, runner.vocab_size)
        assert torch.allclose(logits, full_logits(target.model, row.sequence)[-row.n :], atol=1e-5, rtol=0), row
        assert runner.store.get(row.request_id).tokens == row.sequence
    assert runner.store.used_tokens == sum(len(row.sequence) for row in rows)


def test_released_rows_give_their_memory_back(target):
    runner = ModelRunner(target, KVCacheConfig(prefix_caching=False))  # retained prefixes: test_kv_cache_prefixes.py
    rows = [ForwardRow(f"r{i}", [3 + j % 200 for j in range(20 + 40 * i)], 1) for i in range(12)]
    runner.logits_for_batch(rows)
    reserved = runner.store.allocated_bytes // runner.store.bytes_per_token
    # each row's run holds its own length (whole blocks), not every row as long as the longest (12 x 460)
    held = sum(len(row.sequence) for row in rows)
    assert held <= reserved <= held + 12 * BLOCK
    for row in rows[1:]:
        assert runner.release(row.request_id)
    assert runner.store.used_tokens == 20
    assert runner.store.allocated_bytes == BLOCK * 2 * runner.store.bytes_per_token
    # The survivor's cache is intact after the buffers shrank.
    survivor = list(rows[0].sequence)
    logits = runner.logits_for("r0", survivor + [7], 1)
    assert torch.allclose(logits, full_logits(target.model, survivor + [7])[-1:], atol=1e-5, rtol=0)
    assert runner.forward_positions == sum(len(row.sequence) for row in rows) + 1
