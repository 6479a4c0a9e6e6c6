"""Tool calls and gRPC `n` through the real Serve application (the package's, its model "caller") (issue 43 items 3, 6,
8), on a tiny model whose chat template renders tools in Hermes' syntax and which was trained to call one
(tests/helpers/tool_models.py), speculating with a draft model: with the `openai` package, `tool_choice` "auto"
parses the call the model wrote into `tool_calls` (the output target-only decoding gives), streamed as `tool_calls`
deltas, and the loop a client then sends back (the assistant's call, the tool's result) renders through the template
and is answered; gRPC `n` answers every choice (each equal to its own request, seeded seed + index), streamed with
each message's index; bad values 400 / INVALID_ARGUMENT naming the field."""

import json

import grpc
import openai
import pytest

from specserve.cluster.serve.openai_tools import hermes_calls
from specserve.workers.config.request import SamplingParams, SpecParams
from specserve.workers.config.settings import ModelConfig
from specserve.workers.models.chat import ChatMessage, chat_prompt_ids
from specserve.workers.runtime.loading import load_model
from specserve.workers.speculation.engine import SpecEngine
from tests.helpers.tool_models import ANSWER, CALL_ARGUMENTS, CALL_TEXT, QUESTION, WEATHER

pytestmark = pytest.mark.slow

SPEC = {"speculation": {"method": "draft", "k": 3}}  # a fixed k: what a seed draws does not follow the load
N = 16


def test_auto_parses_the_call_the_model_wrote_and_the_loop_sent_back_is_answered(oai, caller):
    engine = SpecEngine(load_model(ModelConfig(path=caller, device="cpu")))
    prompt = chat_prompt_ids(engine.target.tokenizer, [ChatMessage("user", QUESTION[0]["content"])], [WEATHER])
    alone = engine.generate(prompt, SamplingParams(max_new_tokens=100), SpecParams(method="none"))
    assert alone.text == CALL_TEXT  # target-only decoding writes the call

    first = oai.chat.completions.create(model="caller", messages=QUESTION, tools=[WEATHER], temperature=0,
                                        max_tokens=100, extra_body=SPEC)  # fmt: skip
    (choice,) = first.choices
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert (call.type, call.function.name) == ("function", "get_weather")
    assert [(call.function.name, call.function.arguments)] == hermes_calls(alone.text)[1]
    assert first.specserve["drafted"] > 0  # speculation stayed on

    # the client's loop: its call back, with the tool's result (the openai package's own message shapes)
    loop = [*QUESTION, choice.message.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}]  # fmt: skip
    second = oai.chat.completions.create(model="caller", messages=loop, tools=[WEATHER], temperature=0,
                                         max_tokens=100, extra_body=SPEC)  # fmt: skip
    assert (second.choices[0].message.content, second.choices[0].finish_reason) == (ANSWER, "stop")
    as_object = {"name": "get_weather", "arguments": json.loads(call.function.arguments)}  # as templates take it
    calls = [{"id": call.id, "type": "function", "function": as_object}]
    sent = {"role": "assistant", "content": "", "tool_calls": calls}
    rows = [*QUESTION, sent, loop[2]]
    rendered = engine.target.tokenizer.apply_chat_template(rows, tools=[WEATHER], tokenize=False,
                                                           add_generation_prompt=True)  # fmt: skip
    assert second.usage.prompt_tokens == len(engine.target.tokenizer(rendered, add_special_tokens=False)["input_ids"])

    plain = oai.chat.completions.create(model="caller", messages=QUESTION, tools=[WEATHER], tool_choice="none",
                                        temperature=0, max_tokens=8)  # fmt: skip
    assert plain.choices[0].message.tool_calls is None
    with pytest.raises(openai.BadRequestError) as err:
        oai.chat.completions.create(model="caller", messages=[{"role": "tool", "content": "x"}], max_tokens=4)
    assert err.value.body["param"] == "messages[0].tool_call_id"


def test_a_streamed_auto_answer_sends_the_call_as_tool_calls_deltas(oai):
    stream = oai.chat.completions.create(model="caller", messages=QUESTION, tools=[WEATHER], temperature=0,
                                         max_tokens=100, stream=True, n=2, extra_body=SPEC)  # fmt: skip
    content, calls, finish = {0: "", 1: ""}, {0: [], 1: []}, {}
    for chunk in stream:
        for choice in chunk.choices:
            content[choice.index] += choice.delta.content or ""
            calls[choice.index] += choice.delta.tool_calls or []
            finish[choice.index] = choice.finish_reason or finish.get(choice.index)
    assert content == {0: "", 1: ""} and finish == {0: "tool_calls", 1: "tool_calls"}  # nothing of the call as text
    for i in (0, 1):
        ((call,),) = [calls[i]]
        assert (call.index, call.type, call.function.name) == (0, "function", "get_weather")
        assert json.loads(call.function.arguments) == CALL_ARGUMENTS and call.id.startswith("call_")


def test_grpc_n_answers_every_choice_each_equal_to_its_own_request(client):
    greedy = client.generate("def add(a, b):", max_new_tokens=N, method="draft", k=3, n=2)
    alone = client.generate("def add(a, b):", max_new_tokens=N, method="draft", k=3)
    assert [c["index"] for c in greedy["choices"]] == [0, 1]
    assert [c["token_ids"] for c in greedy["choices"]] == [alone["token_ids"]] * 2

    kw = {"max_new_tokens": 8, "temperature": 1.0, "method": "draft", "k": 3}
    sampled = client.generate("class Stack:", seed=40, n=3, **kw)["choices"]
    each = [client.generate("class Stack:", seed=40 + i, **kw) for i in range(3)]
    assert [c["token_ids"] for c in sampled] == [e["token_ids"] for e in each]  # choice i: seed + i
    assert len({tuple(c["token_ids"]) for c in sampled}) > 1

    streamed: dict[int, list[int]] = {0: [], 1: []}
    finished = set()
    for chunk in client.generate_stream("class Stack:", seed=40, n=2, **kw):
        streamed[chunk["index"]] += chunk["token_ids"]
        if chunk["finish_reason"]:
            finished.add(chunk["index"])
    assert finished == {0, 1} and [streamed[0], streamed[1]] == [c["token_ids"] for c in sampled[:2]]
    for call in (client.generate, lambda *a, **k: list(client.generate_stream(*a, **k))):
        with pytest.raises(grpc.RpcError) as e:
            call("x", max_new_tokens=2, n=17)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "n:" in e.value.details()
