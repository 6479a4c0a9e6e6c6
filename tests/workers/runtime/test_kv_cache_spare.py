"""Spare positions in a worker's KV cache store (workers/runtime/kv_cache.py): positions rolled back stay in the slot
until something is written over them, and a later call that goes on with the same tokens holds them again without
computing them (a chunked prompt over a cached prefix; rejected drafts sent again). The logits are a full forward's."""

import pytest
import torch

from specserve.workers.config.settings import KVCacheConfig, ModelConfig
from specserve.workers.runtime import kv_cache
from specserve.workers.runtime.loading import load_model
from specserve.workers.runtime.runner import ForwardRow, ModelRunner
from tests.helpers.greedy_oracle import full_logits

HISTORY = [3 + (7 * i) % 200 for i in range(120)]
KEPT = len(HISTORY) - kv_cache.RETAIN_LESS
CHUNK = 24


@pytest.fixture(scope="module")
def target(tiny_target):
    return load_model(ModelConfig(path=tiny_target, device="cpu"))


def _close(logits, model, seq, n):
    return torch.allclose(logits, full_logits(model, seq)[-n:], atol=1e-5, rtol=0)


def test_a_chunked_prompt_over_a_cached_history_computes_only_its_last_position_per_chunk(target):
    runner = ModelRunner(target, KVCacheConfig())
    runner.logits_for("turn-1", HISTORY, 1)
    runner.release("turn-1")
    turn_2 = HISTORY + [11, 12, 13, 14, 15]
    computed = []
    for end in range(CHUNK, len(turn_2) + CHUNK, CHUNK):  # each chunk a call, as the scheduler sends them
        seq = turn_2[: min(end, len(turn_2))]
        before = runner.forward_positions
        logits = runner.logits_for("turn-2", seq, 1)
        computed.append(runner.forward_positions - before)
        assert _close(logits, target.model, seq, 1)
    # a chunk within the cached prefix computes its last position only (its logits); past it, what is new
    assert computed[: KEPT // CHUNK] == [1] * (KEPT // CHUNK)
    assert sum(computed) < len(turn_2) - KEPT + len(computed)
    assert runner.store.used_tokens == len(turn_2)


def test_a_batch_padding_a_row_writes_nothing_over_its_spare_positions(target):
    runner = ModelRunner(target, KVCacheConfig())
    runner.logits_for("a", HISTORY, 1)
    runner.store.rollback("a", 40)  # 80 spare positions follow
    other = [5 + i % 50 for i in range(60)]
    runner.logits_for("b", other[:50], 1)
    rows = [ForwardRow("a", HISTORY[:41], 1), ForwardRow("b", other, 1)]  # "a" is padded by 9 columns
    out = runner.logits_for_batch(rows)
    assert _close(out[0], target.model, HISTORY[:41], 1) and _close(out[1], target.model, other, 1)
    before = runner.forward_positions
    logits = runner.logits_for("a", HISTORY, 1)
    assert runner.forward_positions - before == 1  # the spare positions were still good
    assert _close(logits, target.model, HISTORY, 1)


def test_rejected_drafts_sent_again_are_held_and_other_tokens_write_over_them(target):
    runner = ModelRunner(target, KVCacheConfig())
    drafted = HISTORY[:50] + [20, 21, 22, 23]
    runner.logits_for("r", drafted, 5)  # a verify of 4 drafted tokens
    runner.store.rollback("r", 51)  # one accepted
    before = runner.forward_positions
    assert _close(runner.logits_for("r", drafted, 1), target.model, drafted, 1)
    assert runner.forward_positions - before == 1
    runner.store.rollback("r", 51)
    changed = drafted[:51] + [30, 22, 23]  # another token where the spare ones follow different ones
    assert _close(runner.logits_for("r", changed, 3), target.model, changed, 3)
    assert runner.store.get("r").spare == []
    runner.store.rollback("r", 51)
    assert _close(runner.logits_for("r", drafted, 3), target.model, drafted, 3)  # computed again, not restored


def test_a_full_store_drops_spare_positions_before_refusing(target):
    runner = ModelRunner(target, KVCacheConfig(capacity_tokens=200, prefix_caching=False))
    runner.logits_for("a", HISTORY, 1)
    runner.store.rollback("a", 10)
    assert runner.store.get("a").extent == len(HISTORY)
    runner.logits_for("b", HISTORY[:90] + [7], 1)  # 2 slots x 120 positions would pass the capacity
    assert runner.store.get("a").spare == [] and runner.store.used_tokens == 10 + 91
