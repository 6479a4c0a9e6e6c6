"""Logprobs through the real Serve application and the `openai` package (issue 43 item 2): chat logprobs and
top_logprobs, completions logprobs, streamed and not, the prompt's (echo with logprobs, vLLM's prompt_logprobs; issue 55
item 3), speculating with a draft model; every value equals what
target-only decoding computes for the same tokens (a teacher-forced forward, ATOL in float32), and bad values are 400
naming the field."""

import grpc
import openai
import pytest
import torch

from specserve.client import SpecServeClient
from specserve.workers.config.request import SamplingParams, SpecParams
from specserve.workers.models.chat import chat_prompt_ids, conversation
from specserve.workers.speculation.engine import SpecEngine
from specserve.workers.speculation.logprobs import TokenLogprob
from tests.helpers.logprobs_oracle import ATOL, assert_logprobs_match, target_logprobs

pytestmark = pytest.mark.slow

N = 16
PROMPT = "def add(a, b):"
SPEC = {"speculation": {"method": "draft", "k": 4}}


def test_grpc_logprobs_through_serves_proxy_equal_target_only(server, target):
    with SpecServeClient(server["grpc"], timeout_s=120) as client:
        out = client.generate(PROMPT, max_new_tokens=N, method="draft", k=4, logprobs=2)
        chunks = list(client.generate_stream(PROMPT, max_new_tokens=N, method="draft", k=4, logprobs=2))
        with pytest.raises(grpc.RpcError) as e:
            client.generate(PROMPT, max_new_tokens=2, logprobs=21)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "sampling.logprobs" in e.value.details()
    expected = target_logprobs(target.model, target.tokenizer(PROMPT)["input_ids"], out["token_ids"])
    logprobs = [TokenLogprob(t["logprob"], tuple(map(tuple, t["top"]))) for t in out["logprobs"]]
    assert_logprobs_match(out["token_ids"], logprobs, expected, 2)
    assert [t for c in chunks for t in c["logprobs"]] == out["logprobs"]


def _close(values: list[float], expected: list[float]) -> bool:
    return len(values) == len(expected) and all(abs(a - b) <= ATOL for a, b in zip(values, expected, strict=True))


def test_completions_logprobs_equal_target_only_streamed_and_not(oai, target):
    out = oai.completions.create(model="tiny", prompt=PROMPT, max_tokens=N, temperature=0, logprobs=3,
                                 extra_body=SPEC)  # fmt: skip
    logprobs = out.choices[0].logprobs
    ids = SpecEngine(target).generate(PROMPT, SamplingParams(max_new_tokens=N), SpecParams(method="none")).token_ids
    expected = target_logprobs(target.model, target.tokenizer(PROMPT)["input_ids"], ids)
    assert len(logprobs.tokens) == out.usage.completion_tokens == len(ids)
    assert _close(logprobs.token_logprobs, [float(expected[i, t]) for i, t in enumerate(ids)])
    texts = [target.tokenizer.decode([t]) for t in ids]
    assert logprobs.tokens == texts and logprobs.text_offset == [sum(map(len, texts[:i])) for i in range(len(ids))]
    stream = oai.completions.create(model="tiny", prompt=PROMPT, max_tokens=N, temperature=0, logprobs=3, stream=True,
                                    extra_body=SPEC)  # fmt: skip
    streamed = [v for c in stream if c.choices and c.choices[0].logprobs for v in c.choices[0].logprobs.token_logprobs]
    assert streamed == logprobs.token_logprobs


