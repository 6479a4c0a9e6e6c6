"""The disaggregated path with an EAGLE-3 head, for the tests of methods "eagle", "eagle+ngram" and "eagle-tree" in
it: tiny targets with random heads, their prompts, requests run through head draft workers and target workers
(recording the features each head got, or sampling seeded requests), and the path the Serve app runs for a model,
without Ray."""

import asyncio
from dataclasses import dataclass
from pathlib import Path

import torch

from specserve.cluster.app_config import AppConfig
from specserve.cluster.scheduling.model_serving import ModelServing
from specserve.cluster.scheduling.pipeline import Pipeline
from specserve.cluster.scheduling.prepared import Prepared
from specserve.cluster.scheduling.scheduler import Scheduler
from specserve.cluster.scheduling.worker_clients import DraftClient, TargetClient
from specserve.cluster.serve import openai_api as oai
from specserve.cluster.serve.prepare import RequestPreparer
from specserve.workers.config.request import SamplingParams, SpecParams
from specserve.workers.config.settings import ModelConfig
from specserve.workers.runtime.loading import load_model
from specserve.workers.speculation.eagle.checkpoint import save_head
from tests.helpers.eagle_heads import random_head
from tests.helpers.pipelines import generate_all
from tests.helpers.sampling_oracle import PROMPT
from tests.helpers.workers import LocalWorkers, save_tiny_llama

BYTE_PROMPTS = ["def add(a, b):\n    return", "class Stack:", "for i in range(3):\n    print(i)\n" * 3, "x"]


def build_pairs(models_dir: Path, device: str) -> dict:
    """(target, head directory) pairs. byte: a byte-vocabulary target and a random head over 64 of its 259 tokens,
    which drafts nearly nothing acceptable; tiny_vocab: an 8-token target and a peaked random head over 5 of them,
    a third of whose drafts are accepted. Under `models_dir`, which a module of tests owns."""
    byte = save_tiny_llama(models_dir / "eagle_dis_byte", seed=4, layers=4, hidden=32)
    tv = save_tiny_llama(models_dir / "eagle_dis_tv", seed=10, layers=4, hidden=16, tiny_vocab=True, init_range=0.5)
    out = {}
    for name, path, draft_vocab, seed, std in (("byte", byte, 64, 1, 0.3), ("tiny_vocab", tv, 5, 4, 0.5)):
        target = load_model(ModelConfig(path=path, device=device))
        head = random_head(target.model.config, draft_vocab, seed=seed, std=std)
        out[name] = target, str(save_head(head, models_dir / f"{name}_{device}_head", torch.float32))
    return out


def prompts_of(target, pair_name: str) -> list[list[int]]:
    if pair_name == "byte":
        return [target.tokenizer(p)["input_ids"] for p in BYTE_PROMPTS]
    return [[1, 3, 4, 3, 4, 3], [1, 5, 6], [1, 7, 3, 5, 4, 6, 7, 3, 4, 5, 6, 7, 5, 3]]


def generate_recording_features(target, head_dir: str, requests) -> tuple[list, Pipeline, dict]:
    """Run `requests` on two head draft workers and two targets; also returns request id -> [(start, features)] as
    each head got them. The targets cache no prefixes across requests, so that every request's every position is
    computed and handed to a head (prefix hits: tests/integration/disaggregated/test_prefix_caching.py)."""
    handed = {}

    async def main():
        async with LocalWorkers(target, [], n_targets=2, eagle_head=head_dir, eagle_drafts=2,
                                prefix_caching=False) as w:  # fmt: skip
            for worker in w.drafts.values():
                add = worker.drafter.add_features
                worker.drafter.add_features = lambda rid, start, f, add=add: (
                    handed.setdefault(rid, []).append((start, f)) or add(rid, start, f)
                )
            results, pipeline = await generate_all(w, requests)
            assert_all_released(w)
            return results, pipeline

    results, pipeline = asyncio.run(main())
    return results, pipeline, handed


