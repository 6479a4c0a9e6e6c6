"""vLLM's defaults and leniency through the real Serve application (the package's, its model "compat") and the `openai`
package (issue 55 items 2 and 3), on a tiny model whose generation_config.json sets sampling defaults and whose chat
template reads enable_thinking, speculating with a draft model: an unset max_tokens runs to the context's end; the
model's defaults apply to unset fields and the output equals target-only decoding under them (lossless); unknown
fields are ignored; vLLM's extra fields are taken; the context error says "maximum context length"."""

import openai
import pytest

from specserve.workers.config.request import SamplingParams, SpecParams
from specserve.workers.config.settings import ModelConfig
from specserve.workers.runtime.loading import load_model
from specserve.workers.speculation.engine import SpecEngine
from tests.helpers.generation_models import COMPAT_DEFAULTS

pytestmark = pytest.mark.slow

PROMPT = "def add(a, b):"
SPEC = {"speculation": {"method": "draft", "k": 4}}


@pytest.fixture(scope="module")
def target(compat_target):  # this module's: the "compat" model, not the package's tiny target
    return load_model(ModelConfig(path=compat_target, device="cpu"))


def target_only(target, ids: list[int], new: int, **params) -> str:
    """Target-only greedy decoding under the model's repetition penalty (its default), as text."""
    sampling = SamplingParams(max_new_tokens=new, repetition_penalty=COMPAT_DEFAULTS["repetition_penalty"], **params)
    out = SpecEngine(target).generate(ids, sampling, SpecParams(method="none"))
    return target.tokenizer.decode(out.token_ids, skip_special_tokens=True)


def test_unset_max_tokens_runs_to_the_contexts_end_lossless_under_the_models_defaults(oai, target):
    out = oai.completions.create(model="compat", prompt=PROMPT, temperature=0, extra_body={**SPEC, "ignore_eos": True})
    ids = target.tokenizer(PROMPT)["input_ids"]
    assert out.usage.completion_tokens == 512 - len(ids) > 256 and out.choices[0].finish_reason == "length"
    assert out.choices[0].text == target_only(target, ids, 512 - len(ids), stop_at_eos=False)


def test_unknown_fields_and_top_k_minus_one_are_taken_and_change_nothing(oai, target):
    ids = target.tokenizer(PROMPT)["input_ids"]
    extra = {**SPEC, "top_k": -1, "foo_bar": {"x": 1}, "stream_options": {"include_usage": False, "future": 1}}
    out = oai.completions.create(model="compat", prompt=PROMPT, max_tokens=24, temperature=0, extra_body=extra)
    assert out.choices[0].text == target_only(target, ids, 24)


def test_chat_template_kwargs_reach_the_template_and_the_output_is_target_onlys(oai, target):
    messages = [{"role": "user", "content": PROMPT}]
    plain = oai.chat.completions.create(
        model="compat", messages=messages, max_tokens=16, temperature=0, extra_body=SPEC
    )
    kwargs = {"chat_template_kwargs": {"enable_thinking": False}}
    off = oai.chat.completions.create(model="compat", messages=messages, max_tokens=16, temperature=0,
                                      extra_body={**SPEC, **kwargs})  # fmt: skip
    rendered = target.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                                    enable_thinking=False)  # fmt: skip
    ids = target.tokenizer(rendered, add_special_tokens=False)["input_ids"]
    assert rendered.endswith("<think></think>") and off.usage.prompt_tokens == len(ids) > plain.usage.prompt_tokens
    assert off.choices[0].message.content == target_only(target, ids, 16)


def test_streamed_usage_on_every_chunk_and_echo(oai):
    stream = oai.completions.create(model="compat", prompt=PROMPT, max_tokens=12, temperature=0, stream=True,
                                    stream_options={"include_usage": True, "continuous_usage_stats": True},
                                    echo=True, extra_body=SPEC)  # fmt: skip
    chunks = list(stream)
    assert all(c.usage is not None for c in chunks) and chunks[-1].usage.completion_tokens == 12
    counts = [c.usage.completion_tokens for c in chunks]
    assert counts == sorted(counts) and "".join(c.choices[0].text for c in chunks if c.choices).startswith(PROMPT)
    whole = oai.completions.create(model="compat", prompt=PROMPT, max_tokens=12, temperature=0, echo=True,
                                   extra_body=SPEC)  # fmt: skip
    assert whole.choices[0].text == "".join(c.choices[0].text for c in chunks if c.choices)
    out = oai.completions.create(model="compat", prompt=PROMPT, max_tokens=4, temperature=0, logprobs=20,
                                 extra_body=SPEC)  # fmt: skip
    tops = out.choices[0].logprobs.top_logprobs  # by text: tokens that decode alike (bytes as U+FFFD) share a key
    assert len(tops) == 4 and max(map(len, tops)) > 5  # past OpenAI's bound of 5


def test_refusals_say_what_vllm_says(oai):
    with pytest.raises(openai.BadRequestError) as e:
        oai.completions.create(model="compat", prompt=[5] * 600, max_tokens=4)
    assert "maximum context length is 512 tokens. However, you requested 600 tokens" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        oai.completions.create(model="compat", prompt=[5] * 500, max_tokens=40)
    assert "maximum context length is 512 tokens. However, you requested 540 tokens (500 in the messages, 40 in " \
           "the completion)" in e.value.message  # fmt: skip
    with pytest.raises(openai.BadRequestError) as e:
        oai.completions.create(model="compat", prompt=PROMPT, max_tokens=0)
    assert e.value.body["param"] == "max_tokens"  # 0 only with echo, as vLLM
