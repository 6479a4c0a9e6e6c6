"""Tools on chat completions (issue 43 item 6): on a tiny model whose chat template renders tools, a named
`tool_choice` and `"required"` forced through the grammar (the function's parameters as the response_format) and the
output parsed into `tool_calls` whose arguments validate against the parameters; `"auto"` parsing the Hermes calls an
output writes (as vLLM's hermes parser), on a template that writes them; a tool loop's history (an assistant's calls,
a tool's result) rendered by a template that takes them, arguments as objects; a template without tools (plain
ChatML, as SmolLM2's) refuses `tools` and tool turns naming them; the other bad values are 400 naming the field."""

import json

import jsonschema
import pytest
from transformers import AutoTokenizer

from specserve.cluster.app_config import AppConfig
from specserve.cluster.serve import openai_api as oai
from specserve.cluster.serve.openai_endpoints import parse_tokenize
from specserve.cluster.serve.openai_tools import ForcedCalls, ToolStream, hermes_calls, with_tool_calls
from specserve.cluster.serve.prepare import RequestPreparer
from specserve.workers.config.settings import ModelConfig
from specserve.workers.errors import InvalidRequestError
from specserve.workers.models.chat import ChatMessage, ToolCall, chat_text
from specserve.workers.runtime.loading import load_model
from specserve.workers.speculation.engine import SpecEngine
from tests.helpers.gguf_files import CHATML_TEMPLATE
from tests.helpers.tool_models import CALL_TEXT, HERMES_TEMPLATE, QUESTION, WEATHER, tool_loop
from tests.helpers.workers import save_tiny_llama

TOOLS_TEMPLATE = (
    "{% if tools %}<tools>{{ tools | tojson }}</tools>\n{% endif %}{% for m in messages %}"
    "{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"
)
PARAMS = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}, "days": {"enum": [1, 2, 3]}},
          "required": ["city", "days"], "additionalProperties": False}  # fmt: skip
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather", "parameters": PARAMS}},
         {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {
             "zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"], "additionalProperties": False}}}]  # fmt: skip
NAMED = {"type": "function", "function": {"name": "get_weather"}}
MESSAGES = [{"role": "user", "content": "Weather in Paris?"}]


def _with_template(root, name: str, template: str) -> str:
    path = save_tiny_llama(root / name, seed=4, layers=2, hidden=32, max_positions=2048)  # tools take ~500 bytes
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    tokenizer.chat_template = template
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("tools")
    return {
        "tools": _with_template(root, "tools", TOOLS_TEMPLATE),
        "chatml": _with_template(root, "chatml", CHATML_TEMPLATE),
        "hermes": _with_template(root, "hermes", HERMES_TEMPLATE),
    }


@pytest.fixture(scope="module")
def preparer(paths):
    app = AppConfig.model_validate({"models": [{"name": n, "target": p, "draft": "ngram"} for n, p in paths.items()]})
    return RequestPreparer(app, {n: (p, None) for n, p in paths.items()})


def _chat(**fields) -> dict:
    return {"model": "tools", "messages": MESSAGES, "max_tokens": 64, "temperature": 0, **fields}


@pytest.mark.parametrize("choice", [NAMED, "required"])
def test_a_forced_call_is_decoded_under_its_grammar_and_parsed_into_tool_calls(paths, preparer, choice):
    most = 400 if choice == NAMED else 1200  # a random model spaces a lot (and may call several times)
    parsed = oai.parse_chat(_chat(tools=TOOLS, tool_choice=choice, max_tokens=most))
    prepared = preparer.prepare(parsed.request)
    tokenizer = preparer.models["tools"].tokenizer
    assert "get_weather" in tokenizer.decode(prepared.prompt_ids)  # the template rendered the tools
    assert prepared.params.response_format is not None
    engine = SpecEngine(load_model(ModelConfig(path=paths["tools"], device="cpu")))
    result = engine.generate(prepared.prompt_ids, prepared.params, prepared.spec).to_dict()
    response = with_tool_calls(oai.completion_response("r", "tools", {**result, "usage": {
        "prompt_tokens": 1, "completion_tokens": 1}}, chat=True), parsed.request.tool_calls)  # fmt: skip
    choice_out = response["choices"][0]
    assert result["finish_reason"] == "stop" and choice_out["finish_reason"] == "tool_calls"
    calls = choice_out["message"]["tool_calls"]
    assert choice_out["message"]["content"] is None and calls
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for call in calls:
        assert call["type"] == "function" and call["id"].startswith("call_")
        jsonschema.validate(json.loads(call["function"]["arguments"]), schemas[call["function"]["name"]])
    if choice == NAMED:
        assert [c["function"]["name"] for c in calls] == ["get_weather"]


