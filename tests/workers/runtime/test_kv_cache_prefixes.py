"""Prefix caching in a worker's KV cache store (workers/runtime/kv_cache.py): a released request's cache is retained
and a later request that starts with its tokens takes it over, computing only what follows; the logits are those of a
full forward. Retained caches give way to running requests, past RETAINED_MAX and past the capacity's footprint."""

import pytest
import torch

from specserve.workers.config.settings import KVCacheConfig, ModelConfig
from specserve.workers.runtime import kv_cache
from specserve.workers.runtime.loading import load_model
from specserve.workers.runtime.runner import ForwardRow, ModelRunner
from tests.helpers.greedy_oracle import full_logits

TURN_1 = [3 + (7 * i) % 200 for i in range(80)]
KEPT = len(TURN_1) - kv_cache.RETAIN_LESS  # what a released TURN_1 leaves for later requests


@pytest.fixture(scope="module")
def target(tiny_target):
    return load_model(ModelConfig(path=tiny_target, device="cpu"))


def test_a_next_turn_computes_only_what_follows_its_history(target):
    runner = ModelRunner(target, KVCacheConfig())
    runner.logits_for("turn-1", TURN_1, 1)
    assert runner.release("turn-1") and runner.store.used_tokens == 0 and runner.store.cached_tokens == KEPT
    turn_2 = TURN_1 + [11, 12, 13, 14, 15]
    before = runner.forward_positions
    logits = runner.logits_for("turn-2", turn_2, 2)
    assert runner.forward_positions - before == len(turn_2) - KEPT  # the rest came from turn 1's cache
    assert torch.allclose(logits, full_logits(target.model, turn_2)[-2:], atol=1e-5, rtol=0)
    assert runner.store.prefix_hits == KEPT and runner.store.prefix_queries == len(TURN_1) + len(turn_2)
    assert runner.store.cached_tokens == 0 and runner.store.used_tokens == len(turn_2)  # taken over, not copied


def test_a_request_that_shares_part_of_a_history_rolls_back_to_it(target):
    runner = ModelRunner(target, KVCacheConfig())
    runner.logits_for("a", TURN_1, 1)
    runner.release("a")
    other = TURN_1[:30] + [99, 98, 97]
    before = runner.forward_positions
    logits = runner.logits_for("b", other, 1)
    assert runner.forward_positions - before == 3 and runner.store.prefix_hits == 30  # within what was kept
    assert torch.allclose(logits, full_logits(target.model, other)[-1:], atol=1e-5, rtol=0)


def test_a_new_request_takes_at_most_prefix_at_most_positions_of_a_cached_prefix(target):
    """prefix_at_most (an EAGLE-3 head's request: what its head holds) caps what a request new to the store takes
    over; below PREFIX_MIN_TOKENS it takes nothing; a request the store holds already keeps its own cache whole."""
    runner = ModelRunner(target, KVCacheConfig())
    runner.logits_for("a", TURN_1, 1)
    runner.release("a")
    turn_2 = TURN_1 + [11, 12, 13]
    before = runner.forward_positions
    (logits,) = runner.logits_for_batch([ForwardRow("b", turn_2, 1, prefix_at_most=20)])
    assert runner.forward_positions - before == len(turn_2) - 20 and runner.store.prefix_hits == 20
    assert torch.allclose(logits, full_logits(target.model, turn_2)[-1:], atol=1e-5, rtol=0)
    more = turn_2 + [14]
    before = runner.forward_positions
    runner.logits_for_batch([ForwardRow("b", more, 1, prefix_at_most=0)])  # "b" is held: its own cache stays
    assert runner.forward_positions - before == 1
    runner.release("b")
    before = runner.forward_positions
    runner.logits_for_batch([ForwardRow("c", turn_2, 1, prefix_at_most=kv_cache.PREFIX_MIN_TOKENS - 1)])
    assert runner.forward_positions - before == len(turn_2)


