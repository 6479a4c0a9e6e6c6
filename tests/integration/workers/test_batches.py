"""A worker's batch entry points alone: each row gets its own result or its own error, and a batch that cannot fit
in the KV cache falls back to rows one at a time instead of failing them all."""

import pytest
import torch

from specserve.workers.config.request import SamplingParams
from specserve.workers.config.settings import KVCacheConfig, ModelConfig
from specserve.workers.errors import InvalidRequestError, RequestNotFoundError
from specserve.workers.runtime.loading import load_model
from specserve.workers.runtime.runner import ModelRunner
from specserve.workers.service.draft_worker import DraftWorker, ProposeCall
from specserve.workers.service.target_worker import TargetWorker, VerifyCall
from specserve.workers.speculation.codec import decode_probs
from specserve.workers.speculation.draft_model import ModelDrafter
from specserve.workers.speculation.target import TargetVerifier

GREEDY = SamplingParams(max_new_tokens=8)


@pytest.fixture(scope="module")
def target(tiny_target, device):
    return load_model(ModelConfig(path=tiny_target, device=device))


def _worker(target, capacity=100_000):
    return TargetWorker(TargetVerifier(ModelRunner(target, KVCacheConfig(capacity_tokens=capacity))), "t")


def test_verify_batch_rows_fail_alone(target):
    worker = _worker(target)
    calls = [
        VerifyCall("ok", 5, [3, 4, 5, 6, 7], [8, 9], None, GREEDY),
        VerifyCall("lost", 9, [4], [], None, GREEDY),  # the worker never saw the first 8 tokens
        VerifyCall("bad", 2, [3, 10**6], [], None, GREEDY),
    ]
    ok, lost, bad = worker.verify_batch(calls)
    assert isinstance(lost, RequestNotFoundError) and isinstance(bad, InvalidRequestError)
    alone = _worker(target).verify("ok", 5, [3, 4, 5, 6, 7], [8, 9], None, GREEDY)
    assert (ok.accepted, ok.next_token) == (alone.accepted, alone.next_token)
    assert ok.batch_rows == 1 and ok.batch_tokens == 5 + 2


def test_a_batch_too_big_for_the_cache_runs_row_by_row(target):
    worker = _worker(target, capacity=30)
    calls = [VerifyCall(f"r{i}", 12, list(range(3 + i, 15 + i)), [], None, GREEDY) for i in range(3)]  # 36 > 30
    results = worker.verify_batch(calls)
    assert all(not isinstance(r, Exception) for r in results)
    for i, result in enumerate(results):
        alone = _worker(target).verify(f"r{i}", 12, list(range(3 + i, 15 + i)), [], None, GREEDY)
        assert (result.accepted, result.next_token) == (alone.accepted, alone.next_token)
    assert worker.verifier.runner.store.used_tokens <= 30


def test_propose_batch_drafts_what_each_row_drafts_alone(target):
    def drafter():
        runner = ModelRunner(target, KVCacheConfig())
        return DraftWorker(ModelDrafter(runner), target.vocab_size, "d", runner.store)

    sampled = SamplingParams(temperature=1.0, seed=7, max_new_tokens=8)
    calls = [
        ProposeCall("a", 3, [3, 4, 5], 4, GREEDY),
        ProposeCall("b", 9, list(range(20, 29)), 1, sampled),
        ProposeCall("c", 6, list(range(40, 46)), 6, sampled),
    ]
    batched = drafter().propose_batch(calls)
    for call, got in zip(calls, batched, strict=True):
        alone = drafter().propose(call.request_id, call.committed_len, call.new_tokens, call.k, call.params)
        assert got.drafted == alone.drafted and len(got.drafted) == call.k
        # Batched kernels may round differently in the last bit; float16 probs then differ by at most one ulp.
        if call.params.greedy:
            assert got.draft_probs == alone.draft_probs == b""
        else:
            a, b = decode_probs(got.draft_probs, target.vocab_size), decode_probs(alone.draft_probs, target.vocab_size)
            assert torch.allclose(a.float(), b.float(), rtol=2e-3, atol=1e-7)


def test_a_fed_row_caches_its_tokens_beside_drafting_rows_and_drafts_nothing(target):
    """k = 0 (a prompt's chunk fed ahead of its first draft): the row's tokens are cached in the drafting rows' first
    pass, nothing is drafted for it, the other rows draft as alone, and its next call computes only what is new."""
    runner = ModelRunner(target, KVCacheConfig())
    worker = DraftWorker(ModelDrafter(runner), target.vocab_size, "d", runner.store)
    chunk = list(range(10, 42))
    fed, drafting = worker.propose_batch([ProposeCall("long", 32, chunk, 0, GREEDY),
                                          ProposeCall("a", 3, [3, 4, 5], 4, GREEDY)])  # fmt: skip
    alone = DraftWorker(ModelDrafter(ModelRunner(target, KVCacheConfig())), target.vocab_size, "d")
    assert fed.drafted == [] and drafting.drafted == alone.propose("a", 3, [3, 4, 5], 4, GREEDY).drafted
    assert runner.store.get("long").length == 32
    before = runner.forward_positions
    later = worker.propose("long", 35, [42, 43, 44], 2, GREEDY)
    assert runner.forward_positions - before == 3 + 1  # the new tokens, then the second drafted token's step
    whole = DraftWorker(ModelDrafter(ModelRunner(target, KVCacheConfig())), target.vocab_size, "d")
    assert later.drafted == whole.propose("long", 35, chunk + [42, 43, 44], 2, GREEDY).drafted


def test_a_row_evicted_by_an_earlier_row_is_re_sent_not_orphaned(target):
    worker = _worker(target, capacity=40)
    for rid, base in (("r1", 20), ("r2", 40)):
        worker.verify(rid, 15, list(range(base, base + 15)), [], None, GREEDY)  # 15 cached positions each
    calls = [
        VerifyCall("r0", 15, list(range(60, 75)), [], None, GREEDY),
        VerifyCall("r1", 16, [99], [], None, GREEDY),
        VerifyCall("r2", 16, [98], [], None, GREEDY),
    ]
    results = worker.verify_batch(calls)  # 47 positions > 40: rows run one by one and r0 evicts r1
    assert not isinstance(results[0], Exception) and isinstance(results[1], RequestNotFoundError)
    store = worker.verifier.runner.store
    # Every cached position belongs to a request the worker still knows: nothing the scheduler cannot release.
    assert all(rid in worker.committed for rid in ("r0", "r2")) and "r1" not in store
    assert store.used_tokens <= 40