def greedy(max_new: int, method: str = "eagle", k=3):
    return SamplingParams(max_new_tokens=max_new), SpecParams(method=method, k=k)


def assert_all_released(w: LocalWorkers) -> None:
    for worker in (*w.drafts.values(), *w.targets.values()):
        assert len(worker.committed) == 0
    for worker in w.drafts.values():
        assert not worker.drafter.drafting._requests and not worker.drafter._pending


def sample_disaggregated(target, head_dir: str, params: SamplingParams, spec: SpecParams, samples: int,
                         prompt: list[int] = PROMPT, stores: list | None = None) -> list:  # fmt: skip
    """One seeded request of `prompt` per seed 0..samples-1, 64 at a time, through a head draft worker and a target
    worker; `stores` (a list) gets the target's KV cache store."""

    async def main():
        async with LocalWorkers(target, [], eagle_head=head_dir) as w:
            drafts = {n: DraftClient(a, 30) for n, a in w.draft_addresses.items()}
            targets = {n: TargetClient(a, 30) for n, a in w.target_addresses.items()}
            pipeline = Pipeline(Scheduler(list(drafts), list(targets)), drafts, targets)
            running = asyncio.Semaphore(64)

            async def one(seed):
                async with running:
                    seeded = params.model_copy(update={"seed": seed})
                    return await pipeline.generate(prompt, seeded, spec, frozenset())

            results = await asyncio.gather(*(one(seed) for seed in range(samples)))
            await pipeline.drain_releases()
            if stores is not None:
                stores.append(w.targets["target-0"].verifier.runner.store)
            return results

    return asyncio.run(main())


def app_with(target_path: str, draft: str) -> AppConfig:
    return AppConfig.model_validate({"models": [{"name": "m", "target": target_path, "draft": draft, "device": "cpu"}],
                                     "auth": {"api_key_env": None}})  # fmt: skip


@dataclass
class ServedRun:
    paths: tuple[str, str | None]  # the model's resolved (target, draft) directories
    prepared: Prepared
    out: dict  # the scheduler replica's reply
    status: dict  # the scheduler replica's status of the model


def run_the_serving_path(app: AppConfig, prompt: str, max_tokens: int, speculation: dict | None = None) -> ServedRun:
    """What the Serve app runs for the first model of `app`, without Ray: the pool replicas' worker bodies (the draft
    pool runs the head, the target pool captures its features), the ingress's RequestPreparer (a greedy request,
    without a method unless `speculation` says) and the scheduler replica's ModelServing."""
    from specserve.cluster.serve.pool_worker import _worker_body
    from specserve.cluster.serve.replica_env import resolve_paths

    name = app.models[0].name
    paths = {name: resolve_paths(app.models[0])}
    bodies = {kind: _worker_body(app.models[0], kind) for kind in ("target", "draft")}
    assert bodies["draft"].runner is None and bodies["target"].runner.capture_layers == (2, 2, 1)
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    request = oai.parse_completion({**body, "speculation": speculation} if speculation else body).request
    prepared = RequestPreparer(app, paths).prepare(request)

    async def main():
        rows = [{"model": name, "kind": kind, "worker_id": f"{kind}-0", "address": await body.start()}
                for kind, body in bodies.items()]  # fmt: skip
        serving = ModelServing(app, paths)
        serving.sync_workers(rows)
        out = await serving.generate(prepared)
        pipeline = serving.models[name].pipeline
        await pipeline.drain_releases()
        for client in (*pipeline.drafts.values(), *pipeline.targets.values()):
            await client.close()
        for body in bodies.values():
            await body.server.stop(None)
        return out, serving.status()[name]

    out, status = asyncio.run(main())
    return ServedRun(paths[name], prepared, out, status)


async def until(condition, timeout_s: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("timed out waiting")
        await asyncio.sleep(0.002)
