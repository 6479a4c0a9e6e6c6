"""Prefix affinity (cluster/scheduling/affinity.py): a new request goes to the worker that held the most of its
prompt, when that is a tenth of it or more and the worker is not too loaded; chained block hashes match prefixes
only; the record is bounded and forgets a worker that left."""

from specserve.cluster.scheduling.affinity import BLOCK_TOKENS, PrefixAffinity, block_hashes

HISTORY = [3 + (7 * i) % 200 for i in range(200)]


def test_block_hashes_chain_so_that_equal_hashes_mean_equal_prefixes():
    a, b = block_hashes(HISTORY), block_hashes([1] + HISTORY[1:])
    assert len(a) == 200 // BLOCK_TOKENS and a == block_hashes(HISTORY + [5, 6])[: len(a)]
    assert not set(a) & set(b)  # one token differs in the first block: no block after it matches either


def test_a_request_goes_where_its_history_is_held_when_load_allows():
    affinity = PrefixAffinity(max_imbalance=2)
    affinity.record("t1", HISTORY)
    turn_2 = HISTORY + [9] * 40
    assert affinity.held(turn_2, ["t0", "t1"]) == ("t1", 192)
    assert affinity.place(turn_2, {"t0": 0, "t1": 2}) == "t1" and affinity.placed == 1
    assert affinity.place(turn_2, {"t0": 0, "t1": 3}) is None  # too loaded: by load
    assert affinity.place([1, 2, 3] + turn_2, {"t0": 0, "t1": 0}) is None  # nothing of it held
    assert affinity.place(HISTORY[:16] + [8] * 400, {"t0": 1, "t1": 1}) is None  # under a tenth of the prompt


def test_the_longest_holder_wins_and_a_worker_that_left_is_forgotten():
    affinity = PrefixAffinity()
    affinity.record("t0", HISTORY[:64])
    affinity.record("t1", HISTORY)
    assert affinity.place(HISTORY, {"t0": 0, "t1": 0}) == "t1"
    affinity.forget("t1")
    assert affinity.held(HISTORY, ["t0", "t1"]) == ("t0", 64)


def test_the_record_is_bounded_least_recently_recorded_first_out():
    affinity = PrefixAffinity(max_blocks=8)
    affinity.record("t0", HISTORY[:128])  # 8 blocks
    affinity.record("t1", [5] * 64)  # 4 more: t0's first 4 blocks go
    assert len(affinity._holders) == 8 and affinity.held(HISTORY[:64], ["t0"]) == (None, 0)
    assert affinity.held(HISTORY[:128], ["t0"]) == ("t0", 128)  # its later blocks still say so
