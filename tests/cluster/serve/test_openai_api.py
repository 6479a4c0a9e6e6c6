"""OpenAI request parsing (the pydantic edge models, body reading) and response shapes, alone (no server)."""

import asyncio
import json

import pytest

from specserve.cluster.serve import openai_api as oai
from specserve.cluster.serve.edge import PayloadTooLargeError, Request
from specserve.workers.errors import InvalidRequestError
from specserve.workers.models.chat import ChatMessage, ChatPrompt, ToolCall


def test_completion_fields_map_to_the_typed_request():
    p = oai.parse_completion({"model": "m", "prompt": "hi", "max_tokens": 5, "temperature": 0, "top_p": 0.9,
                              "seed": 3, "top_k": 7, "speculation": {"method": "ngram", "k": "auto"},
                              "stream": True, "stream_options": {"include_usage": True}, "user": "u",
                              "n": 1, "stop": [], "logit_bias": {}, "frequency_penalty": 0.0})  # fmt: skip
    assert (p.stream, p.include_usage) == (True, True)
    assert p.request == Request(model="m", prompt="hi", temperature=0.0, top_p=0.9, top_k=7, seed=3,
                                max_new_tokens=5, method="ngram", k="auto", prompt_field="prompt",
                                max_new_tokens_field="max_tokens", repetition_penalty=None, min_p=None)  # fmt: skip


def test_unset_sampling_fields_are_left_to_the_model_and_max_tokens_to_the_server():
    r = oai.parse_completion({"prompt": [[1, 2, 3]], "temperature": None}).request
    assert (r.prompt, r.temperature, r.top_p, r.top_k, r.model, r.max_new_tokens) == ((1, 2, 3), None, None, None, "",
                                                                                      None)  # fmt: skip
    assert (r.min_p, r.repetition_penalty) == (None, None)  # the model's defaults apply (generation_defaults.py)
    assert oai.parse_completion({"prompt": "x", "top_k": -1}).request.top_k == 0  # vLLM's "off"
    assert oai.parse_completion({"prompt": ["one"]}).request.prompt == "one"
    r = oai.parse_chat({"messages": [{"role": "user", "content": "x"}], "max_tokens": 3, "max_completion_tokens": 9})
    assert (r.request.max_new_tokens, r.request.max_new_tokens_field) == (9, "max_completion_tokens")


