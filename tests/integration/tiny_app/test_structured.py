"""Structured output through the real Serve application and the `openai` package (issue 43 item 5): chat
response_format json_schema and completions json_object, streamed and not, speculating with a draft model, equal
grammar-constrained target-only decoding (tests/helpers/grammar_oracle.py); gRPC's sampling.response_format through
Serve's proxy; bad values 400 / INVALID_ARGUMENT naming the field."""

import json
import urllib.request

import grpc
import openai
import pytest

from specserve.client import SpecServeClient
from tests.helpers.grammar_oracle import ANY_OBJECT, SCHEMAS, grammar_greedy

pytestmark = pytest.mark.slow

N = 48
PROMPT = "def add(a, b):"
SPEC = {"speculation": {"method": "draft", "k": 4}}
SCHEMA = SCHEMAS["record"]
JSON_SCHEMA = {"type": "json_schema", "json_schema": {"name": "record", "schema": SCHEMA}}


def _expected(target, ids: list[int], schema: dict) -> list[int]:
    return grammar_greedy(target, ids, N, schema)


def _prompt_ids(server, messages: list[dict]) -> list[int]:
    """The chat prompt as the app renders it (vLLM's /tokenize)."""
    body = json.dumps({"model": "tiny", "messages": messages}).encode()
    request = urllib.request.Request(
        server["http"] + "/tokenize", data=body, headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=60) as reply:
        return json.loads(reply.read())["tokens"]


def test_chat_json_schema_streamed_and_not_equals_constrained_target_only(server, oai, target):
    messages = [{"role": "user", "content": "Give me a record."}]
    ids = _prompt_ids(server, messages)
    expected = target.tokenizer.decode(_expected(target, list(ids), SCHEMA), skip_special_tokens=True)
    kw = {"model": "tiny", "messages": messages, "max_tokens": N, "temperature": 0, "response_format": JSON_SCHEMA,
          "extra_body": SPEC}  # fmt: skip
    out = oai.chat.completions.create(**kw)
    assert out.choices[0].message.content == expected and out.specserve["drafted"] > 0
    streamed = "".join(c.choices[0].delta.content or "" for c in oai.chat.completions.create(stream=True, **kw)
                       if c.choices)  # fmt: skip
    assert streamed == expected
    if out.choices[0].finish_reason == "stop":
        json.loads(expected)


def test_completions_json_object_equals_constrained_target_only(oai, target):
    ids = target.tokenizer(PROMPT)["input_ids"]
    expected = target.tokenizer.decode(_expected(target, ids, ANY_OBJECT), skip_special_tokens=True)
    out = oai.completions.create(model="tiny", prompt=PROMPT, max_tokens=N, temperature=0,
                                    extra_body={"response_format": {"type": "json_object"}, **SPEC})  # fmt: skip
    assert out.choices[0].text == expected


def test_grpc_response_format_through_serves_proxy(server, target):
    ids = target.tokenizer(PROMPT)["input_ids"]
    with SpecServeClient(server["grpc"], timeout_s=120) as grpc_client:
        out = grpc_client.generate(PROMPT, max_new_tokens=N, method="draft", k=4, response_format=JSON_SCHEMA)
        with pytest.raises(grpc.RpcError) as e:
            grpc_client.generate(PROMPT, max_new_tokens=2, response_format={"type": "xml"})
    assert out["token_ids"] == _expected(target, ids, SCHEMA)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "sampling.response_format" in e.value.details()


BAD_SCHEMA = {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "no such type"}}}


@pytest.mark.parametrize(("value", "param"), [({"type": "xml"}, "response_format"),
                                              (BAD_SCHEMA, "response_format.json_schema.schema")])  # fmt: skip
def test_bad_response_formats_are_400_naming_the_field(oai, value, param):
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=2,
                                       response_format=value)  # fmt: skip
    assert e.value.status_code == 400 and e.value.body["param"] == param
