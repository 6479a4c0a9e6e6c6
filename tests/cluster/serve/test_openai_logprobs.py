"""Logprobs at the edges: OpenAI's fields (chat logprobs + top_logprobs 0..20, completions logprobs 0..20, vLLM's
bound) and gRPC's sampling.logprobs into SamplingParams.logprobs, OpenAI's response shapes, and the ingress's public
gRPC and HTTP paths on a real ModelServing over gRPC workers (no Ray): values equal target-only's, streamed and
not."""

import asyncio
import json

import pytest
from starlette.requests import Request as HttpRequest

from specserve.cluster.app_config import AppConfig
from specserve.cluster.scheduling.model_serving import ModelServing
from specserve.cluster.serve import ingress as ingress_module
from specserve.cluster.serve import openai_api as oai
from specserve.cluster.serve.openai_logprobs import FLOOR, LogprobsShaper, TokenTexts
from specserve.cluster.serve.public_proto import request_from_proto
from specserve.protos import specserve_pb2 as pb
from specserve.workers.config.settings import ModelConfig
from specserve.workers.runtime.loading import load_model
from specserve.workers.speculation.logprobs import TokenLogprob, from_proto
from tests.helpers.logprobs_oracle import ATOL, assert_logprobs_match, target_logprobs
from tests.helpers.workers import LocalWorkers, byte_tokenizer

PROMPT = "for i in range(3):\n    print(i)\n"
N = 12


def chat(**fields) -> dict:
    return {"messages": [{"role": "user", "content": "x"}], **fields}


def test_the_fields_become_sampling_params_logprobs():
    assert oai.parse_chat(chat()).request.logprobs is None
    assert oai.parse_chat(chat(logprobs=False, top_logprobs=0)).request.logprobs is None  # neutral
    assert oai.parse_chat(chat(logprobs=True)).request.logprobs == 0
    assert oai.parse_chat(chat(logprobs=True, top_logprobs=20)).request.logprobs == 20
    assert oai.parse_completion({"prompt": "x", "logprobs": 0}).request.logprobs == 0
    assert oai.parse_completion({"prompt": "x", "logprobs": 5}).request.logprobs == 5
    assert oai.parse_completion({"prompt": "x", "logprobs": 20}).request.logprobs == 20  # vLLM's most (OpenAI's: 5)
    assert oai.parse_completion({"prompt": "x"}).request.logprobs is None
    grpc_request = pb.GenerateRequest(prompt="x", sampling=pb.SamplingParams(logprobs=0))
    assert request_from_proto(grpc_request).logprobs == 0
    assert request_from_proto(pb.GenerateRequest(prompt="x")).logprobs is None


def test_openai_shapes_of_chat_and_completions():
    texts = TokenTexts(byte_tokenizer())
    a, b = byte_tokenizer()("ab")["input_ids"][-2:]
    logprobs = [TokenLogprob(-0.5, ((a, -0.5), (b, -1.5))), TokenLogprob(float("-inf"), ((a, -0.1),))]
    shaped = LogprobsShaper(texts, chat=True).shape([a, b], logprobs)
    assert shaped["content"][0] == {"token": "a", "logprob": -0.5, "bytes": [97], "top_logprobs": [
        {"token": "a", "logprob": -0.5, "bytes": [97]}, {"token": "b", "logprob": -1.5, "bytes": [98]}]}  # fmt: skip
    assert shaped["content"][1]["logprob"] == FLOOR  # JSON has no -Infinity
    completions = LogprobsShaper(texts, chat=False)
    first = completions.shape([a, b], logprobs)
    assert first == {"tokens": ["a", "b"], "token_logprobs": [-0.5, FLOOR], "text_offset": [0, 1],
                     "top_logprobs": [{"a": -0.5, "b": -1.5}, {"b": FLOOR, "a": -0.1}]}  # fmt: skip
    assert completions.shape([b], logprobs[:1])["text_offset"] == [2]  # a stream's offsets count on
    assert completions.shape([b], logprobs[:1], index=1)["text_offset"] == [0]  # per choice
    assert completions.shape([a], None) is None


class _Call:
    def __init__(self, fn):
        self.fn = fn

    def remote(self, *args):
        return self.fn(*args)


class ServiceHandle:
    """The scheduler deployment's handle, calling a ModelServing in this process."""

    def __init__(self, serving: ModelServing):
        self.generate, self.run = _Call(serving.generate), _Call(serving.run)

    def options(self, stream: bool = False):
        return self


def http_request(body: dict) -> HttpRequest:
    raw = json.dumps(body).encode()
    scope = {"type": "http", "method": "POST", "path": "/", "headers": [(b"content-length", str(len(raw)).encode())]}

    async def receive():
        return {"type": "http.request", "body": raw, "more_body": False}

    return HttpRequest(scope, receive)


async def _body(response) -> str:
    return "".join([p if isinstance(p, str) else p.decode() async for p in response.body_iterator])


def _events(body: str) -> list[dict]:
    return [json.loads(e.removeprefix("data: ")) for e in body.split("\n\n") if e and e != "data: [DONE]"]