def test_an_output_cut_short_stays_text():
    response = {"choices": [{"index": 0, "message": {"role": "assistant", "content": '{"city": "Pa'},
                             "finish_reason": "length"}]}  # fmt: skip
    out = with_tool_calls(response, ForcedCalls("get_weather"))
    assert (
        out["choices"][0]["message"]["content"] == '{"city": "Pa' and "tool_calls" not in out["choices"][0]["message"]
    )


BAD = [
    ({"tools": TOOLS, "tool_choice": "auto"}, "tool_choice"), ({"tools": TOOLS}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice.function.name"),
    ({"tools": TOOLS, "tool_choice": NAMED, "response_format": {"type": "json_object"}}, "response_format"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "retrieval"}], "tool_choice": "required"}, "tools[0].type"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
]  # fmt: skip


@pytest.mark.parametrize(("fields", "field"), BAD)
def test_bad_tool_requests_are_refused_naming_the_field(preparer, fields, field):
    with pytest.raises(InvalidRequestError) as e:
        preparer.prepare(oai.parse_chat(_chat(**fields)).request)
    assert e.value.field == field, e.value


def test_a_template_without_tools_refuses_them_naming_tools(preparer):
    with pytest.raises(InvalidRequestError) as e:
        preparer.prepare(oai.parse_chat(_chat(model="chatml", tools=TOOLS, tool_choice=NAMED)).request)
    assert e.value.field == "tools" and "template takes no tools" in e.value.message
    with pytest.raises(InvalidRequestError) as e:  # tool_choice "auto", the default: the template is said first
        preparer.prepare(oai.parse_chat(_chat(model="chatml", tools=TOOLS)).request)
    assert e.value.field == "tools"
    plain = preparer.prepare(oai.parse_chat(_chat(model="chatml", tools=TOOLS, tool_choice="none")).request)
    assert plain.params.response_format is None  # "none": the tools are dropped, free text
    with pytest.raises(InvalidRequestError) as e:
        oai.parse_completion({"prompt": "x", "tools": TOOLS})
    assert e.value.field == "tools"


HERMES_OUTPUTS = [
    (CALL_TEXT, (None, [("get_weather", '{"city": "Paris"}')])),
    ('Let me look.\n<tool_call>{"name": "a", "arguments": {}}</tool_call>\n<tool_call>{"name": "b", "arguments": '
     '{"x": [1, "é"]}}</tool_call> trailing', ("Let me look.\n", [("a", "{}"), ("b", '{"x": [1, "é"]}')])),
    ('<tool_call>{"name": "a", "arguments": {"k": 1}}', (None, [("a", '{"k": 1}')])),  # the last one unclosed
    ("plain text", None),
    ('<tool_call>{"name": "a", "arguments": {</tool_call>', None),  # no JSON: stays text
    ('<tool_call>{"arguments": {}}</tool_call>', None),  # no name
    ('<tool_call>["a"]</tool_call>', None),
]  # fmt: skip


@pytest.mark.parametrize(("text", "calls"), HERMES_OUTPUTS)
def test_hermes_calls_are_read_as_vllms_hermes_parser_reads_them(text, calls):
    assert hermes_calls(text) == calls


