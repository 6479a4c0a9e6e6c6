"""A tiny model whose chat template renders tools and a tool loop in Hermes' syntax (Qwen2.5's, cut down), trained for
a few seconds to answer one conversation with a call and its continuation (after the call's result) with a sentence:
so the served tool path decodes a real call, and the history a client sends back renders as the template writes it."""

from __future__ import annotations

from pathlib import Path

HERMES_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n<tools>\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}</tools>\n"
    'Call a function as <tool_call>{"name": ..., "arguments": ...}</tool_call><|im_end|>\n{% endif %}'
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' and m.tool_calls %}<|im_start|>assistant\n"
    "{% if m.content %}{{ m.content }}\n{% endif %}{%- for c in m.tool_calls %}<tool_call>\n"
    "{{ {'name': c.function.name, 'arguments': c.function.arguments} | tojson }}\n</tool_call>{% endfor %}"
    "<|im_end|>\n"
    "{%- elif m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n</tool_response><|im_end|>\n"
    "{%- else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}  # fmt: skip
QUESTION = [{"role": "user", "content": "Weather in Paris?"}]
CALL_TEXT = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
CALL_ARGUMENTS = {"city": "Paris"}
RESULT = "sunny, 21 C"
ANSWER = "It is sunny in Paris."


def tool_loop(call_id: str, arguments: str = '{"city": "Paris"}') -> list[dict]:
    """The conversation after the call, as an OpenAI client sends it back: the question, the assistant's call
    (content null, arguments as JSON text), the tool's result."""
    call = {"id": call_id, "type": "function", "function": {"name": "get_weather", "arguments": arguments}}
    return [*QUESTION, {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": call_id, "content": RESULT}]  # fmt: skip


def save_tool_caller(path: str | Path, steps: int = 120) -> str:
    """The tiny model with HERMES_TEMPLATE, trained (greedy) to answer QUESTION with WEATHER by CALL_TEXT, and the
    loop after it (tool_loop, the arguments as an object as templates take them) with ANSWER, each then EOS."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tests.helpers.workers import save_tiny_llama

    save_tiny_llama(path, seed=4, layers=2, hidden=32, max_positions=2048)
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    tokenizer.chat_template = HERMES_TEMPLATE
    loop = tool_loop("call_0")
    loop[1]["tool_calls"][0]["function"]["arguments"] = CALL_ARGUMENTS
    pairs = [(QUESTION, CALL_TEXT), (loop, ANSWER)]
    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True).train()
    rows = []
    for messages, answer in pairs:
        prompt = tokenizer.apply_chat_template(messages, tools=[WEATHER], tokenize=False, add_generation_prompt=True)
        head = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        tail = tokenizer(answer, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        ids = torch.tensor([head + tail])
        labels = ids.clone()
        labels[0, : len(head)] = -100
        rows.append((ids, labels))
    torch.manual_seed(0)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    for _ in range(steps):
        loss = sum(model(ids, labels=labels).loss for ids, labels in rows)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval().save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)
