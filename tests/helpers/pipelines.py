"""Requests driven through a Scheduler + Pipeline on LocalWorkers' real gRPC workers, as the scheduler replica drives
them: all concurrently, an optional job beside them, the releases drained and the clients closed before returning."""

import asyncio

from specserve.cluster.scheduling.pipeline import Pipeline
from specserve.cluster.scheduling.scheduler import Scheduler
from specserve.cluster.scheduling.worker_clients import DraftClient, TargetClient
from tests.helpers.workers import LocalWorkers


async def run_pipeline(w: LocalWorkers, requests, predraft=True, during=None, reconnect=None, timeout_s=30.0,
                       worker_wait_s=600.0, decode_steps=8):  # fmt: skip
    """Generate every (prompt, params, spec) concurrently through a Scheduler + Pipeline on `w`'s workers (clients
    with `timeout_s`; a request whose target failed waits `worker_wait_s` for one; one that never drafts runs up to
    `decode_steps` plain steps a call, as served)."""
    drafts, targets = _clients(w, timeout_s)
    pipeline = Pipeline(Scheduler(list(drafts), list(targets), decode_steps=decode_steps), drafts, targets,
                        predraft=predraft, reconnect=reconnect, worker_wait_s=worker_wait_s)  # fmt: skip
    tokenizer = next(iter(w.targets.values())).verifier.runner.loaded.tokenizer
    eos = frozenset({tokenizer.eos_token_id})
    jobs = [pipeline.generate(tokenizer(p)["input_ids"], params, spec, eos) for p, params, spec in requests]
    if during is not None:
        jobs.append(during(pipeline))
    results = await asyncio.gather(*jobs)
    await pipeline.drain_releases()  # releases leave after each reply: wait for them before looking at the workers
    await _close(pipeline)
    return results[: len(requests)], pipeline


async def generate_all(w: LocalWorkers, requests, during=None, reconnect=None, predraft=True, prefill_chunk=None):
    """Generate every (prompt ids, params, spec) concurrently through a Scheduler + Pipeline on `w`'s workers, with
    no stop token (so every position the target commits is one the request keeps); prompts longer than
    `prefill_chunk` prefill in chunks of it."""
    drafts, targets = _clients(w)
    pipeline = Pipeline(Scheduler(list(drafts), list(targets), prefill_chunk=prefill_chunk), drafts, targets,
                        predraft=predraft, reconnect=reconnect)  # fmt: skip
    jobs = [pipeline.generate(ids, params, spec, frozenset()) for ids, params, spec in requests]
    if during is not None:
        jobs.append(during(pipeline))
    results = await asyncio.gather(*jobs)
    await pipeline.drain_releases()
    await _close(pipeline)
    return results[: len(requests)], pipeline


async def generate_in_turns(w: LocalWorkers, turns) -> list:
    """Requests one after another through one Scheduler + Pipeline (its placement and prefix records carried from one
    to the next): `turns(done)` returns the next (prompt ids, params, spec) from the requests done so far, or None."""
    drafts, targets = _clients(w)
    pipeline = Pipeline(Scheduler(list(drafts), list(targets)), drafts, targets)
    done = []
    while (turn := turns(done)) is not None:
        done.append(await pipeline.generate(*turn, frozenset()))
        await pipeline.drain_releases()
    await _close(pipeline)
    return done


async def generate_beside(w: LocalWorkers, running, joining) -> tuple:
    """(prompt ids, params, spec) `running` through one Scheduler + Pipeline, and `joining` started once `running`
    has drafted (its prompt computed on its target and its drafter): returns both requests."""
    drafts, targets = _clients(w)
    pipeline = Pipeline(Scheduler(list(drafts), list(targets)), drafts, targets)
    first = asyncio.create_task(pipeline.generate(*running, frozenset()))
    while not first.done() and not any(r.state.stats.drafted for r in pipeline.scheduler.requests.values()):
        await asyncio.sleep(0.002)
    second = await pipeline.generate(*joining, frozenset())
    results = (await first, second)
    await pipeline.drain_releases()
    await _close(pipeline)
    return results


def _clients(w: LocalWorkers, timeout_s: float = 30.0) -> tuple[dict, dict]:
    """gRPC clients of `w`'s draft and target workers, by name."""
    drafts = {n: DraftClient(a, timeout_s=timeout_s) for n, a in w.draft_addresses.items()}
    return drafts, {n: TargetClient(a, timeout_s=timeout_s) for n, a in w.target_addresses.items()}


async def _close(pipeline: Pipeline) -> None:
    for client in (*pipeline.drafts.values(), *pipeline.targets.values()):
        await client.close()


# The chain and tree methods a served identity test runs, by what drafts: a draft model (beside prompt lookup and
# suffix drafting, which need no worker) or an EAGLE-3 head.
SERVED_METHODS = {
    "draft model": [("draft", 3), ("ngram", 3), ("ngram-tree", 6), ("suffix", 3), ("none", 1)],
    "eagle head": [("eagle", 3), ("eagle+ngram", 3), ("eagle-tree", 6), ("eagle-tree+ngram", 6)],
}


def run_keyed(target, draft, head, kind: str, keyed: dict) -> dict:
    """{key: (prompt, SamplingParams, SpecParams)} -> {key: SchedRequest}, every request run concurrently through the
    pipeline over real gRPC workers: `draft` (a loaded draft model) for kind "draft model", else the `head`."""
    drafts, head = ([draft], None) if kind == "draft model" else ([], head)

    async def main():
        async with LocalWorkers(target, drafts, eagle_head=head, eagle_drafts=1 if head else 0) as w:
            results, _ = await run_pipeline(w, list(keyed.values()))
            return results

    return dict(zip(keyed, asyncio.run(main()), strict=True))


def served_models(root):
    """(target, draft model, EAGLE-3 head directory) under `root`: a tiny Llama, a perturbed copy that drafts for it,
    and a random head, for run_keyed."""
    import torch

    from specserve.workers.config.settings import ModelConfig
    from specserve.workers.runtime.loading import load_model
    from specserve.workers.speculation.eagle.checkpoint import save_head
    from tests.helpers.eagle_heads import random_head
    from tests.helpers.workers import save_perturbed_copy, save_tiny_llama

    path = save_tiny_llama(root / "target", seed=4, layers=4, hidden=32)
    target = load_model(ModelConfig(path=path, device="cpu"))
    draft = load_model(ModelConfig(path=save_perturbed_copy(path, root / "draft", 0.05, seed=7), device="cpu"))
    head = str(save_head(random_head(target.model.config, 64, seed=1, std=0.3), root / "head", torch.float32))
    return target, draft, head
