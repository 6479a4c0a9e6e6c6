"""The EAGLE-3 head packaged for SmolLM2-135M-Instruct: found for the real model, greedy output identical to
target-only, and it has learnt the target (held-out chat questions, never used in training: a random head accepts
nothing). The issue's aim, more accepted than n-gram drafting, is not reached by this head (README, Draft heads)."""

import pytest

from specserve.cluster.app_config import DEFAULT_MODEL
from specserve.cluster.bench.head_eval import held_out_acceptance
from specserve.workers.config import ModelConfig, SamplingParams, SpecParams
from specserve.workers.models.catalog import resolve_model
from specserve.workers.models.chat_questions import HELD_OUT_QUESTIONS, question_prompt_ids
from specserve.workers.models.packaged_heads import packaged_head_for
from specserve.workers.runtime.loading import load_model
from specserve.workers.speculation.engine import SpecEngine

pytestmark = pytest.mark.slow

QUESTIONS, NEW_TOKENS, K = 3, 48, 4


@pytest.fixture(scope="module")
def engine():
    target = resolve_model(DEFAULT_MODEL)
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
    assert head.reach[0] > 0.1, head  # position 1 on held-out chat (measured: 0.18 here, 0.25 on 12 questions)
    assert head.accepted_by_position[1] > 0, head  # and chains past it
