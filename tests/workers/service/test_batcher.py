"""The continuous batcher alone: batches respect the size and token budget, never hold a request twice, take late
arrivals into the next forward pass, and give each call its own result or error."""

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from specserve.workers.config.settings import BatchingConfig
from specserve.workers.service.batcher import Batcher


def _batcher(config, gate=None, pads_rows=True):
    seen: list[list] = []

    def run(items):
        if gate is not None:
            gate.wait(5)
        seen.append(list(items))
        return [ValueError(f"bad {x}") if x == "bad" else x * 2 for x in items]

    return Batcher(ThreadPoolExecutor(1), run, config, pads_rows=pads_rows), seen


def _batches_behind_a_pass(config, calls, pads_rows=True) -> list[list]:
    """The batches run for the calls `calls(batcher)` makes (coroutines) while a first call's pass holds the worker."""
    gate = threading.Event()
    batcher, seen = _batcher(config, gate, pads_rows)

    async def main():
        blocker = asyncio.ensure_future(batcher.submit("x", 0, 1))
        await asyncio.sleep(0.05)
        queued = [asyncio.ensure_future(call) for call in calls(batcher)]
        await asyncio.sleep(0.05)
        gate.set()
        await asyncio.gather(blocker, *queued)

    asyncio.run(main())
    return seen


def test_calls_arriving_during_a_batch_join_the_next_one_within_size_and_token_budget():
    async def main():
        gate = threading.Event()
        batcher, seen = _batcher(BatchingConfig(max_batch_size=3, max_batch_tokens=10), gate)
        first = asyncio.ensure_future(batcher.submit("r0", 0, 1))
        await asyncio.sleep(0.05)  # r0 is running alone; the rest queue behind it
        rest = [asyncio.ensure_future(batcher.submit(f"r{i}", i, 4)) for i in range(1, 6)]
        await asyncio.sleep(0.05)
        gate.set()
        return await first, await asyncio.gather(*rest), seen

    first, rest, seen = asyncio.run(main())
    assert first == 0 and rest == [2, 4, 6, 8, 10]
    # r1..r5 cost 4 tokens each: the 10-token budget admits two per batch (the size limit, 3, never binds).
    assert seen == [[0], [1, 2], [3, 4], [5]]


def test_a_request_never_appears_twice_in_one_batch_and_errors_stay_with_their_call():
    async def main():
        gate = threading.Event()
        batcher, seen = _batcher(BatchingConfig(max_batch_size=8), gate)
        blocker = asyncio.ensure_future(batcher.submit("x", 100, 1))
        await asyncio.sleep(0.05)
        jobs = [batcher.submit("a", 1, 1), batcher.submit("a", 2, 1), batcher.submit("b", "bad", 1)]
        futures = [asyncio.ensure_future(j) for j in jobs]
        await asyncio.sleep(0.05)
        gate.set()
        await blocker
        results = await asyncio.gather(*futures, return_exceptions=True)
        return results, seen

    results, seen = asyncio.run(main())
    assert results[:2] == [2, 4]
    assert isinstance(results[2], ValueError) and "bad" in str(results[2])
    assert seen == [[100], [1, "bad"], [2]]


def test_a_single_call_larger_than_the_token_budget_still_runs_alone():
    async def main():
        batcher, seen = _batcher(BatchingConfig(max_batch_tokens=4))
        return await batcher.submit("big", 21, 50), seen

    result, seen = asyncio.run(main())
    assert result == 42 and seen == [[21]]


def _closed_loops(config, rounds=6, away_s=0.002, run_s=0.05):
    """Eight requests in a closed loop (each sends its next call `away_s` after the last answer: 2 ms for a plain
    step), the second four starting 10 ms after the first four, against a `run_s` forward pass. Returns the batch
    sizes."""

    def run(items):
        time.sleep(run_s)
        return list(items)

    batcher = Batcher(ThreadPoolExecutor(1), run, config)
    sizes: list[int] = []
    batcher._on_batch = lambda rows, seconds: sizes.append(rows)

    async def loop(key: str, delay: float):
        await asyncio.sleep(delay)
        for r in range(rounds):
            await batcher.submit(key, r, 1)
            await asyncio.sleep(away_s)
        batcher.forget(key)

    async def main():
        await asyncio.gather(*(loop(f"r{i}", 0.0 if i < 4 else 0.01) for i in range(8)))

    asyncio.run(main())
    return sizes