def test_chat_logprobs_and_top_logprobs_equal_target_only_streamed_and_not(oai, target):
    messages = [{"role": "user", "content": PROMPT}]
    out = oai.chat.completions.create(model="tiny", messages=messages, max_tokens=N, temperature=0, logprobs=True,
                                      top_logprobs=5, extra_body=SPEC)  # fmt: skip
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens and all(len(c.top_logprobs) == 5 for c in content)
    # The oracle: target-only decoding of the templated prompt, and a teacher-forced forward over its tokens.
    prompt_ids = chat_prompt_ids(target.tokenizer, conversation(PROMPT))
    ids = SpecEngine(target).generate(prompt_ids, SamplingParams(max_new_tokens=N), SpecParams(method="none")).token_ids
    expected = target_logprobs(target.model, prompt_ids, ids)
    assert [c.token for c in content] == [target.tokenizer.decode([t]) for t in ids]
    assert _close([c.logprob for c in content], [float(expected[i, t]) for i, t in enumerate(ids)])
    for i, c in enumerate(content):  # each position's five alternatives, most likely first
        assert _close([a.logprob for a in c.top_logprobs], torch.topk(expected[i], 5).values.tolist()), i
    stream = oai.chat.completions.create(model="tiny", messages=messages, max_tokens=N, temperature=0, logprobs=True,
                                         top_logprobs=5, stream=True, extra_body=SPEC)  # fmt: skip
    streamed = [c for chunk in stream if chunk.choices and chunk.choices[0].logprobs
                for c in chunk.choices[0].logprobs.content]  # fmt: skip
    assert [(c.token, c.logprob) for c in streamed] == [(c.token, c.logprob) for c in content]
    plain = oai.chat.completions.create(model="tiny", messages=messages, max_tokens=N, temperature=0, extra_body=SPEC)
    assert plain.choices[0].logprobs is None and plain.choices[0].message.content == out.choices[0].message.content


@pytest.mark.parametrize(("kwargs", "field"), [({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
                                               ({"top_logprobs": 3}, "top_logprobs")])  # fmt: skip
def test_bad_chat_values_are_400_naming_the_field(oai, kwargs, field):
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=2, **kwargs)
    assert e.value.status_code == 400 and e.value.body["param"] == field


def test_completions_logprobs_over_twenty_are_400_naming_the_field(oai):  # vLLM's bound (OpenAI's: 5)
    with pytest.raises(openai.BadRequestError) as e:
        oai.completions.create(model="tiny", prompt="x", max_tokens=2, logprobs=21)
    assert e.value.status_code == 400 and e.value.body["param"] == "logprobs"


@pytest.mark.parametrize("max_tokens", [0, 1])
def test_echo_with_logprobs_and_prompt_logprobs_as_lm_eval_sends_them(oai, target, max_tokens):
    """lm-evaluation-harness's loglikelihood request (echo, logprobs, max_tokens 0 or 1) and vLLM's prompt_logprobs
    (extra_body): the prompt's logprobs equal a teacher-forced forward, the token after it target-only decoding's."""
    out = oai.completions.create(model="tiny", prompt=PROMPT, max_tokens=max_tokens, temperature=0, echo=True,
                                 logprobs=1, extra_body={**SPEC, "prompt_logprobs": 2})  # fmt: skip
    ids = target.tokenizer(PROMPT)["input_ids"]
    new = SpecEngine(target).generate(ids, SamplingParams(max_new_tokens=1), SpecParams(method="none")).token_ids
    tokens = ids + new[:max_tokens]
    expected = target_logprobs(target.model, ids[:1], tokens[1:])
    choice = out.choices[0]
    assert choice.text == target.tokenizer.decode(tokens) and out.usage.completion_tokens == max_tokens
    assert choice.logprobs.tokens == [target.tokenizer.decode([t]) for t in tokens]
    assert choice.logprobs.token_logprobs[0] is None and choice.logprobs.top_logprobs[0] is None
    assert _close(choice.logprobs.token_logprobs[1:], [float(expected[i, t]) for i, t in enumerate(tokens[1:])])
    prompt = choice.prompt_logprobs  # vLLM's field, kept by the openai package
    assert prompt[0] is None and len(prompt) == len(ids)
    assert _close([p[str(t)]["logprob"] for p, t in zip(prompt[1:], ids[1:], strict=True)],
                  [float(expected[i, t]) for i, t in enumerate(ids[1:])])  # fmt: skip
    assert all(min(v["rank"] for v in p.values()) == 1 and len(p) in (2, 3) for p in prompt[1:])
