"""vLLM's prompt_logprobs and completions' echo with logprobs (what lm-evaluation-harness's loglikelihood tasks send:
echo, logprobs N, max_tokens 0 or 1), through the real ingress (its HTTP handler, no Ray) and a scheduler replica's
ModelServing on real gRPC workers, speculating with a draft model: the prompt's logprobs equal a teacher-forced
forward of the target (tests/helpers/logprobs_oracle.py, ATOL in float32), shaped as vLLM shapes them, and the
generated tokens stay target-only decoding's."""

import asyncio
import json

import pytest
from starlette.requests import Request as HttpRequest

from specserve.cluster.app_config import AppConfig
from specserve.cluster.scheduling.model_serving import ModelServing
from specserve.cluster.serve import ingress as ingress_module
from specserve.cluster.serve import openai_api as oai
from specserve.cluster.serve.prepare import RequestPreparer
from specserve.workers.config.request import SamplingParams, SpecParams
from specserve.workers.config.settings import ModelConfig
from specserve.workers.runtime.loading import load_model
from specserve.workers.speculation.engine import SpecEngine
from tests.helpers.logprobs_oracle import ATOL, target_logprobs
from tests.helpers.workers import LocalWorkers

PROMPT = "def add(a, b):\n    return a"
SPEC = {"speculation": {"method": "draft", "k": 4}}


@pytest.fixture(scope="module")
def models(tiny_target, tiny_draft):
    return load_model(ModelConfig(path=tiny_target, device="cpu")), load_model(ModelConfig(path=tiny_draft))


class _Remote:
    def __init__(self, fn):
        self.remote = fn


class ServiceHandle:
    """The scheduler deployment's handle as the ingress calls it, over a ModelServing in this process."""

    def __init__(self, serving: ModelServing):
        self.generate, self.run = _Remote(serving.generate), _Remote(serving.run)

    def options(self, stream: bool = False):
        return self


def app_args(tiny_target: str, tiny_draft: str) -> dict:
    return {"models": [{"name": "tiny", "target": tiny_target, "draft": tiny_draft, "device": "cpu"}],
            "auth": {"api_key_env": None}}  # fmt: skip


def http_request(body: dict, path: str) -> HttpRequest:
    raw = json.dumps(body).encode()
    scope = {"type": "http", "method": "POST", "path": path, "headers": [(b"content-length", str(len(raw)).encode())]}

    async def receive():
        return {"type": "http.request", "body": raw, "more_body": False}

    return HttpRequest(scope, receive)


def ask(models, tiny_target, tiny_draft, monkeypatch, bodies: list[dict], chat: bool = False) -> list:
    """Each body through the ingress's handler: (status, JSON answer, or the stream's events)."""
    monkeypatch.setattr("specserve.cluster.serve.metrics.IngressMetrics", lambda: type("M", (), {"refuse": print})())
    args = app_args(tiny_target, tiny_draft)
    route = "/v1/chat/completions" if chat else "/v1/completions"

    async def main():
        async with LocalWorkers(models[0], [models[1]]) as w:
            serving = ModelServing(ingress_module.app_config(args), {"tiny": (tiny_target, tiny_draft)})
            serving.sync_workers([{"model": "tiny", "kind": n.split("-")[0], "worker_id": n, "address": a}
                                  for n, a in w.addresses.items()])  # fmt: skip
            ingress = ingress_module.SpecServeIngress(args, ServiceHandle(serving))
            out = []
            for body in bodies:
                response = await ingress._openai(http_request(body, route), route)
                if body.get("stream") and response.status_code == 200:
                    text = "".join([p if isinstance(p, str) else p.decode() async for p in response.body_iterator])
                    events = [json.loads(e[6:]) for e in text.split("\n\n") if e and e != "data: [DONE]"]
                    out.append((200, events))
                else:
                    out.append((response.status_code, json.loads(response.body)))
            pipeline = serving.models["tiny"].pipeline
            await pipeline.drain_releases()
            for client in (*pipeline.drafts.values(), *pipeline.targets.values()):
                await client.close()
            return out

    return asyncio.run(main())


def close(got: list, expected: list) -> bool:
    return len(got) == len(expected) and all(abs(a - b) <= ATOL for a, b in zip(got, expected, strict=True))


def oracle(target, ids: list[int]) -> tuple[list[float], object]:
    """Tokens 1..'s logprobs and the rows they come from, one teacher-forced forward over `ids`."""
    rows = target_logprobs(target.model, ids[:1], ids[1:])
    return [float(rows[i, t]) for i, t in enumerate(ids[1:])], rows


def target_only(target, ids: list[int], new: int) -> list[int]:
    return SpecEngine(target).generate(ids, SamplingParams(max_new_tokens=new), SpecParams(method="none")).token_ids