def test_short_prefixes_and_a_store_without_prefix_caching_compute_everything(target):
    runner = ModelRunner(target, KVCacheConfig())
    runner.logits_for("a", TURN_1, 1)
    runner.release("a")
    runner.logits_for("b", TURN_1[: kv_cache.PREFIX_MIN_TOKENS - 1] + [5, 6], 1)
    assert runner.store.prefix_hits == 0
    runner.logits_for("c", [4] * (kv_cache.PREFIX_MIN_TOKENS + kv_cache.RETAIN_LESS - 1), 1)
    runner.release("c")  # too short to leave a prefix: "a"'s is the only one kept
    assert runner.store.cached_tokens == KEPT
    off = ModelRunner(target, KVCacheConfig(prefix_caching=False))
    off.logits_for("a", TURN_1, 1)
    off.release("a")
    assert off.store.cached_tokens == 0 and off.store.cache.capacity == off.store.cache._initial
    off.logits_for("b", TURN_1 + [5], 1)
    assert off.store.prefix_hits == 0 and off.forward_positions == 2 * len(TURN_1) + 1


def test_retained_caches_give_way_to_running_requests(target):
    """Every slot is as long as the longest: "c" of 150 beside both retained entries would need 3 x 150 positions."""
    runner = ModelRunner(target, KVCacheConfig(capacity_tokens=320))
    runner.logits_for("a", TURN_1, 1)  # 80 positions, 48 kept
    runner.logits_for("b", [5 + i % 50 for i in range(80)], 1)
    runner.release("a")
    runner.release("b")
    assert runner.store.cached_tokens == 2 * KEPT
    runner.logits_for("c", [9] * 150, 1)  # needs 150: the least recently released ("a") gives way
    assert runner.store.used_tokens == 150 and runner.store.cached_tokens == KEPT
    runner.release("c")
    runner.logits_for("d", TURN_1 + [1], 1)
    assert runner.store.prefix_hits == 0  # "a" was given up


def test_retained_caches_keep_the_buffers_within_the_capacity(target):
    """Every slot is as long as the longest entry: a long retained entry among many must not multiply memory."""
    runner = ModelRunner(target, KVCacheConfig(capacity_tokens=800))
    for i in range(8):
        runner.logits_for(f"r{i}", [3 + (i * 13 + j) % 200 for j in range(50)], 1)
        runner.release(f"r{i}")
    assert len(runner.store._retained) == 8
    runner.logits_for("long", [7 + j % 100 for j in range(400)], 1)
    runner.release("long")
    store = runner.store
    assert store._footprint() <= 800 and len(store._retained) < 9
    assert store._retained and max(e.length for e in store._retained.values()) == 400 - kv_cache.RETAIN_LESS


def test_at_most_retained_max_entries(target, monkeypatch):
    monkeypatch.setattr(kv_cache, "RETAINED_MAX", 3)
    runner = ModelRunner(target, KVCacheConfig())
    for i in range(5):
        runner.logits_for(f"r{i}", [3 + (i * 13 + j) % 200 for j in range(50)], 1)
        runner.release(f"r{i}")
    assert len(runner.store._retained) == 3 and runner.store.cached_tokens == 3 * (50 - kv_cache.RETAIN_LESS)


def test_compacting_for_a_short_pass_keeps_a_longer_idle_request_whole(target):
    """A pass that outgrows the buffers compacts and reshapes them for its own rows; an idle request longer than
    those rows keeps every position it holds (its next call continues as a full recompute would)."""
    runner = ModelRunner(target, KVCacheConfig(capacity_tokens=400))
    idle = [5 + (3 * i) % 150 for i in range(150)]
    runner.logits_for("idle", idle, 1)
    for r in range(3):  # retained prefixes that take slots, then give way
        runner.logits_for(f"done-{r}", [11 + (5 * i + r) % 120 for i in range(60)], 1)
        runner.release(f"done-{r}")
    for step in range(4):  # a short request growing past the buffers' shape
        runner.logits_for("short", [7 + i % 90 for i in range(30 + 20 * step)], 1)
    assert runner.store.get("idle").length == len(idle)
    nxt = idle + [42]
    torch.testing.assert_close(
        runner.logits_for("idle", nxt, 1), full_logits(target.model, nxt)[-1:], rtol=0, atol=1e-5
    )
