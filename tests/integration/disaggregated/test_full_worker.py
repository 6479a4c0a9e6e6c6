"""A full KV cache is never a 500 and never a lost request (real gRPC workers): a request that cannot fit a target
worker even alone is refused naming `prompt` and the capacity (400 / INVALID_ARGUMENT at the edge); a call that a
worker answers RESOURCE_EXHAUSTED (its running batch outgrew its cache) is preempted: its state there released, it
waits and is re-sent whole, and decodes exactly what target-only decoding does."""

import asyncio

import pytest

from specserve.workers.config.request import SamplingParams, SpecParams
from specserve.workers.config.settings import ModelConfig
from specserve.workers.errors import InvalidRequestError, KVCapacityError
from specserve.workers.runtime.loading import load_model
from specserve.workers.speculation.engine import SpecEngine
from tests.helpers.pipelines import run_pipeline
from tests.helpers.workers import LocalWorkers

PROMPT = "def add(a, b):\n    return a + b\n\nclass Stack:\n    def push(self, x):"
N = 20


@pytest.fixture(scope="module")
def target(tiny_target, device):
    return load_model(ModelConfig(path=tiny_target, device=device))


def test_a_request_that_cannot_fit_even_alone_is_refused_naming_the_limit(target):
    async def main():
        async with LocalWorkers(target, [], target_capacity=40) as w:
            await run_pipeline(w, [(PROMPT, SamplingParams(max_new_tokens=N), SpecParams(method="ngram", k=3))])

    with pytest.raises(InvalidRequestError, match=r"needs \d+ KV cache positions, more than a target worker holds "
                       r"\(40, kv_cache.capacity_tokens\)") as e:  # fmt: skip
        asyncio.run(main())
    assert e.value.field == "prompt"


def test_a_call_a_full_worker_refuses_waits_and_is_re_sent_whole(target):
    reference = SpecEngine(target).generate(PROMPT, SamplingParams(max_new_tokens=N), SpecParams(method="none"))
    refused = []

    async def main():
        async with LocalWorkers(target, []) as w:
            worker = w.targets["target-0"]
            verify_batch = worker.verify_batch

            def full_twice(calls):  # the worker's cache is full for the request's second and third calls
                results = verify_batch(calls)
                if worker.verifier.runner.forward_calls in (2, 3):
                    refused.append(calls[0].request_id)
                    worker.release(calls[0].request_id)
                    return [KVCapacityError("KV cache capacity exceeded (a test's full worker)")]
                return results

            worker.verify_batch = full_twice
            return await run_pipeline(w, [(PROMPT, SamplingParams(max_new_tokens=N), SpecParams(method="ngram", k=3))])

    (result,), pipeline = asyncio.run(main())
    assert len(refused) == 2 and pipeline.preempted == 1 and not pipeline.scheduler.unhealthy
    assert result.state.generated == reference.token_ids and result.resent >= 2


def test_a_worker_full_past_worker_wait_s_is_a_capacity_error_not_a_crash(target):
    async def main():
        async with LocalWorkers(target, []) as w:
            worker = w.targets["target-0"]
            worker.verify_batch = lambda calls: [KVCapacityError("KV cache capacity exceeded (always)")] * len(calls)
            await run_pipeline(w, [(PROMPT, SamplingParams(max_new_tokens=N), SpecParams(method="ngram", k=3))],
                               worker_wait_s=0.3)  # fmt: skip

    with pytest.raises(KVCapacityError, match="no KV cache room for request .* in 0 s"):
        asyncio.run(main())


def test_a_budget_below_what_the_running_requests_need_answers_every_one_identically(target):
    """A real budget, no fault injected: the KV buffers of six requests at once would outgrow the target's capacity
    (slots x the longest row), so idle requests are evicted and calls refused RESOURCE_EXHAUSTED are preempted, each
    re-sent whole, and every request still decodes what target-only decoding does."""
    prompts = [f"# task {i}\n" + PROMPT[: 20 + 7 * i] for i in range(6)]
    reference = [SpecEngine(target).generate(p, SamplingParams(max_new_tokens=N), SpecParams(method="none")).token_ids
                 for p in prompts]  # fmt: skip
    longest = max(len(target.tokenizer(p)["input_ids"]) for p in prompts) + N + 4

    async def main():
        async with LocalWorkers(target, [], target_capacity=3 * longest) as w:
            return await run_pipeline(w, [(p, SamplingParams(max_new_tokens=N), SpecParams(method="ngram", k=3))
                                          for p in prompts])  # fmt: skip

    results, pipeline = asyncio.run(main())
    assert [r.state.generated for r in results] == reference
    # requests were evicted (idle between rounds) or preempted (in a running batch), and recomputed
    assert sum(r.resent for r in results) + pipeline.preempted > 0 and not pipeline.scheduler.unhealthy