def test_auto_turns_a_whole_output_that_writes_calls_into_tool_calls_and_leaves_the_rest_text():
    def answer(text, finish):
        return {"choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish}]}

    (choice,) = with_tool_calls(answer("Sure. " + CALL_TEXT, "stop"), ForcedCalls(None, auto=True))["choices"]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == "Sure. "
    ((call,),) = [choice["message"]["tool_calls"]]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    for text, finish in (("no call", "stop"), (CALL_TEXT, "length")):
        (choice,) = with_tool_calls(answer(text, finish), ForcedCalls(None, auto=True))["choices"]
        assert (choice["message"]["content"], choice["finish_reason"]) == (text, finish)
        assert "tool_calls" not in choice["message"]


def test_a_tool_loop_renders_through_the_template_with_its_arguments_as_objects(preparer):
    loop = tool_loop("call_7")
    parsed = oai.parse_chat({**_chat(model="hermes", messages=loop, tools=[WEATHER])})
    prepared = preparer.prepare(parsed.request)
    tokenizer = preparer.models["hermes"].tokenizer
    rows = [dict(m) for m in loop]
    rows[1] = {**rows[1], "content": "", "tool_calls": [{**rows[1]["tool_calls"][0], "function": {
        "name": "get_weather", "arguments": {"city": "Paris"}}}]}  # fmt: skip
    want = tokenizer.apply_chat_template(rows, tools=[WEATHER], tokenize=False, add_generation_prompt=True)
    assert prepared.prompt_ids == tokenizer(want, add_special_tokens=False)["input_ids"]
    assert CALL_TEXT in want and "<tool_response>\nsunny" in want  # the call as the model writes it, the result
    assert parsed.request.tool_calls == ForcedCalls(None, auto=True)  # "auto": Hermes calls parsed
    model, prompt = parse_tokenize({"model": "hermes", "messages": loop, "tools": [WEATHER]})
    assert preparer.tokenize(model, prompt)["tokens"] == prepared.prompt_ids  # vLLM's /tokenize renders them alike


def test_a_template_that_adds_arguments_to_text_gets_them_as_text(paths):
    tokenizer = AutoTokenizer.from_pretrained(paths["tools"], local_files_only=True)
    tokenizer.chat_template = ("{% for m in messages %}{% for c in m.tool_calls or [] %}{{ 'call ' + c.function.name "
                               "+ ' ' + c.function.arguments }}{% endfor %}{% endfor %}")  # fmt: skip
    call = ChatMessage("assistant", "", (ToolCall("c", "f", '{"a": 1}'),))
    assert chat_text(tokenizer, [ChatMessage("user", "x"), call]) == 'call f {"a": 1}'


def test_tool_turns_on_a_template_without_them_are_refused_naming_the_message(paths, preparer):
    tool_result = [*QUESTION, {"role": "tool", "tool_call_id": "c", "content": "42"}]
    cases = [("chatml", tool_loop("c"), "messages[1].tool_calls"), ("chatml", tool_result, "messages[1].role"),
             ("tools", tool_loop("c"), "messages[1].tool_calls")]  # fmt: skip
    for model, messages, field in cases:
        with pytest.raises(InvalidRequestError) as e:
            preparer.prepare(oai.parse_chat(_chat(model=model, messages=messages)).request)
        assert e.value.field == field and "template renders no tool" in e.value.message, e.value
    tokenizer = AutoTokenizer.from_pretrained(paths["tools"], local_files_only=True)
    tokenizer.chat_template = "{{ raise_exception('roles must alternate') }}"
    with pytest.raises(InvalidRequestError) as e:  # a template's own refusal is a 400 naming messages, not a 500
        chat_text(tokenizer, [ChatMessage("user", "x")])
    assert e.value.field == "messages" and "roles must alternate" in e.value.message


def test_auto_is_refused_with_a_response_format(preparer):
    with pytest.raises(InvalidRequestError) as e:
        body = _chat(model="hermes", tools=[WEATHER], response_format={"type": "json_object"})
        preparer.prepare(oai.parse_chat(body).request)
    assert e.value.field == "response_format", e.value


AUTO = ForcedCalls(None, auto=True)
STREAMS = [
    (AUTO, ["Sure. <to", 'ol_call>\n{"name": "get_weather", ', '"arguments": {"city": "Paris"}}\n</tool_call>'], "stop",
     ["Sure. ", "", ""], "tool_calls"),
    (AUTO, ["a <b", "c <t", "x"], "stop", ["a <b", "c ", "<tx"], "stop"),  # held only while it could begin <tool_call>
    (AUTO, ["ok <tool", ""], "stop", ["ok ", "<tool"], "stop"),  # released at the end
    (AUTO, ["<tool_call>{bad", "</tool_call>"], "stop", ["", "<tool_call>{bad</tool_call>"], "stop"),  # no call parses
    (AUTO, [CALL_TEXT[:20], CALL_TEXT[20:]], "length", ["", CALL_TEXT], "length"),  # cut short: text
    (ForcedCalls("get_weather"), ['{"city"', ': "Paris"}'], "stop", ["", ""], "tool_calls"),  # forced: all kept
    (ForcedCalls("get_weather"), ['{"city"', ': "Pa'], "length", ["", '{"city": "Pa'], "length"),
]  # fmt: skip


@pytest.mark.parametrize(("calls", "texts", "finish", "sent", "sent_finish"), STREAMS)
def test_a_streamed_answer_sends_text_as_it_comes_and_its_calls_whole_at_the_end(calls, texts, finish, sent,
                                                                                  sent_finish):  # fmt: skip
    stream = ToolStream(calls)
    steps = [stream.step(t, finish if i == len(texts) - 1 else None) for i, t in enumerate(texts)]
    assert [s[0] for s in steps] == sent and steps[-1][1] == sent_finish
    assert all(s[2] is None for s in steps[:-1])
    if sent_finish == "tool_calls":
        ((call,),) = [steps[-1][2]]
        assert call["index"] == 0 and call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    else:
        assert steps[-1][2] is None
