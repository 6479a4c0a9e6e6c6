"""Seeded requests sampled in worker processes that live for the whole session: the statistical tests need thousands of
independent samples and CI has 2 cores, so the samples are split over two processes. Starting them (spawn, then
importing torch, transformers and specserve) took ~10 s a test, eleven times a run; they now start once, at the first
test that samples, and close at the session's end (tests/conftest.py).

Each job loads its models and builds its engine afresh (tens of milliseconds for these tiny models), so a test's
samples do not depend on the tests that sampled before it (an engine keeps retained prefixes and, for suffix
drafting, its recent outputs)."""

from __future__ import annotations

import multiprocessing
from dataclasses import dataclass

import torch

PROCESSES = 2
_POOL = None  # the session's pool, started at the first job


@dataclass(frozen=True)
class Samples:
    outputs: list[tuple[int, ...]]  # in seed order
    accepted: int  # drafted tokens accepted, over all the requests
    drafted: int


def _start() -> None:
    torch.set_num_threads(1)


def _sample_seeds(job) -> Samples:
    from specserve.workers.config.settings import ModelConfig
    from specserve.workers.runtime.loading import load_model
    from specserve.workers.speculation.engine import SpecEngine

    (target_path, draft_path, device, eagle_head), (prompt, params, spec, seeds) = job
    draft = load_model(ModelConfig(path=draft_path, device=device)) if draft_path else None
    engine = SpecEngine(load_model(ModelConfig(path=target_path, device=device)), draft, eagle_head=eagle_head)
    outputs, accepted, drafted = [], 0, 0
    for seed in seeds:
        result = engine.generate(prompt, params.model_copy(update={"seed": seed}), spec)
        outputs.append(tuple(result.token_ids))
        accepted += result.stats.accepted
        drafted += result.stats.drafted
    return Samples(outputs, accepted, drafted)


def sample_in_processes(
    target_path: str, draft_path: str | None, device: str, prompt: list[int] | str, params, spec, seeds: list[int],
    eagle_head: str | None = None,
) -> Samples:  # fmt: skip
    """One seeded request per seed, alone, as `SpecEngine.generate` runs it (prompt: token ids or text), on an
    engine of the target, the draft model (if any) and the EAGLE-3 head directory (if any), split over the session's
    processes. Every sample is an independent request, so the split changes no output."""
    global _POOL
    if _POOL is None:
        _POOL = multiprocessing.get_context("spawn").Pool(PROCESSES, initializer=_start)
    size = -(-len(seeds) // PROCESSES)
    models = (target_path, draft_path, device, eagle_head)
    jobs = [(models, (prompt, params, spec, seeds[i : i + size])) for i in range(0, len(seeds), size)]
    parts = _POOL.map(_sample_seeds, jobs, chunksize=1)
    return Samples([o for p in parts for o in p.outputs], sum(p.accepted for p in parts), sum(p.drafted for p in parts))


def close_sampler_pool() -> None:
    """Stop the session's processes (if any started)."""
    global _POOL
    if _POOL is not None:
        _POOL.close()
        _POOL.join()
        _POOL = None