@pytest.mark.parametrize("max_tokens", [0, 1, 12])
def test_echo_with_logprobs_puts_the_prompts_logprobs_first_lossless_under_speculation(
    models, tiny_target, tiny_draft, monkeypatch, max_tokens
):
    target = models[0]
    ids = target.tokenizer(PROMPT)["input_ids"]
    body = {"prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "echo": True, "logprobs": 3, **SPEC}
    [(status, out)] = ask(models, tiny_target, tiny_draft, monkeypatch, [body])
    assert status == 200, out
    choice = out["choices"][0]
    generated = target_only(target, ids, max_tokens) if max_tokens else []
    values, rows = oracle(target, ids + generated)
    texts = [target.tokenizer.decode([t]) for t in ids + generated]
    lp = choice["logprobs"]
    assert lp["tokens"] == texts and lp["text_offset"] == [sum(map(len, texts[:i])) for i in range(len(texts))]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert close(lp["token_logprobs"][1:], values)
    for i, (top, token) in enumerate(zip(lp["top_logprobs"][1:], (ids + generated)[1:], strict=True)):
        allowed = [float(rows[i, token]), *rows[i].topk(3).values.tolist()]  # its own, its 3 likeliest (by text)
        assert 1 <= len(top) <= 4 and all(min(abs(v - a) for a in allowed) <= ATOL for v in top.values())
    assert choice["text"] == PROMPT + target.tokenizer.decode(generated, skip_special_tokens=True)
    assert out["usage"]["completion_tokens"] == max_tokens
    assert len(choice["prompt_logprobs"]) == len(ids) and choice["prompt_logprobs"][0] is None  # vLLM fills it too


def test_prompt_logprobs_in_vllms_shape_on_completions_and_chat(models, tiny_target, tiny_draft, monkeypatch):
    target = models[0]
    ids = target.tokenizer(PROMPT)["input_ids"]
    body = {"prompt": PROMPT, "max_tokens": 6, "temperature": 0, "prompt_logprobs": 4, **SPEC}
    tree = {**body, "speculation": {"method": "ngram-tree", "k": 4}}  # a tree method's first round: a plain step
    outs = ask(models, tiny_target, tiny_draft, monkeypatch, [body, tree])
    values, rows = oracle(target, ids)
    for status, out in outs:
        assert status == 200, out
        choice = out["choices"][0]
        assert choice["logprobs"] is None and choice["prompt_logprobs"][0] is None
        entries = choice["prompt_logprobs"][1:]
        assert close([e[str(t)]["logprob"] for e, t in zip(entries, ids[1:], strict=True)], values)
        for i, (entry, token) in enumerate(zip(entries, ids[1:], strict=True)):
            row = rows[i]
            assert entry[str(token)]["rank"] == 1 + int((row > row[token]).sum())
            assert entry[str(token)]["decoded_token"] == target.tokenizer.decode([token])
            assert list(entry)[0] == str(token) and len(entry) in (4, 5)  # its own first, then the 4 likeliest
            best = sorted((v["rank"], v["logprob"]) for k, v in entry.items() if v["rank"] <= 4)
            assert [r for r, _ in best] == [1, 2, 3, 4] and close([v for _, v in best], row.topk(4).values.tolist())
        assert choice["text"] == target.tokenizer.decode(target_only(target, ids, 6), skip_special_tokens=True)
    chat_body = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 4, "temperature": 0,
                 "prompt_logprobs": 0, **SPEC}  # fmt: skip
    [(status, chat)] = ask(models, tiny_target, tiny_draft, monkeypatch, [chat_body], chat=True)
    app = AppConfig.model_validate(app_args(tiny_target, tiny_draft))
    preparer = RequestPreparer(app, {"tiny": (tiny_target, tiny_draft)})
    rendered = preparer.prepare(oai.parse_chat(chat_body).request).prompt_ids  # the model's transcript, as served
    assert status == 200 and len(chat["prompt_logprobs"]) == len(rendered) == chat["usage"]["prompt_tokens"]
    assert close([e[str(t)]["logprob"] for e, t in zip(chat["prompt_logprobs"][1:], rendered[1:], strict=True)],
                 oracle(target, rendered)[0])  # fmt: skip


def test_streamed_echo_with_logprobs_and_the_refusals(models, tiny_target, tiny_draft, monkeypatch):
    """A stream's first event carries the prompt's tokens and theirs (vLLM's); prompt_logprobs is not streamed and
    max_tokens 0 needs echo, as vLLM."""
    body = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "echo": True, "logprobs": 2, **SPEC}
    outs = ask(models, tiny_target, tiny_draft, monkeypatch, [
        body, {**body, "stream": True}, {**body, "max_tokens": 0, "stream": True},
        {**body, "stream": True, "prompt_logprobs": 1}, {"prompt": PROMPT, "max_tokens": 0},
    ])  # fmt: skip
    (_, whole), (_, events), (_, alone) = outs[:3]
    streamed = [e["choices"][0]["logprobs"] for e in events if e["choices"]]
    for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        assert [v for lp in streamed for v in lp[key]] == whole["choices"][0]["logprobs"][key]
    assert "".join(e["choices"][0]["text"] for e in events) == whole["choices"][0]["text"]
    prompt_tokens = whole["choices"][0]["logprobs"]["tokens"][: whole["usage"]["prompt_tokens"]]
    [only] = [e["choices"][0] for e in alone if e["choices"]]
    assert only["text"] == PROMPT and only["logprobs"]["tokens"] == prompt_tokens
    assert [(s, out["error"]["param"]) for s, out in outs[3:]] == [(400, "prompt_logprobs"), (400, "max_tokens")]
