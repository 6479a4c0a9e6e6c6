"""Continuous batching through the real gRPC workers: 16 concurrent requests of different prompt lengths, k, drafting
methods and sampling settings share forward passes on the draft and target workers, and every output is still
exactly what that request gets alone."""

import asyncio

import pytest

from specserve.workers.config.request import SamplingParams, SpecParams
from specserve.workers.config.settings import BatchingConfig, ModelConfig
from specserve.workers.runtime.loading import load_model
from specserve.workers.speculation.engine import SpecEngine
from tests.helpers.pipelines import run_pipeline
from tests.helpers.workers import LocalWorkers, save_perturbed_copy

BASE = "def parse(line):\n    key, value = line.split('=')\n    return key.strip(), value.strip()\n"
PROMPTS = [BASE[: 8 + 9 * i] for i in range(8)]  # 8 to 71 characters
KS = [1, 2, 3, 4, 6, "auto"]


@pytest.fixture(scope="module")
def models(models_dir, tiny_target, device):
    draft_path = save_perturbed_copy(tiny_target, models_dir / "batching_draft", 0.05, seed=3)
    return load_model(ModelConfig(path=tiny_target, device=device)), load_model(
        ModelConfig(path=draft_path, device=device)
    )


def _requests():
    requests = []
    for i in range(16):
        prompt = PROMPTS[i % len(PROMPTS)]
        spec = SpecParams(method="ngram" if i % 5 == 4 else "draft", k=KS[i % len(KS)])
        if i % 4 == 3:  # seeded sampling, with and without top-p; a fixed k (k='auto' drafts by the batch's load,
            spec = SpecParams(method=spec.method, k=KS[i % 5])  # and the tokens drawn follow what was drafted)
            params = SamplingParams(temperature=0.8, top_p=0.9 if i % 8 == 3 else 1.0, seed=100 + i,
                                    max_new_tokens=12 + i)  # fmt: skip
        else:
            params = SamplingParams(max_new_tokens=8 + 2 * i)  # rows finish at different rounds
        requests.append((prompt, params, spec))
    return requests


def test_sixteen_concurrent_ragged_requests_batch_and_stay_lossless(models):
    requests = _requests()
    target_only = SpecEngine(models[0])

    async def run(reqs):
        async with LocalWorkers(models[0], [models[1]], batching=BatchingConfig(max_batch_size=16)) as w:
            results, _ = await run_pipeline(w, reqs)
            batchers = {name: s.batcher for name, s in w.servicers.items()}
            held = {name: len(x.committed) for name, x in {**w.drafts, **w.targets}.items()}
            used = {name: x.verifier.runner.store.used_tokens for name, x in w.targets.items()}
            return results, batchers, held, used

    results, batchers, held, used = asyncio.run(run(requests))
    for (prompt, params, spec), result in zip(requests, results, strict=True):
        if params.greedy:
            alone = target_only.generate(prompt, params, SpecParams(method="none")).token_ids
            assert result.state.generated == alone, (prompt, spec)
    # Seeded sampled requests: the same tokens alone as in the batch.
    for (prompt, params, spec), result in zip(requests, results, strict=True):
        if not params.greedy:
            (solo,), _, _, _ = asyncio.run(run([(prompt, params, spec)]))
            assert result.state.generated == solo.state.generated, (prompt, spec, params)
    # Real batching happened on both sides (tiny models finish a pass before many calls queue up, so the mean stays
    # modest here), within the configured size.
    for name, batcher in batchers.items():
        assert batcher.rows / batcher.batches > 1.2 and 4 <= batcher.largest <= 16, (name, batcher.largest)
    # Every row that finished gave its memory back.
    assert set(held.values()) == {0} and set(used.values()) == {0}
