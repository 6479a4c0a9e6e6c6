"""One request path without Ray: the ingress tokenizes with a RequestPreparer (no ModelServing) and hands the
scheduler one typed `Prepared` per request in one call, with no admission round trip before a stream; the scheduler's
ModelServing runs it against real gRPC workers, its streamed text adding up to the decode of its tokens."""

import asyncio
import json
import logging

import pytest
from starlette.requests import Request as HttpRequest

from specserve.cluster.app_config import AppConfig
from specserve.cluster.scheduling.model_serving import ModelServing
from specserve.cluster.scheduling.prepared import Chunk, Prepared
from specserve.cluster.serve import ingress as ingress_module
from specserve.cluster.serve import openai_api as oai
from specserve.cluster.serve.prepare import RequestPreparer
from specserve.protos import specserve_pb2 as pb
from specserve.workers.config.request import SamplingParams, SpecParams
from specserve.workers.config.settings import ModelConfig
from specserve.workers.errors import OverloadedError
from specserve.workers.runtime.loading import load_model
from specserve.workers.speculation.engine import SpecEngine
from tests.helpers.workers import LocalWorkers

PROMPT = "def add(a, b):\n    return"


def app_args(tiny_target: str, draft: str = "ngram") -> dict:
    return {"models": [{"name": "tiny", "target": tiny_target, "draft": draft, "device": "cpu"}],
            "auth": {"api_key_env": None}}  # fmt: skip


class Call:
    def __init__(self, fn):
        self.fn = fn

    def remote(self, *args):
        return self.fn(*args)


class FakeScheduler:
    """A scheduler deployment handle: records every call the ingress makes (each one a process crossing)."""

    def __init__(self, chunks: list[Chunk], error: Exception | None = None):
        self.chunks, self.error, self.calls = chunks, error, []
        self.generate = Call(self._generate)
        self.run = Call(self._run)
        self.status = Call(lambda: self._record("status", None))
        self.wait_ready = Call(lambda *a: self._record("wait_ready", None))
        self.admit = Call(lambda *a: self._record("admit", None))

    def options(self, stream: bool = False):
        assert stream
        return self

    async def _record(self, name, arg):
        self.calls.append((name, arg))

    async def _generate(self, prepared):
        await self._record("generate", prepared)
        if self.error:
            raise self.error
        tokens = [t for c in self.chunks for t in c.token_ids]
        return {"model": prepared.model, "text": "".join(c.text for c in self.chunks), "token_ids": tokens,
                "finish_reason": "length", "stats": self.chunks[-1].stats,
                "usage": {"prompt_tokens": len(prepared.prompt_ids), "completion_tokens": len(tokens)}}  # fmt: skip

    async def _run(self, prepared):
        self.calls.append(("run", prepared))
        if self.error:
            raise self.error
        for chunk in self.chunks:
            yield chunk


STATS = {"rounds": 1, "drafted": 0, "accepted": 0, "acceptance_rate": 0.0, "mean_accepted_length": 2.0}
CHUNKS = [Chunk("he", [5, 6], None, STATS), Chunk("llo", [7], "length", STATS)]


@pytest.fixture
def ingress(tiny_target, monkeypatch):
    class NoMetrics:
        def __init__(self):
            self.refused = []

        def refuse(self, route, status):
            self.refused.append((route, status))

    monkeypatch.setattr("specserve.cluster.serve.metrics.IngressMetrics", NoMetrics)
    return ingress_module.SpecServeIngress(app_args(tiny_target), FakeScheduler(CHUNKS))


def http_request(body: dict) -> HttpRequest:
    raw = json.dumps(body).encode()
    scope = {
        "type": "http",
        "method": "POST",
        "path": "/v1/completions",
        "headers": [(b"content-length", str(len(raw)).encode())],
    }

    async def receive():
        return {"type": "http.request", "body": raw, "more_body": False}

    return HttpRequest(scope, receive)


