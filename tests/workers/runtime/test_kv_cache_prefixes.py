"""Prefix caching in a worker's KV cache store (workers/runtime/kv_cache.py): a released request's cache is retained
and a later request that starts with its tokens takes it over, computing only what follows; the logits are those of a
full forward. Retained caches give way to running requests and past RETAINED_MAX; the arena's runs slide together
before a retained prefix is given up for room."""

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
    assert off.store.cached_tokens == 0 and off.store.allocated_bytes == 0
    off.logits_for("b", TURN_1 + [5], 1)
    assert off.store.prefix_hits == 0 and off.forward_positions == 2 * len(TURN_1) + 1


def test_retained_caches_give_way_to_running_requests(target):
    """ "c" of 250 beside both retained entries (48 each) would need 346 positions of 320: the least recently released
    gives way; the other's run, left between free ones, slides down (compaction) rather than being given up."""
    runner = ModelRunner(target, KVCacheConfig(capacity_tokens=320))
    runner.logits_for("a", TURN_1, 1)  # 80 positions, 48 kept
    runner.logits_for("b", [5 + i % 50 for i in range(80)], 1)
    runner.release("a")
    runner.release("b")
    assert runner.store.cached_tokens == 2 * KEPT
    runner.logits_for("c", [9] * 250, 1)  # needs 250: the least recently released ("a") gives way
    assert runner.store.used_tokens == 250 and runner.store.cached_tokens == KEPT
    assert runner.store.compactions == 1
    runner.release("c")
    runner.logits_for("d", TURN_1 + [1], 1)
    assert runner.store.prefix_hits == 0  # "a" was given up


def test_a_long_retained_entry_among_short_ones_takes_its_own_length(target):
    """Each run is as long as its entry (whole blocks): eight short prefixes and a long one fit 800 positions
    together (a slot layout would give each the longest's length: 9 x 368)."""
    runner = ModelRunner(target, KVCacheConfig(capacity_tokens=800))
    for i in range(8):
        runner.logits_for(f"r{i}", [3 + (i * 13 + j) % 200 for j in range(50)], 1)
        runner.release(f"r{i}")
    assert len(runner.store._retained) == 8
    runner.logits_for("long", [7 + j % 100 for j in range(400)], 1)
    runner.release("long")
    store = runner.store
    assert len(store._retained) == 9 and store.allocated_bytes <= 800 * store.bytes_per_token
    assert max(e.length for e in store._retained.values()) == 400 - kv_cache.RETAIN_LESS


def test_at_most_retained_max_entries(target, monkeypatch):
    monkeypatch.setattr(kv_cache, "RETAINED_MAX", 3)
    runner = ModelRunner(target, KVCacheConfig())
    for i in range(5):
        runner.logits_for(f"r{i}", [3 + (i * 13 + j) % 200 for j in range(50)], 1)
        runner.release(f"r{i}")
    assert len(runner.store._retained) == 3 and runner.store.cached_tokens == 3 * (50 - kv_cache.RETAIN_LESS)


def test_compacting_for_a_short_pass_keeps_a_longer_idle_request_whole(target):
    """Runs growing and moving around retained ones: an idle request longer than the growing rows keeps every
    position it holds (its next call continues as a full recompute would)."""
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


def test_a_run_that_cannot_grow_in_a_fragmented_arena_compacts_and_every_request_goes_on_unchanged(target):
    runner = ModelRunner(target, KVCacheConfig(capacity_tokens=256, prefix_caching=False))
    seqs = {r: [3 + (11 * i + 7 * n) % 200 for i in range(40)] for n, r in enumerate("abc")}
    for r, seq in seqs.items():  # runs of 48 at 0, 48, 96
        runner.logits_for(r, seq, 1)
    runner.release("b")  # a hole of 48 between a and c
    seqs["a"] = seqs["a"] + [5 + i % 90 for i in range(110)]  # a needs 150: no free run is that long
    runner.logits_for("a", seqs["a"], 1)
    assert runner.store.compactions == 1
    for r in "ac":
        nxt = seqs[r] + [42]
        torch.testing.assert_close(runner.logits_for(r, nxt, 1), full_logits(target.model, nxt)[-1:], rtol=0, atol=1e-5)


