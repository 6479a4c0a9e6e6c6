"""Logits controls served: through the scheduler, its gRPC pipeline and real gRPC draft and target workers (the
controls cross the internal SamplingParams, the prompt's length and the tokens min_tokens holds back cross the
VerifyRequest), greedy output identical to transformers' `generate` with the same processors for each control, on the
draft-model, prompt-lookup, suffix, tree and head paths; and both public edges turn the fields into the request's
SamplingParams, refusing bad values naming the field as the client wrote it."""

import pytest

from specserve.client import SpecServeClient
from specserve.cluster.app_config import AppConfig
from specserve.cluster.serve import openai_api as oai
from specserve.cluster.serve.prepare import RequestPreparer
from specserve.cluster.serve.public_proto import request_from_proto
from specserve.protos import specserve_pb2 as pb
from specserve.workers.config.request import SamplingParams, SpecParams
from specserve.workers.errors import InvalidRequestError
from tests.helpers.controls_oracle import hf_controlled_greedy
from tests.helpers.greedy_oracle import PROMPTS
from tests.helpers.pipelines import SERVED_METHODS, run_keyed, served_models

MAX_NEW = 16
EOS = 2
CONTROLS = {
    "repetition_penalty": {"repetition_penalty": 1.8},
    "presence_penalty": {"presence_penalty": 1.5},
    "frequency_penalty": {"frequency_penalty": 1.2},
    "logit_bias+min_tokens": {"logit_bias": {EOS: 100.0, 70: 4.0}, "min_tokens": 5},
    "min_p": {"min_p": 0.5, "repetition_penalty": 1.2},
}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return served_models(tmp_path_factory.mktemp("controls_served"))


def _served(target, draft, head, kind) -> dict:
    """(control, prompt, method) -> its SchedRequest, every request run concurrently through the pipeline."""
    keyed = {(name, prompt, method): (prompt, SamplingParams(max_new_tokens=MAX_NEW, **CONTROLS[name]),
                                      SpecParams(method=method, k=k))
             for name in CONTROLS for prompt in PROMPTS for method, k in SERVED_METHODS[kind]}  # fmt: skip
    return run_keyed(target, draft, head, kind, keyed)


@pytest.mark.parametrize("kind", ["draft model", "eagle head"])
def test_served_greedy_with_each_control_is_identical_to_transformers(models, kind):
    target, draft, head = models
    methods = SERVED_METHODS[kind]
    served = _served(target, draft, head, kind)
    drafted = 0
    for name, controls in CONTROLS.items():
        for prompt in PROMPTS:
            ids = target.tokenizer(prompt)["input_ids"]
            expected = hf_controlled_greedy(target.model, ids, MAX_NEW, controls, [EOS])
            for method, _ in methods:
                req = served[name, prompt, method]
                assert req.state.generated == expected, (name, prompt, method)
                drafted += req.state.stats.drafted
    assert drafted > 0


@pytest.fixture(scope="module")
def preparer(tiny_target):
    app = AppConfig.model_validate({"models": [{"name": "tiny", "target": tiny_target, "draft": "ngram"}]})
    return RequestPreparer(app, {"tiny": (tiny_target, None)})


CONTROL_FIELDS = {"presence_penalty": 0.5, "frequency_penalty": -1.0, "repetition_penalty": 1.3, "min_p": 0.1,
                  "min_tokens": 4}  # fmt: skip


def test_both_edges_carry_every_control_into_the_sampling_params(preparer):
    body = {"prompt": "x", "max_tokens": 8, "logit_bias": {"5": -100, "7": 2.5}, "stop_token_ids": [9],
            **CONTROL_FIELDS}  # fmt: skip
    http = preparer.prepare(oai.parse_completion(body).request).params
    grpc_request = pb.GenerateRequest(prompt="x", sampling=pb.SamplingParams(max_new_tokens=8, **CONTROL_FIELDS))
    grpc_request.sampling.logit_bias.update({5: -100, 7: 2.5})
    grpc_request.stop_token_ids.append(9)
    grpc = preparer.prepare(request_from_proto(grpc_request)).params
    for params in (http, grpc):
        for name, value in CONTROL_FIELDS.items():
            assert getattr(params, name) == pytest.approx(value), name
        assert params.logit_bias == {5: -100.0, 7: 2.5} and params.end_token_ids == (9,)
    plain = preparer.prepare(oai.parse_completion({"prompt": "x"}).request).params
    assert not plain.has_logits_controls and plain.repetition_penalty == 1.0


def test_the_grpc_client_sends_the_controls(preparer):
    controls = {**CONTROL_FIELDS, "logit_bias": {5: -100.0}}
    request = SpecServeClient.request("x", max_new_tokens=8, controls=controls)
    params = preparer.prepare(request_from_proto(request)).params
    assert params.logit_bias == {5: -100.0} and params.min_tokens == 4 and params.min_p == pytest.approx(0.1)


HTTP_BAD = [
    ({"presence_penalty": 2.5}, "presence_penalty"), ({"frequency_penalty": -2.01}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"), ({"repetition_penalty": -1.0}, "repetition_penalty"),
    ({"min_p": 1.5}, "min_p"), ({"min_p": "0.1"}, "min_p"), ({"min_tokens": -1}, "min_tokens"),
    ({"min_tokens": 9, "max_tokens": 8}, "min_tokens"), ({"logit_bias": {"5": 101}}, "logit_bias.5"),
    ({"logit_bias": {"five": 1}}, "logit_bias"), ({"logit_bias": {"-5": 1}}, "logit_bias"),
    ({"logit_bias": {"100000": 1}}, "logit_bias"), ({"logit_bias": {str(i): 1 for i in range(2000)}}, "logit_bias"),
]  # fmt: skip
GRPC_BAD = [
    ({"presence_penalty": 3.0}, "sampling.presence_penalty"),
    ({"frequency_penalty": -3.0}, "sampling.frequency_penalty"),
    ({"repetition_penalty": -0.5}, "sampling.repetition_penalty"), ({"min_p": 2.0}, "sampling.min_p"),
    ({"min_tokens": 9, "max_new_tokens": 8}, "sampling.min_tokens"),
    ({"logit_bias": {5: 150.0}}, "sampling.logit_bias[5]"),
    ({"logit_bias": {-5: 1.0}}, "sampling.logit_bias"), ({"logit_bias": {100000: 1.0}}, "sampling.logit_bias"),
]  # fmt: skip


@pytest.mark.parametrize(("extra", "field"), HTTP_BAD)
def test_bad_http_controls_are_refused_naming_the_field(preparer, extra, field):
    with pytest.raises(InvalidRequestError) as e:
        preparer.prepare(oai.parse_completion({"prompt": "x", **extra}).request)
    assert e.value.field.startswith(field), e.value


@pytest.mark.parametrize(("sampling", "field"), GRPC_BAD)
def test_bad_grpc_controls_are_refused_naming_the_field(preparer, sampling, field):
    sampling = dict(sampling)
    bias = sampling.pop("logit_bias", {})
    request = pb.GenerateRequest(prompt="x", sampling=pb.SamplingParams(**sampling))
    request.sampling.logit_bias.update(bias)
    with pytest.raises(InvalidRequestError) as e:
        preparer.prepare(request_from_proto(request))
    assert e.value.field.startswith(field), e.value