def test_requests_out_of_step_merge_into_one_batch_instead_of_alternating():
    apart = _closed_loops(BatchingConfig(max_wait_ms=0))
    assert apart == [4] * 12  # without waiting: two half batches alternate for good
    together = _closed_loops(BatchingConfig(max_wait_ms=20))
    # The first half's next call waits for the second half's: one batch of 8 per round, 7 forward passes instead
    # of 12 (the first and the last run a half alone).
    assert together == [4] + [8] * 5 + [4]


def test_requests_back_from_a_draft_call_are_waited_for_when_they_are_expected_within_a_forward_pass():
    # Each request spends 30 ms away between rounds (a draft call) against a 50 ms forward: measured, so the first
    # half waits for the second. Without waiting they alternate for good.
    assert _closed_loops(BatchingConfig(max_wait_ms=0), away_s=0.03) == [4] * 12
    together = _closed_loops(BatchingConfig(max_wait_ms=50), away_s=0.03)
    assert together[1:-1] == [8] * (len(together) - 2) and sum(together) == 48


def test_a_call_does_not_wait_for_requests_not_expected_back_within_a_forward_pass():
    """A draft worker: request a comes back only after its verify (600 ms away); b's call lands in the middle of each
    of a's 100 ms drafts. a's measured return time says it is not coming soon, so b's call runs as soon as a's batch
    ends instead of waiting for a (which would add up to 50 ms)."""
    b_latencies: list[float] = []

    def run(items):
        time.sleep(0.1)
        return list(items)

    async def main():
        batcher = Batcher(ThreadPoolExecutor(1), run, BatchingConfig(max_wait_ms=50))
        a_sent = asyncio.Event()

        async def a():
            for r in range(5):
                a_sent.set()
                await batcher.submit("a", r, 1)
                await asyncio.sleep(0.6)

        async def b():
            for r in range(5):
                await a_sent.wait()
                a_sent.clear()
                await asyncio.sleep(0.05)
                t0 = time.perf_counter()
                await batcher.submit("b", r, 1)
                b_latencies.append(time.perf_counter() - t0)

        await asyncio.gather(a(), b())

    asyncio.run(main())
    # From a's third call on its return time is measured: b waits out a's batch (50 ms) and runs its own (100 ms).
    assert max(b_latencies[2:]) < 0.18, b_latencies


def test_a_prefill_does_not_join_decoding_rows_it_would_pad_but_short_rows_mix():
    async def main():
        gate = threading.Event()
        batcher, seen = _batcher(BatchingConfig(max_batch_size=32), gate)
        blocker = asyncio.ensure_future(batcher.submit("x", 0, 1))
        await asyncio.sleep(0.05)
        decoding = [asyncio.ensure_future(batcher.submit(f"d{i}", i, 5)) for i in range(1, 16)]  # k=4 verifies
        prefill = asyncio.ensure_future(batcher.submit("p", 100, 90))  # a new request's prompt
        plain = [asyncio.ensure_future(batcher.submit(f"s{i}", 200 + i, 1)) for i in range(4)]  # no drafts
        await asyncio.sleep(0.05)
        gate.set()
        await asyncio.gather(blocker, prefill, *decoding, *plain)
        return seen

    seen = asyncio.run(main())
    # Padded to 90 positions, the prefill would have made the decoding rows' pass compute 20 x 90 positions for 169
    # real ones; it runs on its own, and rows of 1 and 5 positions (little padding) share a pass.
    assert seen == [[0], list(range(1, 16)) + [200, 201, 202, 203], [100]]


def test_a_padded_workers_deep_request_drafts_apart_from_short_ones_which_mix():
    def calls(batcher):
        chats = [batcher.submit(f"c{i}", i, 5, context=40 + 30 * i) for i in range(1, 5)]
        deep = batcher.submit("long", 100, 5, context=4000)  # deep in a long prompt
        return [*chats, deep, batcher.submit("c5", 5, 5, context=600)]  # c5: within 512 a row of the chats'

    # Beside the deep request, every chat row would attend over 4,000 padded entries: 6 x 4,000 for 5,100 real ones.
    assert _batches_behind_a_pass(BatchingConfig(max_batch_size=32), calls) == [[0], [1, 2, 3, 4, 5], [100]]