def test_a_compaction_for_one_row_of_a_pass_keeps_the_room_another_row_grew_for_it(target):
    """c grows first (in place), then a's growth compacts the arena: c's run keeps the positions this pass writes,
    not just those it held, or c's new keys land in a's run."""
    runner = ModelRunner(target, KVCacheConfig(capacity_tokens=256, prefix_caching=False))
    seqs = {r: [3 + (11 * i + 7 * n) % 200 for i in range(40)] for n, r in enumerate("abc")}
    for r, seq in seqs.items():
        runner.logits_for(r, seq, 1)
    runner.release("b")
    seqs["c"] = seqs["c"] + [9 + i % 50 for i in range(20)]
    seqs["a"] = seqs["a"] + [5 + i % 90 for i in range(110)]
    out = runner.logits_for_batch([ForwardRow("c", seqs["c"], 1), ForwardRow("a", seqs["a"], 1)])
    assert runner.store.compactions == 1
    for r, logits in zip("ca", out, strict=True):
        torch.testing.assert_close(logits, full_logits(target.model, seqs[r])[-1:], rtol=0, atol=1e-5)
        nxt = seqs[r] + [42]
        torch.testing.assert_close(runner.logits_for(r, nxt, 1), full_logits(target.model, nxt)[-1:], rtol=0, atol=1e-5)


def test_a_new_request_copies_a_running_requests_prefix_and_both_go_on_as_alone(target):
    """A running request's positions are copied into the new request's own run (a shared system prompt among
    concurrent requests): it computes only what follows, and neither request's later positions reach the other's."""
    runner = ModelRunner(target, KVCacheConfig())
    runner.logits_for("a", TURN_1, 1)
    other = TURN_1[:60] + [99, 98, 97]
    before = runner.forward_positions
    logits = runner.logits_for("b", other, 1)
    assert runner.forward_positions - before == 3 and runner.store.prefix_hits == 60
    assert runner.store.prefix_copies == 1 and runner.store.used_tokens == len(TURN_1) + len(other)
    assert torch.allclose(logits, full_logits(target.model, other)[-1:], atol=1e-5, rtol=0)
    for rid, seq in (("a", TURN_1 + [42, 43]), ("b", other + [7]), ("a", TURN_1 + [42, 43, 44])):
        torch.testing.assert_close(runner.logits_for(rid, seq, 1), full_logits(target.model, seq)[-1:], rtol=0,
                                   atol=1e-5)  # fmt: skip


def test_a_retained_prefix_is_taken_over_unless_a_running_one_is_longer_and_both_obey_prefix_at_most(target):
    runner = ModelRunner(target, KVCacheConfig())
    runner.logits_for("running", TURN_1[:40] + [5, 6], 1)
    runner.logits_for("done", TURN_1, 1)  # copies the running request's 40
    runner.release("done")  # KEPT positions retained
    assert runner.store.prefix_copies == 1 and runner.store.prefix_hits == 40
    runner.logits_for("b", TURN_1 + [1], 1)  # the retained prefix is longer: taken over, nothing copied
    assert runner.store.prefix_copies == 1 and runner.store.cached_tokens == 0
    (logits,) = runner.logits_for_batch([ForwardRow("c", TURN_1 + [2], 1, prefix_at_most=20)])
    assert runner.store.prefix_copies == 2 and runner.store.get("c").length == len(TURN_1) + 1
    assert runner.store.prefix_hits == 40 + KEPT + 20
    assert torch.allclose(logits, full_logits(target.model, TURN_1 + [2])[-1:], atol=1e-5, rtol=0)
