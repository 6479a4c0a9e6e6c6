"""Structured output served: through the scheduler, its gRPC pipeline and real gRPC draft and target workers (the
response_format crosses the internal SamplingParams; the target worker keeps the request's matcher next to its KV
cache), greedy output identical to grammar-constrained target-only decoding on the draft-model, prompt-lookup,
suffix, tree and head paths; and both public edges turn response_format into the request's SamplingParams, refusing
bad values with 400 / INVALID_ARGUMENT naming the field as the client wrote it."""

import json

import pytest

from specserve.client import SpecServeClient
from specserve.cluster.app_config import AppConfig
from specserve.cluster.serve import openai_api as oai
from specserve.cluster.serve.prepare import RequestPreparer
from specserve.cluster.serve.public_proto import request_from_proto
from specserve.protos import specserve_pb2 as pb
from specserve.workers.config.request import ResponseFormat, SamplingParams, SpecParams
from specserve.workers.errors import InvalidRequestError
from tests.helpers.grammar_oracle import ANY_OBJECT, SCHEMAS, grammar_greedy
from tests.helpers.greedy_oracle import PROMPTS
from tests.helpers.pipelines import SERVED_METHODS, run_keyed, served_models

MAX_NEW = 48
FORMATS = {"record": ResponseFormat(type="json_schema", json_schema=json.dumps(SCHEMAS["record"])),
           "json_object": ResponseFormat(type="json_object")}  # fmt: skip
SCHEMA_OF = {"record": SCHEMAS["record"], "json_object": ANY_OBJECT}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return served_models(tmp_path_factory.mktemp("grammar_served"))


def _served(target, draft, head, kind) -> dict:
    """(format, prompt, method) -> its SchedRequest, every request run concurrently through the pipeline."""
    keyed = {(name, prompt, method): (prompt, SamplingParams(max_new_tokens=MAX_NEW, response_format=FORMATS[name]),
                                      SpecParams(method=method, k=k))
             for name in FORMATS for prompt in PROMPTS[:2] for method, k in SERVED_METHODS[kind]}  # fmt: skip
    return run_keyed(target, draft, head, kind, keyed)


@pytest.mark.parametrize("kind", ["draft model", "eagle head"])
def test_served_greedy_under_a_grammar_is_identical_to_constrained_target_only(models, kind):
    target, draft, head = models
    methods = SERVED_METHODS[kind]
    served = _served(target, draft, head, kind)
    drafted = accepted = 0
    for name in FORMATS:
        for prompt in PROMPTS[:2]:
            expected = grammar_greedy(target, target.tokenizer(prompt)["input_ids"], MAX_NEW, SCHEMA_OF[name])
            for method, _ in methods:
                req = served[name, prompt, method]
                assert req.state.generated == expected, (name, prompt, method)
                drafted, accepted = drafted + req.state.stats.drafted, accepted + req.state.stats.accepted
    assert drafted > accepted > 0


@pytest.fixture(scope="module")
def preparer(tiny_target):
    app = AppConfig.model_validate({"models": [{"name": "tiny", "target": tiny_target, "draft": "ngram"}]})
    return RequestPreparer(app, {"tiny": (tiny_target, None)})


SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def test_both_edges_carry_the_response_format_into_the_sampling_params(preparer):
    wanted = ResponseFormat(type="json_schema", json_schema=json.dumps(SCHEMA, separators=(",", ":")))
    chat = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 8}
    body = {**chat, "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}}
    assert preparer.prepare(oai.parse_chat(body).request).params.response_format == wanted
    body = {"prompt": "x", "response_format": {"type": "json_object"}}
    assert preparer.prepare(oai.parse_completion(body).request).params.response_format.type == "json_object"
    for neutral in ({"type": "text"}, None):
        params = preparer.prepare(oai.parse_chat({**chat, "response_format": neutral}).request).params
        assert params.response_format is None
    grpc_format = pb.ResponseFormat(type="json_schema", json_schema=json.dumps(SCHEMA))
    request = pb.GenerateRequest(prompt="x", sampling=pb.SamplingParams(response_format=grpc_format))
    assert preparer.prepare(request_from_proto(request)).params.response_format == wanted
    request = pb.GenerateRequest(prompt="x", sampling=pb.SamplingParams(response_format=pb.ResponseFormat(type="text")))
    assert preparer.prepare(request_from_proto(request)).params.response_format is None
    sent = {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}
    request = SpecServeClient.request("x", max_new_tokens=8, response_format=sent)  # the Python client
    assert preparer.prepare(request_from_proto(request)).params.response_format == wanted


HTTP_BAD = [
    ({"type": "xml"}, "response_format"), ("json", "response_format"), ({}, "response_format"),
    ({"type": "json_schema"}, "response_format.json_schema"),
    ({"type": "json_schema", "json_schema": {"schema": SCHEMA}}, "response_format.json_schema.name"),
    ({"type": "json_schema", "json_schema": {"name": "a"}}, "response_format.json_schema.schema"),
    ({"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "no such type"}}},
     "response_format.json_schema.schema"),
    ({"type": "json_schema", "json_schema": {"name": "a", "schema": [1]}}, "response_format.json_schema.schema"),
    ({"type": "json_object", "extra": 1}, "response_format.extra"),
]  # fmt: skip
GRPC_BAD = [
    ({"type": "xml"}, "sampling.response_format.type"),
    ({"type": "json_schema", "json_schema": "{not json"}, "sampling.response_format"),
    ({"type": "json_schema", "json_schema": "[1]"}, "sampling.response_format"),
    ({"type": "json_schema", "json_schema": '{"type": "no such type"}'}, "sampling.response_format"),
    ({"type": "json_object", "json_schema": "{}"}, "sampling.response_format"),
    ({"type": "json_schema"}, "sampling.response_format"),
]


@pytest.mark.parametrize(("value", "field"), HTTP_BAD)
def test_bad_http_response_formats_are_refused_naming_the_field(preparer, value, field):
    for parse, body in ((oai.parse_chat, {"messages": [{"role": "user", "content": "x"}]}),
                        (oai.parse_completion, {"prompt": "x"})):  # fmt: skip
        with pytest.raises(InvalidRequestError) as e:
            parse({**body, "response_format": value}, strict=True)  # unknown keys refused (else ignored)
        assert e.value.field == field, e.value


@pytest.mark.parametrize(("value", "field"), GRPC_BAD)
def test_bad_grpc_response_formats_are_refused_naming_the_field(preparer, value, field):
    request = pb.GenerateRequest(prompt="x", sampling=pb.SamplingParams(response_format=pb.ResponseFormat(**value)))
    with pytest.raises(InvalidRequestError) as e:
        request_from_proto(request)
    assert e.value.field == field, e.value