SURROGATE = "a\ud800b"
BAD_COMPLETIONS = [
    ([], "body", "must be an object"),
    ("text", "body", "must be an object"),
    ({}, "prompt", "is required"),
    ({"prompt": ""}, "prompt", "at least 1 character"),
    ({"prompt": None}, "prompt", "a string or a list of token ids"),
    ({"prompt": 5}, "prompt", "a string or a list of token ids"),
    ({"prompt": []}, "prompt", "at least 1 item"),
    ({"prompt": ["a", "b"]}, "prompt", "one prompt per request"),
    ({"prompt": [[1], [2]]}, "prompt", "one prompt per request"),
    ({"prompt": [1, True]}, "prompt", "element 1 is not a token id"),
    ({"prompt": [1, 2.0]}, "prompt", "element 1 is not a token id"),
    ({"prompt": [-1]}, "prompt", "element 0 is not a token id"),
    ({"prompt": [2**31]}, "prompt", "element 0 is not a token id"),
    ({"prompt": [True] * 100_000}, "prompt", "element 0 is not a token id"),
    ({"prompt": SURROGATE}, "prompt", "not valid Unicode (a lone UTF-16 surrogate"),
    ({"prompt": [SURROGATE]}, "prompt[0]", "lone UTF-16 surrogate"),
    ({"prompt": "x", "model": SURROGATE}, "model", "lone UTF-16 surrogate"),
    ({"prompt": "x", "user": SURROGATE}, "user", "lone UTF-16 surrogate"),
    ({"prompt": "x", "model": 3}, "model", "valid string"),
    ({"prompt": "x", "model": "m" * 300}, "model", "at most 256 characters"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens", "0 only with echo"),
    ({"prompt": "x", "max_tokens": -5}, "max_tokens", "greater than or equal to 0"),
    ({"prompt": "x", "max_tokens": 1.5}, "max_tokens", "valid integer"),
    ({"prompt": "x", "max_tokens": 2.0}, "max_tokens", "valid integer"),
    ({"prompt": "x", "max_tokens": True}, "max_tokens", "valid integer"),
    ({"prompt": "x", "max_tokens": "10"}, "max_tokens", "valid integer"),
    ({"prompt": "x", "max_completion_tokens": 0}, "max_completion_tokens", "greater than or equal to 1"),
    ({"prompt": "x", "temperature": "hot"}, "temperature", "valid number"),
    ({"prompt": "x", "temperature": True}, "temperature", "valid number"),
    ({"prompt": "x", "temperature": float("nan")}, "temperature", "finite number"),
    ({"prompt": "x", "temperature": float("inf")}, "temperature", "finite number"),
    ({"prompt": "x", "temperature": -1}, "temperature", "greater than or equal to 0"),
    ({"prompt": "x", "temperature": 1e6}, "temperature", "less than or equal to 100"),
    ({"prompt": "x", "top_p": 0}, "top_p", "greater than 0"),
    ({"prompt": "x", "top_p": 1.5}, "top_p", "less than or equal to 1"),
    ({"prompt": "x", "top_p": float("-inf")}, "top_p", "finite number"),
    ({"prompt": "x", "top_k": -2}, "top_k", "greater than or equal to -1"),
    ({"prompt": "x", "top_k": 2**32}, "top_k", "less than or equal to 4294967295"),
    ({"prompt": "x", "top_k": 2**64}, "top_k", "less than or equal to 4294967295"),
    ({"prompt": "x", "top_k": 5.5}, "top_k", "valid integer"),
    ({"prompt": "x", "seed": -1}, "seed", "greater than or equal to 0"),
    ({"prompt": "x", "seed": 2**63}, "seed", "less than 9223372036854775808"),
    ({"prompt": "x", "seed": 2**64 + 1}, "seed", "less than"),
    ({"prompt": "x", "seed": "x"}, "seed", "valid integer"),
    ({"prompt": "x", "stream": "yes"}, "stream", "valid boolean"),
    ({"prompt": "x", "stream": 1}, "stream", "valid boolean"),
    ({"prompt": "x", "stream_options": 5}, "stream_options", "must be an object"),
    ({"prompt": "x", "stream_options": {"include_usage": "yes"}}, "stream_options.include_usage", "valid boolean"),
    ({"prompt": "x", "stream_options": {"bogus": True}}, "stream_options.bogus", "unknown field"),
    ({"prompt": "x", "n": 17}, "n", "less than or equal to 16"),
    ({"prompt": "x", "n": 0}, "n", "greater than or equal to 1"),
    ({"prompt": "x", "n": 2**64}, "n", "less than or equal to 16"),
    ({"prompt": "x", "best_of": 3}, "best_of", "not supported by specserve"),
    ({"prompt": "x", "prompt_logprobs": 1, "stream": True}, "prompt_logprobs", "is not streamed (as vLLM)"),
    ({"prompt": "x", "prompt_logprobs": 21}, "prompt_logprobs", "less than or equal to 20"),
    ({"prompt": "x", "stop": [""]}, "stop[0]", "at least 1 character"),
    ({"prompt": "x", "stop": ["a"] * 100_000}, "stop", "at most 64 items"),
    ({"prompt": "x", "stop_token_ids": [-1, "x"]}, "stop_token_ids[1]", "valid integer"),
    ({"prompt": "x", "stop": [5]}, "stop[0]", "valid string"),
    ({"prompt": "x", "stop": 5}, "stop", "a string or a list of strings"),
    ({"prompt": "x", "logit_bias": {"50256": -101}}, "logit_bias.50256", "greater than or equal to -100"),
    ({"prompt": "x", "logit_bias": {"eos": 1}}, "logit_bias", "keys must be token ids"),
    ({"prompt": "x", "logit_bias": [1, 2]}, "logit_bias", "valid dictionary"),
    ({"prompt": "x", "logit_bias": "none"}, "logit_bias", "valid dictionary"),
    ({"prompt": "x", "logprobs": 21}, "logprobs", "less than or equal to 20"),
    ({"prompt": "x", "logprobs": True}, "logprobs", "valid integer"),
    ({"prompt": "x", "top_logprobs": 2}, "top_logprobs", "completions take logprobs"),
    ({"prompt": "x", "presence_penalty": 3}, "presence_penalty", "less than or equal to 2"),
    ({"prompt": "x", "repetition_penalty": 0}, "repetition_penalty", "greater than 0"),
    ({"prompt": "x", "min_p": 1.01}, "min_p", "less than or equal to 1"),
    ({"prompt": "x", "min_tokens": -1}, "min_tokens", "greater than or equal to 0"),
    ({"prompt": "x", "frequency_penalty": float("nan")}, "frequency_penalty", "finite number"),
    ({"prompt": "x", "suffix": "end"}, "suffix", "not supported by specserve"),
    ({"prompt": "x", "response_format": {"type": "xml"}}, "response_format", '{"type": "json_object"}'),
    ({"prompt": "x", "tools": [{"type": "function"}]}, "tools", "not supported by specserve"),
    ({"prompt": "x", "tool_choice": "auto"}, "tool_choice", "not supported by specserve"),
    ({"prompt": "x", "metadata": {"a": 1}}, "metadata", "string keys"),
    ({"prompt": "x", "frobnicate": 1}, "frobnicate", "unknown field"),
    ({"prompt": "x", "k" * 10_000: 1}, "k" * 64 + "...", "unknown field"),
    ({"prompt": "x", **{f"f{i}": 0 for i in range(100_000)}}, "body", "100000 unknown fields (f0, f1, f2, ...)"),
    ({"prompt": "x", "speculation": "fast"}, "speculation", "must be an object"),
    ({"prompt": "x", "speculation": {"method": "draft", "depth": 3}}, "speculation.depth", "unknown field"),
    ({"prompt": "x", "speculation": {"method": "DRAFT"}}, "speculation.method", "'ngram-tree', 'suffix' or 'none'"),
    ({"prompt": "x", "speculation": {"k": 0}}, "speculation.k", "greater than or equal to 1"),
    ({"prompt": "x", "speculation": {"k": 17}}, "speculation.k", "less than or equal to 16"),
    ({"prompt": "x", "speculation": {"k": "many"}}, "speculation.k", "'auto'"),
    ({"prompt": "x", "speculation": {"k": 2.0}}, "speculation.k", "must be 1..16 or 'auto'"),
]


@pytest.mark.parametrize(
    ("body", "field", "message"), BAD_COMPLETIONS, ids=[str(i) for i in range(len(BAD_COMPLETIONS))]
)
def test_bad_completion_requests_name_the_field_as_sent(body, field, message):
    with pytest.raises(InvalidRequestError) as e:
        oai.parse_completion(body, strict=True)  # unknown fields refused as 400s (http.strict)
    assert e.value.field == field and message in e.value.message, e.value
    assert "Error" not in str(e.value) and "pydantic" not in str(e.value) and "Body" not in str(e.value)
    assert len(str(e.value)) < 400


def test_several_bad_fields_are_named_after_the_first():
    with pytest.raises(InvalidRequestError) as e:
        oai.parse_completion({"prompt": "x", "top_p": 2, "top_k": -2, "seed": "s", "n": 30, "temperature": -1})
    assert e.value.field == "temperature"
    assert "(also: top_p: " in e.value.message and "top_k: " in e.value.message and "and 1 more)" in e.value.message


def user(content) -> dict:
    return {"messages": [{"role": "user", "content": content}]}


def test_chat_messages_become_a_typed_chat_prompt_and_text_parts_are_joined():
    p = oai.parse_chat({"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi",
                                                                                  "name": "ann"}]})  # fmt: skip
    assert p.request.prompt == ChatPrompt((ChatMessage("system", "be brief"), ChatMessage("user", "hi")))
    assert p.request.prompt_field == "messages"
    parts = [{"type": "text", "text": "first"}, {"type": "text", "text": "second"}]
    assert oai.parse_chat(user(parts)).request.prompt == ChatPrompt((ChatMessage("user", "first\nsecond"),))
    loop = [{"role": "user", "content": "x"}, {"role": "assistant", "content": None, "tool_calls": [CALL('{"a": 1}')]},
            {"role": "tool", "tool_call_id": "call_1", "content": [{"type": "text", "text": "42"}]}]  # fmt: skip
    assert oai.parse_chat({"messages": loop}).request.prompt.messages[1:] == (
        ChatMessage("assistant", "", (ToolCall("call_1", "f", '{"a": 1}'),)),
        ChatMessage("tool", "42", (), "call_1"),
    )