@pytest.fixture(scope="module")
def answers(tiny_target):
    """The ingress on a real ModelServing over gRPC workers (the target drafting for itself: multi-token rounds)."""
    args = {"models": [{"name": "tiny", "target": tiny_target, "draft": tiny_target, "device": "cpu"}],
            "auth": {"api_key_env": None}}  # fmt: skip
    target = load_model(ModelConfig(path=tiny_target, device="cpu"))
    spec = {"speculation": {"method": "draft", "k": 4}, "max_tokens": N, "temperature": 0}
    calls = {
        "grpc": pb.GenerateRequest(prompt=PROMPT, model="tiny",
                                   sampling=pb.SamplingParams(max_new_tokens=N, logprobs=3),
                                   speculation=pb.SpeculationOptions(method="draft", k=4)),
        "completion": ("/v1/completions", {"prompt": PROMPT, "logprobs": 2, **spec}),
        "completion_stream": ("/v1/completions", {"prompt": PROMPT, "logprobs": 2, "stream": True, **spec}),
        "chat": ("/v1/chat/completions", chat(logprobs=True, top_logprobs=4, **spec)),
        "chat_stream": ("/v1/chat/completions", chat(logprobs=True, top_logprobs=4, stream=True, **spec)),
        "chat_plain": ("/v1/chat/completions", chat(**spec)),
        "chat_n": ("/v1/chat/completions", chat(logprobs=True, top_logprobs=4, n=2, **spec)),
        "completion_n_stream": ("/v1/completions", {"prompt": PROMPT, "logprobs": 2, "n": 2, "stream": True, **spec}),
    }  # fmt: skip

    async def main():
        async with LocalWorkers(target, [target]) as w:
            serving = ModelServing(AppConfig.model_validate(args), {"tiny": (tiny_target, tiny_target)})
            serving.sync_workers([{"model": "tiny", "kind": n.split("-")[0], "worker_id": n, "address": a}
                                  for n, a in w.addresses.items()])  # fmt: skip
            ingress = ingress_module.SpecServeIngress(args, ServiceHandle(serving))
            out = {"grpc": await ingress.Generate(calls["grpc"], None)}
            out["grpc_stream"] = [r async for r in ingress.GenerateStream(calls["grpc"], None)]
            for name, (route, body) in list(calls.items())[1:]:
                response = await ingress._openai(http_request(body), route)
                out[name] = _events(await _body(response)) if body.get("stream") else json.loads(response.body)
            for client in (*serving.models["tiny"].pipeline.drafts.values(),
                           *serving.models["tiny"].pipeline.targets.values()):  # fmt: skip
                await client.close()
            return out, ingress.preparer.models["tiny"].tokenizer

    out, tokenizer = asyncio.run(main())
    return out, target, tokenizer


def test_public_grpc_returns_target_only_logprobs_unary_and_streamed(answers):
    out, target, tokenizer = answers
    prompt = tokenizer(PROMPT)["input_ids"]
    unary = out["grpc"]
    tokens = list(unary.token_ids)
    expected = target_logprobs(target.model, prompt, tokens)
    assert tokens == expected.argmax(-1).tolist() and unary.stats.accepted > 0
    assert_logprobs_match(tokens, from_proto(unary.logprobs), expected, 3)
    streamed = [lp for r in out["grpc_stream"] for lp in from_proto(r.logprobs)]
    assert [t for r in out["grpc_stream"] for t in r.token_ids] == tokens
    assert_logprobs_match(tokens, streamed, expected, 3)


def test_openai_chat_and_completions_logprobs_streamed_and_not(answers):
    out, target, tokenizer = answers
    tokens = list(out["grpc"].token_ids)  # the same greedy tokens: the completions' prompt is the same text
    expected = target_logprobs(target.model, tokenizer(PROMPT)["input_ids"], tokens)
    whole = out["completion"]["choices"][0]["logprobs"]
    assert [tokenizer.decode([t]) for t in tokens] == whole["tokens"]
    values = whole["token_logprobs"]
    assert all(abs(v - float(expected[i, t])) <= ATOL for i, (t, v) in enumerate(zip(tokens, values, strict=True)))
    # the chosen token and the top 2, by text (bytes that are no character all decode to U+FFFD alone)
    assert all(1 <= len(top) <= 3 for top in whole["top_logprobs"]) and max(map(len, whole["top_logprobs"])) > 1
    streamed = [e["choices"][0]["logprobs"] for e in out["completion_stream"] if e["choices"][0]["logprobs"]]
    assert sum((s["token_logprobs"] for s in streamed), []) == whole["token_logprobs"]
    assert sum((s["text_offset"] for s in streamed), []) == whole["text_offset"]

    chat_whole = out["chat"]["choices"][0]["logprobs"]["content"]
    chat_streamed = [c for e in out["chat_stream"] if e["choices"][0]["logprobs"]
                     for c in e["choices"][0]["logprobs"]["content"]]  # fmt: skip
    assert chat_streamed == chat_whole and all(len(c["top_logprobs"]) == 4 for c in chat_whole)
    assert len(chat_whole) == out["chat"]["usage"]["completion_tokens"]  # one entry per emitted token
    assert all(c["bytes"] == list(c["token"].encode()) for c in chat_whole)
    assert out["chat_plain"]["choices"][0]["logprobs"] is None
    assert out["chat_plain"]["choices"][0]["message"] == out["chat"]["choices"][0]["message"]


def test_n_choices_each_carry_their_own_logprobs(answers):
    out, _, _ = answers
    whole = out["chat"]["choices"][0]["logprobs"]
    assert [c["logprobs"] for c in out["chat_n"]["choices"]] == [whole, whole]  # greedy: each equals one alone
    by_index = {0: [], 1: []}
    for event in out["completion_n_stream"]:
        for choice in event["choices"]:
            if choice["logprobs"]:
                by_index[choice["index"]].append(choice["logprobs"])
    want = out["completion"]["choices"][0]["logprobs"]
    for chunks in by_index.values():  # text offsets count per choice
        assert sum((c["text_offset"] for c in chunks), []) == want["text_offset"]
        assert sum((c["token_logprobs"] for c in chunks), []) == want["token_logprobs"]
