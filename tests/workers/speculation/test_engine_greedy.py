"""Lossless, greedy: every speculative path yields exactly the tokens of target-only greedy decoding."""

import pytest
import torch

from specserve.workers.config.request import SamplingParams, SpecParams
from specserve.workers.config.settings import ModelConfig
from specserve.workers.runtime.loading import load_model
from specserve.workers.speculation.engine import SpecEngine
from tests.helpers.greedy_oracle import PROMPTS, own_greedy_loop
from tests.helpers.marks import slow_unless
from tests.helpers.workers import save_perturbed_copy, save_tiny_llama

MAX_NEW = 24


@pytest.fixture(scope="module")
def pairs(models_dir, tiny_target, tiny_draft, device):
    """(target, draft) pairs: unrelated random drafts (mostly rejected), noisy copies (partly accepted), the
    target itself (always accepted, so every round ends with a bonus token)."""
    other_target = save_tiny_llama(models_dir / "target_b", seed=5, layers=3, hidden=32, heads=2, kv_heads=1)
    other_draft = save_tiny_llama(models_dir / "draft_b", seed=6, layers=1, hidden=32, heads=2, kv_heads=1)
    specs = {
        "random": (tiny_target, tiny_draft),
        "noisy-0.03": (tiny_target, save_perturbed_copy(tiny_target, models_dir / "noisy_a", 0.03, seed=1)),
        "noisy-0.1": (tiny_target, save_perturbed_copy(tiny_target, models_dir / "noisy_b", 0.1, seed=2)),
        "self": (tiny_target, tiny_target),
        "random-b": (other_target, other_draft),
        "noisy-b": (other_target, save_perturbed_copy(other_target, models_dir / "noisy_c", 0.05, seed=3)),
    }
    loaded = {}
    cache = {}
    for name, (t, d) in specs.items():
        if t not in cache:
            cache[t] = load_model(ModelConfig(path=t, device=device))
        if d not in cache:
            cache[d] = load_model(ModelConfig(path=d, device=device))
        loaded[name] = SpecEngine(cache[t], cache[d])
    return loaded


@pytest.fixture(scope="module")
def references(pairs):
    refs = {}
    for engine in pairs.values():
        target = engine.target
        for prompt in PROMPTS:
            key = (target.path, prompt)
            if key in refs:
                continue
            ids = target.tokenizer(prompt)["input_ids"]
            own = own_greedy_loop(target.model, ids, MAX_NEW, target.eos_token_ids)
            hf = target.model.generate(
                torch.tensor([ids], device=target.device), do_sample=False, max_new_tokens=MAX_NEW
            )[0, len(ids) :]
            assert own == hf.tolist()  # the two references agree before either judges specserve
            refs[key] = own
    return refs


PAIRS = ["random", "noisy-0.03", "noisy-0.1", "self", "random-b", "noisy-b"]


@pytest.mark.parametrize(
    "pair", slow_unless(PAIRS, ["noisy-0.03", "noisy-0.1", "self", "noisy-b"])
)  # random drafts: in CI
def test_draft_model_greedy_identical_to_target_only(pairs, references, pair):
    engine = pairs[pair]
    totals = {"drafted": 0, "accepted": 0, "rounds": 0}
    for prompt in PROMPTS:
        expected = references[(engine.target.path, prompt)]
        for k in (1, 2, 4, 8):
            result = engine.generate(prompt, SamplingParams(max_new_tokens=MAX_NEW), SpecParams(method="draft", k=k))
            assert result.token_ids == expected, (pair, prompt, k)
            assert result.finish_reason == ("stop" if len(expected) < MAX_NEW else "length")
            for key in totals:
                totals[key] += getattr(result.stats, key)
    assert totals["drafted"] > 0
    if pair == "self":
        assert totals["accepted"] == totals["drafted"]  # the bonus path, every round
    elif pair.startswith("noisy"):
        assert 0 < totals["accepted"] < totals["drafted"]  # accepted and recovered tokens both occur


def test_ngram_greedy_identical_to_target_only(pairs, references):
    drafted = 0
    for name in ("random", "random-b"):
        engine = pairs[name]
        for prompt in PROMPTS:
            for k in (1, 4):
                result = engine.generate(
                    prompt, SamplingParams(max_new_tokens=MAX_NEW), SpecParams(method="ngram", k=k)
                )
                assert result.token_ids == references[(engine.target.path, prompt)]
                drafted += result.stats.drafted
    assert drafted > 0


def test_no_spec_is_target_only(pairs, references):
    engine = pairs["random"]
    for prompt in PROMPTS:
        result = engine.generate(prompt, SamplingParams(max_new_tokens=MAX_NEW), SpecParams(method="none"))
        assert result.token_ids == references[(engine.target.path, prompt)]
        assert result.stats.drafted == 0 and result.stats.rounds == len(result.token_ids)


def test_caches_are_released_after_each_request(pairs):
    engine = pairs["noisy-0.1"]
    engine.generate(PROMPTS[0], SamplingParams(max_new_tokens=8), SpecParams(method="draft", k=4))
    assert engine.verifier.runner.store.used_tokens == 0
    assert engine.drafters["draft"].runner.store.used_tokens == 0


def test_suffix_greedy_is_identical_to_target_only_and_a_repeat_drafts_from_the_cache(pairs, references):
    engine = pairs["random"]
    for k in (3, "auto"):
        for prompt in PROMPTS:
            first = engine.generate(prompt, SamplingParams(max_new_tokens=MAX_NEW), SpecParams(method="suffix", k=k))
            again = engine.generate(prompt, SamplingParams(max_new_tokens=MAX_NEW), SpecParams(method="suffix", k=k))
            assert first.token_ids == again.token_ids == references[(engine.target.path, prompt)]
            assert again.stats.accepted >= 0.9 * again.stats.drafted and again.stats.rounds < len(again.token_ids)