def CALL(arguments: str) -> dict:  # noqa: N802 - reads as a constant's constructor in the table
    return {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": arguments}}


BAD_CHATS = [
    ({}, "messages", "is required"),
    ({"messages": []}, "messages", "at least 1 item"),
    ({"messages": "hi"}, "messages", "valid list"),
    ({"messages": [5]}, "messages[0]", "must be an object"),
    ({"messages": [{"role": "user", "content": "x"}] * 5000}, "messages", "at most 4096 items"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role", "'system', 'user', 'assistant'"),
    ({"messages": [{"content": "x"}]}, "messages[0].role", "is required"),
    ({"messages": [{"role": "user"}]}, "messages[0].content", "is required"),
    (user(3), "messages[0].content", "a string or a list of text parts"),
    (user(None), "messages[0].content", "null only beside an assistant's tool_calls"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [{"id": "1"}]}]},
     "messages[0].tool_calls[0].type", "is required"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": []}]}, "messages[0].tool_calls",
     "only assistant messages carry tool_calls"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [CALL("{'a': 1}")]}]},
     "messages[0].tool_calls[0].function.arguments", "is not valid JSON"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [CALL("[1]")]}]},
     "messages[0].tool_calls[0].function.arguments", "must be a JSON object, not a array"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id", "is required in a tool message"),
    ({"messages": [{"role": "user", "content": "x", "tool_call_id": "1"}]}, "messages[0].tool_call_id",
     "goes only with role 'tool'"),
    (user([]), "messages[0].content", "at least 1 item"),
    (user([5]), "messages[0].content[0]", "must be a content part object"),
    (user([{"text": "a"}]), "messages[0].content[0].type", "is required"),
    (user([{"type": "text"}]), "messages[0].content[0].text", "is required"),
    (user([{"type": "text", "text": 5}]), "messages[0].content[0].text", "valid string"),
    (user([{"type": "text", "text": "a", "extra": 1}]), "messages[0].content[0].extra", "unknown field"),
    (user([{"type": "text", "text": "a"}, {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]),
     "messages[0].content[1].type", "'image_url' content parts are not supported"),
    (user([{"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}]), "messages[0].content[0].type",
     "'input_audio' content parts are not supported"),
    (user([{"type": "file", "file": {}}]), "messages[0].content[0].type", "'file' content parts are not supported"),
    (user([{"type": 7}]), "messages[0].content[0].type", "a integer content parts are not supported"),
    (user([{"type": "text", "text": "a"}] * 300), "messages[0].content", "at most 256 items"),
    (user(SURROGATE), "messages[0].content", "lone UTF-16 surrogate"),
    (user([{"type": "text", "text": SURROGATE}]), "messages[0].content[0].text", "lone UTF-16 surrogate"),
    ({"messages": [{"role": "user", "content": "x", "name": SURROGATE}]}, "messages[0].name", "lone UTF-16"),
    ({**user("x"), "logprobs": 1}, "logprobs", "valid boolean"),
    ({**user("x"), "logprobs": True, "top_logprobs": 21}, "top_logprobs", "less than or equal to 20"),
    ({**user("x"), "top_logprobs": 2}, "top_logprobs", "needs logprobs: true"),
    ({**user("x"), "logprobs": False, "top_logprobs": 2}, "top_logprobs", "needs logprobs: true"),
    ({**user("x"), "prompt": "x"}, "prompt", "unknown field"),
]  # fmt: skip


@pytest.mark.parametrize(("body", "field", "message"), BAD_CHATS, ids=[str(i) for i in range(len(BAD_CHATS))])
def test_bad_chat_requests_name_the_field_as_sent(body, field, message):
    with pytest.raises(InvalidRequestError) as e:
        oai.parse_chat(body, strict=True)
    assert e.value.field == field and message in e.value.message, e.value


async def chunks(*parts: bytes):
    for p in parts:
        yield p


@pytest.mark.parametrize(
    ("parts", "declared", "error", "message"),
    [
        ((b'{"prompt": "x"}',), None, None, None),
        ((b"{" * 20,), "99999999999999999999999", PayloadTooLargeError, "exceed the limit of 64"),
        ((b"x" * 40, b"x" * 40), None, PayloadTooLargeError, "longer than the limit of 64"),
        ((b"x" * 65,), "", PayloadTooLargeError, "longer than the limit"),
        ((b'{"a": "\xff"}',), None, InvalidRequestError, "not valid UTF-8 (at byte 7)"),
        ((b"{prompt: x",), None, InvalidRequestError, "not valid JSON"),
        ((b"",), None, InvalidRequestError, "not valid JSON"),
    ],
)
def test_request_bodies_are_read_up_to_the_limit(parts, declared, error, message):
    if error is None:
        assert asyncio.run(oai.read_json(chunks(*parts), declared, 64)) == {"prompt": "x"}
        return
    with pytest.raises(error) as e:
        asyncio.run(oai.read_json(chunks(*parts), declared, 64))
    assert e.value.field == "body" and message in e.value.message


def test_deep_nesting_and_huge_numbers_are_bad_bodies_not_crashes():
    for raw, message in ((b"[" * 100_000 + b"]" * 100_000, "nests"), (b'{"seed": ' + b"9" * 5000 + b"}", "number"),
                         (b'{"a": ' + b'{"b": ' * 50_000 + b"1" + b"}" * 50_001, "nests")):  # fmt: skip
        with pytest.raises(InvalidRequestError) as e:
            asyncio.run(oai.read_json(chunks(raw), None, 1 << 20))
        assert e.value.field == "body" and message in e.value.message
    body = asyncio.run(oai.read_json(chunks(b'{"prompt": "\\ud800", "temperature": NaN}'), None, 100))
    with pytest.raises(InvalidRequestError) as e:  # JSON's NaN and lone surrogates reach the model, which names them
        oai.parse_completion(body)
    assert e.value.field == "temperature" and "prompt: is not valid Unicode" in e.value.message


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