async def body_of(response) -> str:
    return "".join([part if isinstance(part, str) else part.decode() async for part in response.body_iterator])


def test_the_ingress_tokenizes_without_a_service_and_sends_one_typed_request(ingress):
    assert isinstance(ingress.preparer, RequestPreparer) and not hasattr(ingress, "requests")
    out = asyncio.run(ingress.Generate(pb.GenerateRequest(prompt=PROMPT, model="tiny"), None))
    assert (out.text, list(out.token_ids)) == ("hello", [5, 6, 7])
    ((name, prepared),) = ingress.scheduler.calls
    tokenizer = ingress.preparer.models["tiny"].tokenizer
    assert name == "generate" and isinstance(prepared, Prepared)
    context = ingress.preparer.models["tiny"].max_positions  # an unset max_tokens: up to the context's end
    assert prepared.prompt_ids == tokenizer(PROMPT)["input_ids"]
    assert prepared.params.max_new_tokens == context - len(prepared.prompt_ids)


def test_a_stream_is_one_scheduler_call_with_no_admission_round_trip(ingress):
    async def main():
        response = await ingress._openai(http_request({"prompt": "x", "stream": True, "max_tokens": 3}),
                                         "/v1/completions")  # fmt: skip
        return response, await body_of(response)

    response, body = asyncio.run(main())
    assert response.status_code == 200 and [name for name, _ in ingress.scheduler.calls] == ["run"]
    events = [line.removeprefix("data: ") for line in body.split("\n\n") if line]
    assert events[-1] == "[DONE]"
    assert "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1]) == "hello"


def test_a_stream_refused_before_its_first_chunk_is_an_http_status(ingress):
    ingress.scheduler.error = OverloadedError("2 requests are running, the limit of this replica is 2")
    response = asyncio.run(ingress._openai(http_request({"prompt": "x", "stream": True}), "/v1/completions"))
    assert response.status_code == 429 and response.headers["retry-after"] == "1"
    assert json.loads(response.body)["error"]["type"] == "rate_limit_exceeded"
    assert ingress.metrics.refused == [("/v1/completions", "429")]
    assert [name for name, _ in ingress.scheduler.calls] == ["run"]


def test_a_request_refused_at_the_edge_never_reaches_the_scheduler(ingress):
    response = asyncio.run(ingress._openai(http_request({"prompt": "x", "max_tokens": 10**6}), "/v1/completions"))
    assert response.status_code == 400 and json.loads(response.body)["error"]["param"] == "max_tokens"
    assert ingress.scheduler.calls == [] and ingress.metrics.refused == [("/v1/completions", "400")]


@pytest.fixture(scope="module")
def target(tiny_target):
    return load_model(ModelConfig(path=tiny_target, device="cpu"))


@pytest.mark.parametrize("method", ["draft", "ngram"])
def test_the_service_runs_a_prepared_request_losslessly_and_its_text_adds_up(tiny_target, target, method):
    app = AppConfig.model_validate(app_args(tiny_target, draft=tiny_target if method == "draft" else "ngram"))
    request = oai.parse_completion({"prompt": PROMPT, "max_tokens": 40, "temperature": 0}).request
    prepared = RequestPreparer(app, {"tiny": (tiny_target, None)}).prepare(request)
    reference = SpecEngine(target).generate(PROMPT, SamplingParams(max_new_tokens=40), SpecParams(method="none"))

    async def main():
        async with LocalWorkers(target, [target] if method == "draft" else []) as w:
            serving = ModelServing(app, {"tiny": (tiny_target, tiny_target)})
            rows = [{"model": "tiny", "kind": n.split("-")[0], "worker_id": n, "address": a}
                    for n, a in w.addresses.items()]  # fmt: skip
            serving.sync_workers(rows)
            chunks = [c async for c in serving.run(prepared)]
            whole = await serving.generate(prepared)
            for client in (
                *serving.models["tiny"].pipeline.drafts.values(),
                *serving.models["tiny"].pipeline.targets.values(),
            ):
                await client.close()
            return chunks, whole, serving

    chunks, whole, serving = asyncio.run(main())
    tokens = [t for c in chunks for t in c.token_ids]
    assert tokens == reference.token_ids == whole["token_ids"]
    assert "".join(c.text for c in chunks) == whole["text"] == target.tokenizer.decode(tokens, skip_special_tokens=True)
    assert chunks and chunks[-1].finish_reason and all(c.finish_reason is None for c in chunks[:-1])
    assert chunks[-1].stats["rounds"] == len(chunks) and serving.active == 0
    assert serving.models["tiny"].scheduler.requests == {}  # released on the workers, forgotten here


