"""Prefill chunks sized by time while other requests decode on the worker (chunk_pacing.py): alone a prompt takes the
setting's chunk; beside decoding requests a chunk costs about CHUNK_SHARE of their verify batch, by the costs the
worker's replies show, within [MIN_CHUNK_TOKENS, the setting]."""

from specserve.cluster.scheduling.chunk_pacing import CHUNK_SHARE, MIN_CHUNK_TOKENS, ChunkPacer
from specserve.cluster.scheduling.scheduler import Scheduler
from specserve.workers.config.request import SamplingParams, SpecParams
from specserve.workers.service.results import VerifyResult

SPEC = SpecParams(method="ngram", k=3)


def test_alone_or_unmeasured_a_chunk_is_the_setting():
    pacer = ChunkPacer(256)
    assert pacer.tokens("t1", others_decoding=False) == 256
    assert pacer.tokens("t1", others_decoding=True) == 256  # nothing measured: no batch to weigh against
    pacer.round_ran("t1", rows=4, positions=16, seconds=0.1)
    assert pacer.tokens("t1", others_decoding=False) == 256
    assert pacer.tokens("t1", others_decoding=True) == 64  # a round measured, no chunk yet: a quarter, to measure one


def test_beside_decoding_requests_a_chunk_costs_about_its_share_of_their_batch():
    pacer = ChunkPacer(256)
    pacer.round_ran("t1", rows=4, positions=16, seconds=0.1)
    pacer.chunk_ran("t1", positions=64, seconds=0.32)  # 5 ms a position
    assert pacer.tokens("t1", others_decoding=True) == int(CHUNK_SHARE * 0.1 / 0.005)
    pacer.chunk_ran("t1", positions=40, seconds=0.4)  # deeper in the prompt: 10 ms a position, the mean follows
    assert pacer.tokens("t1", others_decoding=True) < int(CHUNK_SHARE * 0.1 / 0.005)
    assert pacer.tokens("t2", others_decoding=True) == 256  # another worker measured nothing


def test_a_chunk_stays_within_its_bounds_and_a_batch_that_held_a_chunk_is_not_a_round():
    pacer = ChunkPacer(256)
    pacer.round_ran("t1", rows=1, positions=4, seconds=0.001)
    pacer.chunk_ran("t1", positions=100, seconds=1.0)
    assert pacer.tokens("t1", others_decoding=True) == MIN_CHUNK_TOKENS
    pacer.round_ran("t1", rows=2, positions=300, seconds=5.0)  # a chunk's batch: ignored
    assert pacer.tokens("t1", others_decoding=True) == MIN_CHUNK_TOKENS
    pacer.round_ran("t1", rows=4, positions=20, seconds=100.0)
    assert pacer.tokens("t1", others_decoding=True) == 256
    pacer.forget("t1")
    assert pacer.tokens("t1", others_decoding=True) == 256


def _reply(rows: int, tokens: int, seconds: float) -> VerifyResult:
    return VerifyResult(accepted=0, next_token=5, batch_rows=rows, batch_tokens=tokens, batch_seconds=seconds)


def test_the_scheduler_shrinks_a_chunk_while_another_request_decodes_on_its_worker():
    s = Scheduler([], ["t1"], prefill_chunk=64)
    chat = s.add(list(range(3, 13)), SamplingParams(max_new_tokens=8), SPEC, frozenset())
    long = s.add(list(range(3, 503)), SamplingParams(max_new_tokens=4), SPEC, frozenset())
    first = s.plan_prefill_chunk(long)
    assert len(first.new_tokens) == 64  # chat has not decoded yet: the whole setting
    s.prefilled(long, first, _reply(1, 64, 0.64))  # 10 ms a position
    call = s.plan_verify(chat, [], b"")
    s.verified(call.worker, _reply(1, 10, 0.2))
    s.apply_verify(chat, [], 0, 7, b"")
    second = s.plan_prefill_chunk(long)
    assert second.committed_len == 64 + int(CHUNK_SHARE * 0.2 / 0.01)  # chat decodes there now: 40 tokens
    s.release(chat)
    assert len(s.plan_prefill_chunk(long).new_tokens) == 64
