"""OpenAI request parsing and response shapes, alone (no server)."""

import json

import pytest

from specserve.cluster import openai_api as oai
from specserve.workers.chat import ChatMessage, ChatPrompt
from specserve.workers.errors import InvalidRequestError


def test_completion_fields_map_to_sampling_and_speculation():
    p = oai.parse_completion({"model": "m", "prompt": "hi", "max_tokens": 5, "temperature": 0, "top_p": 0.9,
                              "seed": 3, "top_k": 7, "speculation": {"method": "ngram", "k": "auto"},
                              "stream": True, "stream_options": {"include_usage": True}, "user": "u"})  # fmt: skip
    assert (p.model, p.prompt, p.stream, p.include_usage) == ("m", "hi", True, True)
    assert p.sampling == {"max_new_tokens": 5, "temperature": 0, "top_p": 0.9, "top_k": 7, "seed": 3}
    assert p.speculation == {"method": "ngram", "k": "auto"}


def test_openai_defaults_sample_at_temperature_one_and_accept_token_prompts():
    p = oai.parse_completion({"prompt": [[1, 2, 3]]})
    assert p.prompt == [1, 2, 3] and p.sampling == {"temperature": 1.0} and p.model == ""


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ([], "body"),
        ({}, "prompt"),
        ({"prompt": ""}, "prompt"),
        ({"prompt": ["a", "b"]}, "prompt"),
        ({"prompt": [1, True]}, "prompt"),
        ({"prompt": "x", "n": 2}, "n"),
        ({"prompt": "x", "stop": ["\n"]}, "stop"),
        ({"prompt": "x", "logprobs": 3}, "logprobs"),
        ({"prompt": "x", "frobnicate": 1}, "frobnicate"),
        ({"prompt": "x", "max_tokens": 1.5}, "max_tokens"),
        ({"prompt": "x", "max_tokens": True}, "max_tokens"),
        ({"prompt": "x", "temperature": "hot"}, "temperature"),
        ({"prompt": "x", "stream": "yes"}, "stream"),
        ({"prompt": "x", "model": 3}, "model"),
        ({"prompt": "x", "speculation": {"method": "draft", "depth": 3}}, "speculation.depth"),
        ({"prompt": "x", "speculation": "fast"}, "speculation"),
    ],
)
def test_bad_completion_requests_name_the_field(body, field):
    with pytest.raises(InvalidRequestError) as e:
        oai.parse_completion(body)
    assert e.value.field == field


def test_chat_messages_become_a_typed_chat_prompt_and_are_validated():
    p = oai.parse_chat({"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]})
    assert p.prompt == ChatPrompt((ChatMessage("system", "be brief"), ChatMessage("user", "hi")))
    for messages, field in (([], "messages"), ([{"role": "robot", "content": "x"}], "messages[0].role"),
                            ([{"role": "user", "content": 3}], "messages[0].content")):  # fmt: skip
        with pytest.raises(InvalidRequestError) as e:
            oai.parse_chat({"messages": messages})
        assert e.value.field == field


def test_response_and_stream_shapes():
    result = {"text": "ab", "finish_reason": "length", "usage": {"prompt_tokens": 3, "completion_tokens": 2},
              "stats": {"rounds": 1}}  # fmt: skip
    r = oai.completion_response("id", "m", result, chat=True)
    assert r["object"] == "chat.completion" and r["choices"][0]["message"] == {"role": "assistant", "content": "ab"}
    assert r["usage"] == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
    chunk = oai.stream_chunk("id", "m", "a", None, chat=True, first=True)
    assert chunk.startswith("data: ") and chunk.endswith("\n\n")
    assert json.loads(chunk[6:])["choices"][0]["delta"] == {"content": "a", "role": "assistant"}
    assert oai.sse("[DONE]") == "data: [DONE]\n\n"
    assert oai.error_body("bad", "invalid_request_error", "x")["error"]["param"] == "x"
