"""Bad input gets a clear error naming the field; the engine keeps working afterwards."""

import pytest

from specserve.workers.config.request import SamplingParams, SpecParams
from specserve.workers.config.settings import ModelConfig
from specserve.workers.config.strict import validate
from specserve.workers.errors import InvalidRequestError
from specserve.workers.runtime.loading import load_model
from specserve.workers.speculation.engine import SpecEngine


@pytest.fixture(scope="module")
def engine(tiny_target, tiny_draft):
    return SpecEngine(load_model(ModelConfig(path=tiny_target)), load_model(ModelConfig(path=tiny_draft)))


@pytest.mark.parametrize(
    "model, data, field, text",
    [
        (SpecParams, {"k": 0}, "k", "greater than or equal to 1"),
        (SpecParams, {"k": 17}, "k", "less than or equal to 16"),
        (SpecParams, {"method": "medusa"}, "method", "'ngram', 'ngram-tree', 'suffix' or 'none'"),
        (SamplingParams, {"temperature": -0.5}, "temperature", "greater than or equal to 0"),
        (SamplingParams, {"temperature": float("nan")}, "temperature", "finite"),
        (SamplingParams, {"top_p": 0.0}, "top_p", "greater than 0"),
        (SamplingParams, {"top_p": 1.5}, "top_p", "less than or equal to 1"),
        (SamplingParams, {"top_k": -1}, "top_k", "greater than or equal to 0"),
        (SamplingParams, {"max_new_tokens": 0}, "max_new_tokens", "greater than 0"),
        (SamplingParams, {"max_new_tokens": "many"}, "max_new_tokens", "valid integer"),
        (SamplingParams, {"seed": -3}, "seed", "greater than or equal to 0"),
        (SamplingParams, {"temprature": 0.5}, "temprature", "Extra inputs are not permitted"),
    ],
)
def test_invalid_parameters_name_the_field(model, data, field, text):
    with pytest.raises(InvalidRequestError) as info:
        validate(model, data)
    assert info.value.field == field
    assert str(info.value).startswith(f"invalid {field}:")
    assert text in str(info.value)


def test_empty_prompt(engine):
    with pytest.raises(InvalidRequestError, match="invalid prompt: must not be empty"):
        engine.generate("", SamplingParams(), SpecParams())
    with pytest.raises(InvalidRequestError, match="invalid prompt: encodes to no tokens"):
        engine.generate([], SamplingParams(), SpecParams())


def test_token_ids_outside_vocabulary(engine):
    with pytest.raises(InvalidRequestError, match=r"invalid prompt: token id 999999 is outside the vocabulary"):
        engine.generate([1, 999999], SamplingParams(), SpecParams())


def test_max_new_tokens_beyond_context(engine):
    with pytest.raises(
        InvalidRequestError,
        match=r"invalid max_new_tokens: 600 new tokens after a 5-token prompt "
        r"exceed the model's context of 512 positions \(at most 507\)",
    ):
        engine.generate("hello", SamplingParams(max_new_tokens=600), SpecParams())


def test_draft_method_without_draft_model(tiny_target):
    engine = SpecEngine(load_model(ModelConfig(path=tiny_target)))
    with pytest.raises(InvalidRequestError, match="invalid method: 'draft' drafting needs a draft model"):
        engine.generate("hi", SamplingParams(max_new_tokens=2), SpecParams(method="draft"))


def test_engine_keeps_serving_after_bad_requests(engine):
    for bad in ("", [1, 10**6]):
        with pytest.raises(InvalidRequestError):
            engine.generate(bad, SamplingParams(), SpecParams())
    result = engine.generate("ok", SamplingParams(max_new_tokens=4), SpecParams(k=2))
    assert len(result.token_ids) >= 1
    assert engine.verifier.runner.store.used_tokens == 0  # nothing leaked from the failed requests
