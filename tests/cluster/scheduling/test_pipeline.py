"""The scheduler and its pipelined driver over real gRPC workers: lossless outputs with concurrent requests,
within-request pipelining, lost caches, evictions and dead workers."""

import asyncio

import pytest

from specserve.cluster.scheduling.pipeline import Pipeline
from specserve.cluster.scheduling.scheduler import Scheduler
from specserve.cluster.scheduling.worker_clients import DraftClient, TargetClient
from specserve.workers.config.request import SamplingParams, SpecParams
from specserve.workers.config.settings import ModelConfig
from specserve.workers.runtime.loading import load_model
from specserve.workers.speculation.engine import SpecEngine
from tests.helpers.pipelines import run_pipeline
from tests.helpers.workers import LocalWorkers, save_perturbed_copy

PROMPTS = [
    "def add(a, b):\n    return",
    "class Stack:\n    def push(self, x):",
    "for i in range(3):",
    "import json\n\ndata = json.loads(",
]


@pytest.fixture(scope="module")
def models(models_dir, tiny_target, device):
    draft_path = save_perturbed_copy(tiny_target, models_dir / "pipeline_draft", 0.05, seed=9)
    return load_model(ModelConfig(path=tiny_target, device=device)), load_model(
        ModelConfig(path=draft_path, device=device)
    )


@pytest.fixture(scope="module")
def reference(models):
    engine = SpecEngine(models[0])
    params, spec = SamplingParams(max_new_tokens=20), SpecParams(method="none")
    return {p: engine.generate(p, params, spec).token_ids for p in PROMPTS}


def greedy(method="draft", k=4):
    return SamplingParams(max_new_tokens=20), SpecParams(method=method, k=k)


@pytest.mark.parametrize("method", ["draft", "ngram", "suffix"])
def test_eight_concurrent_greedy_requests_identical_to_target_only(models, reference, method):
    async def main():
        async with LocalWorkers(models[0], [models[1]], n_targets=2) as w:
            requests = [(p, *greedy(method, k)) for p in PROMPTS for k in (2, 4)]
            results, _ = await run_pipeline(w, requests)
            used = {t: len(x.committed) for t, x in w.targets.items()}
            return requests, results, used, w

    requests, results, used, w = asyncio.run(main())
    assert [r.state.generated for r in results] == [reference[p] for p, _, _ in requests]
    assert len({r.target_worker for r in results}) == 2  # spread over both target workers
    assert all(n == 0 for n in used.values())  # every request released on every worker
    if method == "draft":
        assert sum(r.state.stats.accepted for r in results) > 0


def test_within_request_pipelining_changes_nothing_and_is_used(models, reference):
    async def main(predraft):
        async with LocalWorkers(models[0], [models[1]]) as w:
            results, pipeline = await run_pipeline(w, [(p, *greedy(k=3)) for p in PROMPTS], predraft=predraft)
            return results, pipeline

    with_pre, pipeline = asyncio.run(main(True))
    without, _ = asyncio.run(main(False))
    assert [r.state.generated for r in with_pre] == [r.state.generated for r in without] == list(reference.values())
    assert sum(r.pipelined_rounds for r in with_pre) > 0  # rounds whose draft was ready when verification ended
    assert sum(r.pipelined_rounds for r in without) == 0
    assert sum(r.state.stats.rounds for r in with_pre) == sum(r.state.stats.rounds for r in without)
    assert pipeline.times.rounds > 0 and pipeline.times.orchestration_s > 0
    # Every round is accounted for: the workers' compute and queues as they reported them, the hops, the rest.
    sums = pipeline.times.summary()["sum_s"]
    assert sums["verify_work"] > 0 and sums["draft_work"] > 0 and sums["verify_hop"] > 0
    split = ("plan", "draft_queue", "draft_work", "draft_hop", "verify_queue", "verify_work", "verify_hop", "stream")
    assert sum(sums[p] for p in split) == pytest.approx(sums["total"], rel=0.05)  # hops clipped at 0 aside