def test_a_packed_workers_rows_mix_whatever_they_hold():
    def calls(batcher):
        return [batcher.submit("r1", 1, 5, context=50), batcher.submit("r2", 2, 5, context=4000)]

    assert _batches_behind_a_pass(BatchingConfig(), calls, pads_rows=False) == [[0], [1, 2]]


def test_a_run_that_raises_fails_its_rows_is_logged_and_the_next_batch_still_runs(caplog):
    calls = []

    def run(items):
        calls.append(list(items))
        if len(calls) == 1:
            raise RuntimeError("forward pass broke")
        return [x * 2 for x in items]

    async def main():
        batcher = Batcher(ThreadPoolExecutor(1), run, BatchingConfig(max_wait_ms=0))
        failed = await asyncio.gather(batcher.submit("a", 1, 1), return_exceptions=True)
        return failed, await batcher.submit("b", 2, 1)

    with caplog.at_level("ERROR", logger="specserve.workers.service.batcher"):
        failed, ok = asyncio.run(main())
    assert isinstance(failed[0], RuntimeError) and ok == 4
    assert [r.exc_info[0] for r in caplog.records] == [RuntimeError]


def test_a_cancelled_drainer_cancels_its_waiting_calls_instead_of_stranding_them():
    gate = threading.Event()

    async def main():
        batcher, _ = _batcher(BatchingConfig(max_batch_size=1), gate)
        running = asyncio.ensure_future(batcher.submit("a", 1, 1))
        queued = asyncio.ensure_future(batcher.submit("b", 2, 1))
        await asyncio.sleep(0.05)
        batcher._drainer.cancel()  # what the loop's shutdown does to it
        results = await asyncio.wait_for(asyncio.gather(running, queued, return_exceptions=True), 5)
        gate.set()
        return results, batcher.queued

    results, queued = asyncio.run(main())
    assert all(isinstance(r, asyncio.CancelledError) for r in results) and queued == 0


def test_each_result_carries_how_long_its_call_queued_for_its_batch():
    """The round accounting's queue share: a call that arrived while another batch ran waited that batch's run; the
    first call, which found the worker idle, waited nothing to speak of."""
    from specserve.workers.service.results import VerifyResult

    async def main():
        gate = threading.Event()

        def run(items):
            gate.wait(5)
            return [VerifyResult(accepted=0, next_token=x) for x in items]

        batcher = Batcher(ThreadPoolExecutor(1), run, BatchingConfig(max_wait_ms=0))
        first = asyncio.ensure_future(batcher.submit("a", 1, 1))
        await asyncio.sleep(0.02)
        second = asyncio.ensure_future(batcher.submit("b", 2, 1))
        await asyncio.sleep(0.2)  # b queues behind a's batch, which the gate holds
        gate.set()
        return await first, await second

    first, second = asyncio.run(main())
    assert (first.next_token, second.next_token) == (1, 2)
    assert first.queued_seconds < 0.05
    assert 0.15 <= second.queued_seconds < 2.0


def test_a_packed_workers_batch_takes_a_prefill_beside_decoding_rows():
    """A target worker's pass is packed (runtime/ragged.py): a prompt's 90 positions cost 90 columns beside the
    decoding rows, not 20 rows padded to 90, so it joins their batch."""

    async def main():
        gate = threading.Event()
        seen = []

        def run(items):
            gate.wait(5)
            seen.append(list(items))
            return list(items)

        batcher = Batcher(ThreadPoolExecutor(1), run, BatchingConfig(max_batch_size=32), pads_rows=False)
        blocker = asyncio.ensure_future(batcher.submit("x", 0, 1))
        await asyncio.sleep(0.05)
        decoding = [asyncio.ensure_future(batcher.submit(f"d{i}", i, 5)) for i in range(1, 16)]
        prefill = asyncio.ensure_future(batcher.submit("p", 100, 90))
        plain = [asyncio.ensure_future(batcher.submit(f"s{i}", 200 + i, 1)) for i in range(4)]
        await asyncio.sleep(0.05)
        gate.set()
        await asyncio.gather(blocker, prefill, *decoding, *plain)
        return seen

    assert asyncio.run(main()) == [[0], list(range(1, 16)) + [100, 200, 201, 202, 203]]


