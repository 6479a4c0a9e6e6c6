"""Prefix affinity over two real gRPC target workers: a conversation's second turn goes to the worker that served
its first (which holds its history's cache) although the other is idle, takes that cache over and decodes exactly
what target-only decoding does (too loaded a worker gives it up: tests/cluster/scheduling/test_affinity.py)."""

import asyncio

from specserve.cluster.scheduling.pipeline import Pipeline
from specserve.cluster.scheduling.scheduler import Scheduler
from specserve.cluster.scheduling.worker_clients import TargetClient
from specserve.workers.config.request import SamplingParams, SpecParams
from specserve.workers.config.settings import ModelConfig
from specserve.workers.runtime.kv_cache import RETAIN_LESS
from specserve.workers.runtime.loading import load_model
from tests.helpers.greedy_oracle import own_greedy_loop
from tests.helpers.workers import LocalWorkers

N = 16
SPEC = SpecParams(method="ngram", k=3)


def test_a_second_turn_goes_where_its_history_is_cached(tiny_target, device):
    target = load_model(ModelConfig(path=tiny_target, device=device))
    history = target.tokenizer("def fibonacci(n):\n    if n < 2:\n        return n\n" * 3)["input_ids"]
    filler = target.tokenizer("import os\nimport sys\n")["input_ids"]

    async def main():
        async with LocalWorkers(target, [], n_targets=2) as w:
            targets = {n: TargetClient(a) for n, a in w.target_addresses.items()}
            pipeline = Pipeline(Scheduler([], list(targets)), {}, targets)
            first = await pipeline.generate(history, SamplingParams(max_new_tokens=N), SPEC, frozenset())
            await pipeline.drain_releases()
            turn_2 = history + first.state.generated + target.tokenizer("\n# and then")["input_ids"]
            # the filler takes the first worker (both idle); the second turn follows its history there anyway
            _, second = await asyncio.gather(
                pipeline.generate(filler, SamplingParams(max_new_tokens=3 * N), SPEC, frozenset()),
                pipeline.generate(turn_2, SamplingParams(max_new_tokens=N), SPEC, frozenset()),
            )
            await pipeline.drain_releases()
            stores = {name: t.verifier.runner.store for name, t in w.targets.items()}
            return first, second, pipeline, stores

    first, second, pipeline, stores = asyncio.run(main())
    assert first.target_worker == second.target_worker == "target-0"
    assert pipeline.scheduler.prefixes.affinity["target"].placed == 1
    assert stores["target-0"].prefix_hits >= len(history) + N - 1 - RETAIN_LESS and stores["target-1"].prefix_hits == 0
    prompt = second.state.tokens[: second.state.prompt_len]
    assert second.state.generated == own_greedy_loop(target.model, prompt, N, set())