def test_seeded_sampling_matches_in_process_engine_with_and_without_pipelining(models):
    params = SamplingParams(max_new_tokens=16, temperature=0.9, top_p=0.95, seed=42)
    expected = SpecEngine(*models).generate(PROMPTS[0], params, SpecParams(k=3))

    async def main(predraft):
        async with LocalWorkers(models[0], [models[1]]) as w:
            (result,), _ = await run_pipeline(w, [(PROMPTS[0], params, SpecParams(k=3))], predraft=predraft)
            return result

    for predraft in (False, True):
        result = asyncio.run(main(predraft))
        assert result.state.generated == expected.token_ids
        assert result.state.stats.accepted == expected.stats.accepted


def test_lost_caches_are_re_sent_and_output_unchanged(models, reference):
    async def main():
        async with LocalWorkers(models[0], [models[1]]) as w:

            async def forget(pipeline):
                # Workers lose every request's cache a few times mid-generation (as after an eviction or restart),
                # through the workers' own Release RPC so the scheduler is not told.
                for _ in range(6):
                    await asyncio.sleep(0.02)
                    for name, client in (*pipeline.drafts.items(), *pipeline.targets.items()):
                        worker = w.drafts.get(name) or w.targets.get(name)
                        for rid in worker.committed.least_recent():
                            await client.release(rid)

            return await run_pipeline(w, [(p, *greedy()) for p in PROMPTS], during=forget)

    results, _ = asyncio.run(main())
    assert [r.state.generated for r in results] == list(reference.values())
    assert sum(r.resent for r in results) >= 1


def test_full_kv_cache_evicts_idle_requests_without_losing_any(models, reference):
    async def main():
        async with LocalWorkers(models[0], [models[1]], target_capacity=60) as w:
            return await run_pipeline(w, [(p, *greedy(k=2)) for p in PROMPTS])

    results, _ = asyncio.run(main())
    assert [r.state.generated for r in results] == list(reference.values())
    assert sum(r.resent for r in results) >= 1


def test_dead_workers_requests_finish_elsewhere_with_identical_output(models, reference):
    """A draft worker dies: its requests fall back to target-only decoding, then re-attach to the other draft
    worker. A target worker dies: its requests re-prefill on the other one. Nothing is lost or changed."""

    async def main():
        async with LocalWorkers(models[0], [models[1], models[1]], n_targets=2) as w:

            async def kill(pipeline):
                await asyncio.sleep(0.05)
                await w.stop("draft-0")
                await asyncio.sleep(0.05)
                await w.stop("target-1")

            results, pipeline = await run_pipeline(w, [(p, *greedy()) for p in PROMPTS * 2], during=kill)
            return results, pipeline.scheduler.unhealthy

    results, unhealthy = asyncio.run(main())
    assert [r.state.generated for r in results] == list(reference.values()) * 2
    assert unhealthy == {"draft-0", "target-1"}
    assert {r.target_worker for r in results} == {"target-0"}


def test_restarted_workers_are_reconnected_with_identical_output(models, reference):
    """Both workers die mid-generation and come back as fresh processes at new addresses (as Ray restarts actors):
    the scheduler reconnects, re-sends every request's prefix, and nothing changes."""

    async def main():
        async with LocalWorkers(models[0], [models[1]]) as w, LocalWorkers(models[0], [models[1]]) as fresh:

            async def reconnect(name):
                return fresh.addresses[name]

            async def kill(pipeline):
                await asyncio.sleep(0.05)
                await w.stop("target-0")
                await w.stop("draft-0")

            results, pipeline = await run_pipeline(
                w, [(p, *greedy()) for p in PROMPTS], during=kill, reconnect=reconnect
            )
            served = {name: len(worker.committed) for name, worker in {**fresh.drafts, **fresh.targets}.items()}
            return results, pipeline, served

    results, pipeline, served = asyncio.run(main())
    assert [r.state.generated for r in results] == list(reference.values())
    assert pipeline.faults.restarts == 2 and not pipeline.scheduler.unhealthy
    assert served == {"draft-0": 0, "target-0": 0}  # the replacements served the rest, then released everything


