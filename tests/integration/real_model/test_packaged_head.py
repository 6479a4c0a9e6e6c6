"""The EAGLE-3 head packaged for SmolLM2-135M-Instruct: found for the real model, greedy output identical to
target-only, and it accepts what it was measured to (held-out chat questions, never used in training: a random head
accepts nothing, the head before the retraining 0.325 at position 1). Fetches the real model
(tests/helpers/real_model.py): fails under CI, skips elsewhere, where it cannot."""

import pytest

from specserve.cluster.app_config import DEFAULT_MODEL
from specserve.cluster.bench.head_eval import held_out_acceptance
from specserve.workers.config.request import SamplingParams, SpecParams
from specserve.workers.config.settings import ModelConfig
from specserve.workers.models.chat_questions import HELD_OUT_QUESTIONS, question_prompt_ids
from specserve.workers.models.packaged_heads import packaged_head_for
from specserve.workers.runtime.loading import load_model
from specserve.workers.speculation.engine import SpecEngine
from tests.helpers.real_model import real_model_dir

pytestmark = pytest.mark.slow

QUESTIONS, NEW_TOKENS, K = 3, 48, 4


@pytest.fixture(scope="module")
def engine():
    target = real_model_dir()
    head = packaged_head_for(target)
    assert head is not None, f"no head packaged for {DEFAULT_MODEL}"
    return SpecEngine(load_model(ModelConfig(path=target, device="cpu")), eagle_head=head)


def test_the_packaged_head_is_identical_and_drafts_what_the_target_writes(engine):
    params = SamplingParams(max_new_tokens=NEW_TOKENS)
    for question in HELD_OUT_QUESTIONS[:QUESTIONS]:
        prompt = question_prompt_ids(engine.tokenizer, question)
        expected = engine.generate(prompt, params, SpecParams(method="none")).token_ids
        for method in ("eagle", "eagle+ngram"):
            assert engine.generate(prompt, params, SpecParams(method=method, k=K)).token_ids == expected, method
    head = held_out_acceptance(engine, "eagle", K, QUESTIONS, NEW_TOKENS)
    # Greedy, so the same on every run: 25 of 54 at position 1 (0.46) and 12 of 52 at position 2 (0.23) here; 0.550
    # at position 1 on 12 questions (the head's config.json). A head no better than the one before (0.325) fails.
    assert head.reach[0] > 0.4, head
    assert head.reach[1] > 0.15, head  # and chains past it