def _events(body: str) -> list[dict]:
    return [json.loads(e.removeprefix("data: ")) for e in body.split("\n\n") if e and e != "data: [DONE]"]


def test_echo_and_continuous_usage_through_the_ingress(ingress):
    """Completions' echo puts the prompt's text first (streamed: in each choice's first event; a prompt of token ids
    decoded); continuous_usage_stats puts the usage so far on every streamed chunk (vLLM's)."""

    async def main(body: dict):
        response = await ingress._openai(http_request(body), "/v1/completions")
        return response, (await body_of(response) if body.get("stream") else json.loads(response.body))

    _, out = asyncio.run(main({"prompt": "x", "echo": True, "max_tokens": 3}))
    assert out["choices"][0]["text"] == "xhello" and out["usage"]["completion_tokens"] == 3
    tokenizer = ingress.preparer.models["tiny"].tokenizer
    ids = tokenizer("def")["input_ids"]
    _, out = asyncio.run(main({"prompt": ids, "echo": True, "max_tokens": 3, "n": 2}))
    assert [c["text"] for c in out["choices"]] == [tokenizer.decode(ids) + "hello"] * 2
    options = {"include_usage": True, "continuous_usage_stats": True}
    _, body = asyncio.run(main({"prompt": "x", "echo": True, "stream": True, "stream_options": options}))
    events = _events(body)
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == "xhello"
    assert [e["usage"]["completion_tokens"] for e in events] == [2, 3, 3]  # the last: the usage chunk
    assert all(e["usage"]["prompt_tokens"] == 1 for e in events)


def test_unknown_fields_are_ignored_and_logged_or_refused_when_strict(tiny_target, monkeypatch, caplog):
    monkeypatch.setattr("specserve.cluster.serve.metrics.IngressMetrics", lambda: None)
    lenient = ingress_module.SpecServeIngress(app_args(tiny_target), FakeScheduler(CHUNKS))
    strict = ingress_module.SpecServeIngress({**app_args(tiny_target), "http": {"strict": True}},
                                             FakeScheduler(CHUNKS))  # fmt: skip
    body = {"prompt": "x", "max_tokens": 3, "foo_bar": 1, "stream_options": {"continuous_usage_stats": True}}
    with caplog.at_level(logging.WARNING, logger="specserve.cluster.serve.ignored_fields"):
        response = asyncio.run(lenient._openai(http_request(body), "/v1/completions"))
        again = asyncio.run(lenient._openai(http_request(body), "/v1/completions"))
    assert response.status_code == again.status_code == 200
    assert json.loads(response.body)["choices"][0]["text"] == "hello"
    warned = [r.getMessage() for r in caplog.records if r.name.endswith("ignored_fields")]
    assert len(warned) == 1 and "ignored unknown fields foo_bar" in warned[0]  # the second: counted, not said
    strict.metrics = type("M", (), {"refuse": lambda *a: None})()
    response = asyncio.run(strict._openai(http_request(body), "/v1/completions"))
    assert response.status_code == 400 and json.loads(response.body)["error"]["param"] == "foo_bar"
    assert strict.scheduler.calls == []