def test_suffix_drafting_reuses_a_finished_answer_for_the_next_request(models, reference):
    """The scheduler's model cache holds each finished "suffix" request's output: asked again, the second pass drafts
    the first answer and accepts it, identical to target-only either way."""

    async def main():
        async with LocalWorkers(models[0], [models[1]]) as w:
            drafts = {n: DraftClient(a, timeout_s=30) for n, a in w.draft_addresses.items()}
            targets = {n: TargetClient(a, timeout_s=30) for n, a in w.target_addresses.items()}
            pipeline = Pipeline(Scheduler(list(drafts), list(targets)), drafts, targets)
            tokenizer = next(iter(w.targets.values())).verifier.runner.loaded.tokenizer
            eos, ids = frozenset({tokenizer.eos_token_id}), tokenizer(PROMPTS[0])["input_ids"]
            passes = [await pipeline.generate(ids, *greedy("suffix", "auto"), eos) for _ in range(2)]
            await pipeline.drain_releases()
            for client in (*drafts.values(), *targets.values()):
                await client.close()
            return passes, len(pipeline.scheduler.suffix_cache)

    (first, second), cached = asyncio.run(main())
    assert first.state.generated == second.state.generated == reference[PROMPTS[0]]
    assert cached == 2  # each finished request's output
    assert second.state.stats.accepted >= len(reference[PROMPTS[0]]) - 4 > first.state.stats.accepted


class CountingDecodes:
    """Counts the Decode streams the pipeline's target clients open (the clients themselves unchanged)."""

    def __init__(self, monkeypatch):
        self.streams = 0
        decode = TargetClient.decode

        def counted(client, *args):
            self.streams += 1
            return decode(client, *args)

        monkeypatch.setattr(TargetClient, "decode", counted)


@pytest.mark.parametrize("decode_steps", [1, 8])
def test_requests_that_never_draft_stream_their_steps_with_identical_output(models, reference, monkeypatch,
                                                                             decode_steps):  # fmt: skip
    """Speculation off: up to decode_steps plain steps a Decode call, each applied as its round; a worker that loses
    the requests mid-stream gets them re-sent; the output is target-only's either way."""
    counted = CountingDecodes(monkeypatch)

    async def main():
        async with LocalWorkers(models[0], [models[1]], n_targets=2) as w:

            async def forget(pipeline):
                for _ in range(4):
                    await asyncio.sleep(0.03)
                    for name, client in pipeline.targets.items():
                        for rid in w.targets[name].committed.least_recent():
                            await client.release(rid)

            requests = [(p, *greedy("none", 1)) for p in PROMPTS * 2]
            return await run_pipeline(w, requests, during=forget, decode_steps=decode_steps)

    results, pipeline = asyncio.run(main())
    assert [r.state.generated for r in results] == list(reference.values()) * 2
    assert all(r.state.stats.rounds == len(r.state.generated) for r in results)  # a round a step, as one call each
    assert pipeline.times.rounds == sum(r.state.stats.rounds for r in results)
    if decode_steps == 1:
        assert counted.streams == 0
    else:  # a stream from each request's first step, and again after each loss
        assert len(results) <= counted.streams < sum(len(r.state.generated) for r in results) // 2
        assert sum(r.resent for r in results) >= 1


def test_a_target_that_dies_mid_stream_leaves_its_requests_to_the_other(models, reference):
    async def main():
        async with LocalWorkers(models[0], [models[1]], n_targets=2) as w:

            async def kill(pipeline):
                await asyncio.sleep(0.05)
                await w.stop("target-1")

            requests = [(p, *greedy("none", 1)) for p in PROMPTS * 2]
            results, pipeline = await run_pipeline(w, requests, during=kill, decode_steps=16)
            return results, pipeline.scheduler.unhealthy

    results, unhealthy = asyncio.run(main())
    assert [r.state.generated for r in results] == list(reference.values()) * 2
    assert unhealthy == {"target-1"} and {r.target_worker for r in results} == {"target-0"}
