"""Log-probabilities under speculation, in process: every drafting method's logprobs (and top alternatives) equal
what target-only decoding computes for the same tokens (a teacher-forced full forward, no specserve code), within
ATOL in float32, one per emitted token; raw (before temperature), so a sampled run's equal them too; nothing is
computed for requests that do not ask; the wire form round-trips."""

import pytest
import torch

from specserve.workers.config.request import SamplingParams, SpecParams
from specserve.workers.config.settings import ModelConfig
from specserve.workers.config.strict import validate
from specserve.workers.errors import InvalidRequestError
from specserve.workers.runtime.loading import load_model
from specserve.workers.speculation import logprobs as logprobs_module
from specserve.workers.speculation.engine import SpecEngine
from specserve.workers.speculation.logprobs import TokenLogprob, from_proto, to_proto
from tests.helpers.eagle_heads import random_head
from tests.helpers.logprobs_oracle import ATOL, assert_logprobs_match, target_logprobs
from tests.helpers.workers import save_perturbed_copy, save_tiny_llama

MAX_NEW = 20
PROMPTS = [[1, 3, 4, 5, 3, 4, 5, 3, 4], [1, 6, 7, 3, 6, 7, 3]]  # repeats: prompt lookup's matches are accepted
METHODS = ["none", "draft", "ngram", "ngram-tree", "eagle", "eagle+ngram", "eagle-tree", "suffix"]


@pytest.fixture(scope="module")
def engine(tmp_path_factory, device):
    """A peaked tiny-vocabulary target (8 tokens, so random drafts are often accepted) with a noisy copy as its
    draft model and a random EAGLE-3 head."""
    root = tmp_path_factory.mktemp("logprobs")
    path = save_tiny_llama(root / "target", seed=3, layers=8, hidden=32, tiny_vocab=True, init_range=0.5)
    draft = save_perturbed_copy(path, root / "draft", 0.05, seed=1)
    target = load_model(ModelConfig(path=path, device=device))
    head = random_head(target.model.config, 6, seed=0)
    return SpecEngine(target, load_model(ModelConfig(path=draft, device=device)), eagle_head=head)


@pytest.mark.parametrize("method", METHODS)
def test_speculative_logprobs_equal_target_only_for_every_method(engine, method):
    accepted = 0
    for top, prompt in zip((5, 0), PROMPTS, strict=True):
        for k in (3, "auto"):
            params = SamplingParams(max_new_tokens=MAX_NEW, stop_at_eos=False, logprobs=top)
            result = engine.generate(prompt, params, SpecParams(method=method, k=k))
            expected = target_logprobs(engine.target.model, prompt, result.token_ids)
            assert result.token_ids == expected.argmax(-1).tolist()  # greedy: still target-only's tokens
            assert_logprobs_match(result.token_ids, result.logprobs, expected, top)
            accepted += result.stats.accepted
    assert method == "none" or accepted > 0  # multi-token rounds were checked, not only plain steps


def test_logprobs_are_raw_so_a_sampled_run_reports_the_target_distribution_before_temperature(engine):
    params = SamplingParams(temperature=1.7, top_k=4, max_new_tokens=MAX_NEW, seed=3, stop_at_eos=False, logprobs=3)
    result = engine.generate(PROMPTS[0], params, SpecParams(method="draft", k=3))
    expected = target_logprobs(engine.target.model, PROMPTS[0], result.token_ids)
    assert_logprobs_match(result.token_ids, result.logprobs, expected, 3)


@pytest.mark.parametrize("method", ["draft", "eagle-tree"])
def test_logprobs_stay_raw_under_penalties_and_logit_bias(engine, method):
    """The controls change which tokens are chosen, never the reported distribution (vLLM's raw_logprobs)."""
    params = SamplingParams(max_new_tokens=MAX_NEW, stop_at_eos=False, logprobs=4, presence_penalty=1.5,
                            repetition_penalty=1.4, logit_bias={3: -5.0})  # fmt: skip
    result = engine.generate(PROMPTS[0], params, SpecParams(method=method, k=3))
    expected = target_logprobs(engine.target.model, PROMPTS[0], result.token_ids)
    assert result.token_ids != expected.argmax(-1).tolist()  # the controls did choose otherwise
    assert_logprobs_match(result.token_ids, result.logprobs, expected, 4)


def test_a_request_cut_at_eos_or_its_length_has_a_logprob_per_emitted_token(engine):
    params = SamplingParams(max_new_tokens=7, logprobs=1)  # EOS stops it where target-only decoding stops
    for method in ("draft", "eagle"):
        result = engine.generate(PROMPTS[0], params, SpecParams(method=method, k=5))
        assert len(result.logprobs) == len(result.token_ids) <= 7
        assert_logprobs_match(result.token_ids, result.logprobs,
                              target_logprobs(engine.target.model, PROMPTS[0], result.token_ids), 1)  # fmt: skip


def test_nothing_is_computed_for_a_request_that_does_not_ask(engine, monkeypatch):
    def fail(*args):
        raise AssertionError("logprobs computed for a request that did not ask")

    monkeypatch.setattr("specserve.workers.speculation.target.token_logprobs", fail)
    result = engine.generate(PROMPTS[0], SamplingParams(max_new_tokens=8), SpecParams(method="draft", k=3))
    assert result.logprobs is None and "logprobs" not in result.to_dict()
    monkeypatch.undo()
    assert logprobs_module.token_logprobs is not fail


def test_the_wire_form_round_trips_exactly_and_refuses_misaligned_columns():
    values = [TokenLogprob(-0.25, ((3, -0.25), (1, -2.5))), TokenLogprob(-1e-7, ((4, -1e-7), (2, -17.0)))]
    back = from_proto(to_proto(values))
    assert [t.logprob for t in back] == [float(torch.tensor(t.logprob)) for t in values]  # float32 on the wire
    assert [[i for i, _ in t.top] for t in back] == [[3, 1], [4, 2]] and abs(back[1].top[1][1] + 17.0) < ATOL
    assert from_proto(to_proto([TokenLogprob(-0.5)])) == [TokenLogprob(-0.5)]
    bad = to_proto(values)
    bad.top_logprobs.pop()
    with pytest.raises(ValueError):
        from_proto(bad)


@pytest.mark.parametrize("value", [-1, 21])
def test_logprobs_out_of_range_are_refused_naming_the_field(value):
    with pytest.raises(InvalidRequestError) as e:
        validate(SamplingParams, {"logprobs": value})
    assert e.value.field == "logprobs"
