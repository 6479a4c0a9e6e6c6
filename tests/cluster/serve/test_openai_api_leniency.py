"""vLLM's leniency at the OpenAI edge, alone (no server): unknown fields ignored and named (refused with `strict`),
at any depth and in bulk, the bounds kept; vLLM's extra fields (chat_template_kwargs, top_k -1,
stream_options.continuous_usage_stats, completions' echo and logprobs up to 20); the rate-limited log of what was
ignored."""

import logging

import pytest

from specserve.cluster.app_config import AppConfig
from specserve.cluster.serve import openai_api as oai
from specserve.cluster.serve.ignored_fields import IgnoredFields
from specserve.cluster.serve.openai_endpoints import parse_tokenize
from specserve.cluster.serve.prepare import RequestPreparer
from specserve.workers.errors import InvalidRequestError
from tests.helpers.generation_models import THINKING_TEMPLATE, save_with_defaults

CHAT = {"messages": [{"role": "user", "content": "hi"}]}


def test_unknown_fields_are_ignored_at_any_depth_and_named():
    body = {"prompt": "x", "foo_bar": 1, "stream_options": {"include_usage": True, "future": 2},
            "speculation": {"method": "ngram", "depth": 3}}  # fmt: skip
    parsed = oai.parse_completion(body)
    assert parsed.ignored == ("foo_bar", "future", "depth") and parsed.include_usage
    assert parsed.request.method == "ngram"
    chat = oai.parse_chat({"messages": [{"role": "user", "content": "x", "reasoning_content": "r"}], "foo": None})
    assert set(chat.ignored) == {"reasoning_content", "foo"}
    assert oai.parse_completion({"prompt": "x"}).ignored == ()
    for strict_body, fields in ((body, {"foo_bar", "stream_options.future", "speculation.depth"}),
                                ({**CHAT, "chat_template_kwargs": {}, "x": 1}, {"x"})):  # fmt: skip
        with pytest.raises(InvalidRequestError) as e:
            (oai.parse_chat if "messages" in strict_body else oai.parse_completion)(strict_body, strict=True)
        assert e.value.field in fields and "unknown field" in e.value.message


def test_many_unknown_fields_cost_little_and_the_bounds_stay():
    parsed = oai.parse_completion({"prompt": "x", **{f"f{i}": 0 for i in range(100_000)}})
    assert len(parsed.ignored) == 16 and parsed.ignored[0] == "f0"  # the first few named
    for body, field in (({"prompt": "x", "junk": 1, "max_tokens": 0}, "max_tokens"),
                        ({"prompt": "x", "junk": 1, "temperature": "hot"}, "temperature"),
                        ({"junk": 1}, "prompt")):  # fmt: skip
        with pytest.raises(InvalidRequestError) as e:
            oai.parse_completion(body)
        assert e.value.field == field


def test_vllms_extra_fields_are_taken():
    p = oai.parse_completion({"prompt": "x", "top_k": -1, "echo": True, "stream": True,
                              "stream_options": {"include_usage": True, "continuous_usage_stats": True}})  # fmt: skip
    assert (p.request.top_k, p.echo, p.continuous_usage, p.ignored) == (0, True, True, ())
    assert oai.parse_completion({"prompt": "x", "logprobs": 20}).request.logprobs == 20
    alone = {"prompt": "x", "stream_options": {"continuous_usage_stats": True}}  # vLLM's: only with include_usage
    assert not oai.parse_completion(alone).continuous_usage
    assert not oai.parse_completion({"prompt": "x", "echo": False, "logprobs": 1}).echo
    chat = oai.parse_chat({**CHAT, "chat_template_kwargs": {"enable_thinking": False, "n": [1, {"a": None}]}})
    assert chat.request.prompt.template_kwargs == {"enable_thinking": False, "n": [1, {"a": None}]}
    with pytest.raises(InvalidRequestError) as e:
        oai.parse_chat({**CHAT, "chat_template_kwargs": ["enable_thinking"]})
    assert e.value.field == "chat_template_kwargs"


@pytest.fixture(scope="module")
def thinking(tiny_target, tmp_path_factory):
    path = save_with_defaults(tiny_target, tmp_path_factory.mktemp("thinking") / "m", {}, THINKING_TEMPLATE)
    app = AppConfig.model_validate({"models": [{"name": "m", "target": path, "draft": "ngram", "device": "cpu"}]})
    return RequestPreparer(app, {"m": (path, None)})


def test_chat_template_kwargs_reach_the_template(thinking):
    tokenizer = thinking.models["m"].tokenizer

    def rendered(body: dict) -> str:
        return tokenizer.decode(thinking.prepare(oai.parse_chat(body).request).prompt_ids)

    assert rendered(CHAT).endswith("<|im_start|>assistant\n")
    assert rendered({**CHAT, "chat_template_kwargs": {"enable_thinking": True}}) == rendered(CHAT)
    assert rendered({**CHAT, "chat_template_kwargs": {"enable_thinking": False}}).endswith("assistant\n<think></think>")
    model, prompt = parse_tokenize({**CHAT, "chat_template_kwargs": {"enable_thinking": False}})
    assert tokenizer.decode(thinking.tokenize(model, prompt)["tokens"]).endswith("<think></think>")
    for key in ("tools", "chat_template", "tokenize", "add_generation_prompt"):
        with pytest.raises(InvalidRequestError) as e:
            thinking.prepare(oai.parse_chat({**CHAT, "chat_template_kwargs": {key: "x"}}).request)
        assert e.value.field == f"chat_template_kwargs.{key}" and "specserve sets" in e.value.message


def test_continuous_usage_rides_on_every_chunk():
    plain = oai.stream_chunk("id", "m", "a", None, chat=False, first=True)
    assert '"usage"' not in plain
    chunk = oai.stream_chunk("id", "m", "a", None, chat=True, first=True, usage=(3, 2))
    assert '"usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}' in chunk


def test_ignored_fields_are_said_at_once_then_at_most_a_minute_apart(caplog):
    now = [0.0]
    ignored = IgnoredFields(every_s=60, clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="specserve.cluster.serve.ignored_fields"):
        assert ignored.note("/v1/completions", ["foo_bar"], "r1")
        assert not ignored.note("/v1/completions", ["foo_bar"], "r2")
        assert not ignored.note("/v1/completions", [], "r3")
        assert ignored.note("/v1/completions", ["other"], "r4")  # a new set: at once
        now[0] = 61.0
        assert ignored.note("/v1/completions", ["foo_bar"], "r5")
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 3 and "ignored unknown fields foo_bar" in lines[0] and "request r1" in lines[0]
    assert "1 more requests sent them" in lines[2] and "http.strict: true" in lines[0]