def _chunks_beside_streams(config, prefill: bool) -> list[list[str]]:
    """A long prompt's chunks (each sent 2 ms after the last one's answer) beside four decoding streams that spend
    30 ms drafting between rounds, against a 100 ms forward. Returns each batch's keys."""
    seen: list[list[str]] = []

    def run(items):
        time.sleep(0.1)
        seen.append(sorted(key for key, _ in items))
        return list(items)

    batcher = Batcher(ThreadPoolExecutor(1), run, config, pads_rows=False)

    async def stream(key: str):
        for r in range(8):
            await batcher.submit(key, (key, r), 5)
            await asyncio.sleep(0.03)
        batcher.forget(key)

    async def chunks():
        await asyncio.sleep(0.11)  # the streams are under way: each chunk starts out of step with them
        for c in range(6):
            await batcher.submit("long", ("long", c), 64, prefill=prefill)
            await asyncio.sleep(0.002)
        batcher.forget("long")

    async def main():
        await asyncio.gather(chunks(), *(stream(f"s{i}") for i in range(4)))

    asyncio.run(main())
    return seen


def test_a_prompts_chunk_waits_for_the_decoding_rows_coming_back_so_they_share_its_pass():
    config = BatchingConfig(max_wait_ms=10, prefill_wait_ms=150)
    alone = [b for b in _chunks_beside_streams(config, prefill=False) if "long" in b]
    # Not marked as a prefill, a chunk waits 10 ms at most: the streams (30 ms away) miss every other chunk, which
    # runs alone while they wait.
    assert sum(b == ["long"] for b in alone) >= len(alone) // 2, alone
    shared = [b for b in _chunks_beside_streams(config, prefill=True) if "long" in b]
    # Marked, it waits for the streams expected back within 150 ms (at most a forward): after the first, every chunk
    # carries their rows.
    assert all(len(b) == 5 for b in shared[1:]), shared


def test_a_padded_workers_decoding_rows_go_before_a_prefill_that_came_first_and_it_runs_next():
    async def main():
        gate = threading.Event()
        batcher, seen = _batcher(BatchingConfig(max_batch_size=32, prefill_wait_ms=0), gate)
        blocker = asyncio.ensure_future(batcher.submit("x", 0, 1))
        await asyncio.sleep(0.05)
        feed = asyncio.ensure_future(batcher.submit("p", 100, 90, prefill=True))  # a chunk fed to a head
        decoding = [asyncio.ensure_future(batcher.submit(f"d{i}", i, 5)) for i in range(1, 5)]
        await asyncio.sleep(0.05)
        gate.set()
        await asyncio.gather(blocker, feed, *decoding)
        return seen

    # The drafts would otherwise wait out the feed's pass; the feed, passed over once, is next.
    assert asyncio.run(main()) == [[0], [1, 2, 3, 4], [100]]


def test_a_padded_workers_fed_chunk_runs_after_the_drafts_even_where_its_padding_would_fit():
    """A chunk's 40 positions beside drafts of 30 would pad little, but every draft would take the chunk's width
    while the target waits for the drafts (served: a 36 ms draft batch where the drafts alone took 12 ms)."""

    async def main():
        gate = threading.Event()
        batcher, seen = _batcher(BatchingConfig(max_batch_size=32, prefill_wait_ms=0), gate)
        blocker = asyncio.ensure_future(batcher.submit("x", 0, 1))
        await asyncio.sleep(0.05)
        feed = asyncio.ensure_future(batcher.submit("p", 100, 40, prefill=True))
        decoding = [asyncio.ensure_future(batcher.submit(f"d{i}", i, 30)) for i in range(1, 3)]
        await asyncio.sleep(0.05)
        gate.set()
        await asyncio.gather(blocker, feed, *decoding)
        return seen

    assert asyncio.run(main()) == [[0], [1, 2], [100]]
