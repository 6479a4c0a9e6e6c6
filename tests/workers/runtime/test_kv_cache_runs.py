"""A chunked prompt's KV run (workers/runtime/kv_cache.py): sized at its first chunk for the whole prompt it is
expected to reach (`expected_len`, the scheduler's chunk calls), so that no later chunk or first round moves it (a move
copies every position it holds: ~0.5 s deep in a 4K prompt on a CPU worker, in every stream's pass beside it)."""

import pytest
import torch

from specserve.workers.config.settings import KVCacheConfig, ModelConfig
from specserve.workers.runtime.kv_cache import run_for
from specserve.workers.runtime.loading import load_model
from specserve.workers.runtime.runner import ForwardRow, ModelRunner
from tests.helpers.greedy_oracle import full_logits

PROMPT = [3 + (7 * i) % 200 for i in range(400)]
SHORT = [5 + (3 * i) % 150 for i in range(30)]


@pytest.fixture(scope="module")
def target(tiny_target):
    return load_model(ModelConfig(path=tiny_target, device="cpu"))


def _chunked(runner: ModelRunner, expected: int | None) -> list[int]:
    """The prompt in chunks of 100 with a short request arriving after the first (its run right after the prompt's);
    the prompt's run's base after each chunk, and its first round's."""
    bases = []
    for end in range(100, len(PROMPT) + 1, 100):
        logits = runner.logits_for_batch([ForwardRow("long", PROMPT[:end], 1, expected_len=expected)])[0]
        torch.testing.assert_close(logits, full_logits(runner.model, PROMPT[:end])[-1:], rtol=0, atol=1e-5)
        bases.append(runner.store.get("long").run.base)
        if end == 100:
            runner.logits_for("short", SHORT, 1)
    first_round = PROMPT + [42, 43]
    torch.testing.assert_close(runner.logits_for("long", first_round, 1), full_logits(runner.model, first_round)[-1:],
                               rtol=0, atol=1e-5)  # fmt: skip
    return bases + [runner.store.get("long").run.base]


def test_a_chunked_prompt_that_says_its_length_is_never_moved(target):
    runner = ModelRunner(target, KVCacheConfig(capacity_tokens=2048, prefix_caching=False))
    bases = _chunked(runner, expected=len(PROMPT))
    assert set(bases) == {bases[0]}
    assert runner.store.get("long").run.size >= run_for(len(PROMPT))


def test_without_its_length_the_prompt_moves_past_the_request_beside_it(target):
    runner = ModelRunner(target, KVCacheConfig(capacity_tokens=2048, prefix_caching=False))
    bases = _chunked(runner, expected=None)
    assert len(set(bases)) > 1


def test_a_run_sized_for_a_length_the_arena_cannot_hold_takes_what_the_chunk_needs(target):
    runner = ModelRunner(target, KVCacheConfig(capacity_tokens=256, prefix_caching=False))
    logits = runner.logits_for_batch([ForwardRow("long", PROMPT[:100], 1, expected_len=10_000)])[0]
    torch.testing.assert_close(logits, full_logits(target.model, PROMPT[:100])[-1:], rtol=0, atol=1e-5)
    assert runner.store.get("long").run.size < 256  # room left for another request
    runner.logits_for("short", SHORT, 1)
