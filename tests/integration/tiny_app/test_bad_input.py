"""Table-driven bad input against a running Serve app, over gRPC (the public SpecServe service through Serve's
gRPC proxy, unary and streaming) and HTTP (the OpenAI-compatible API, streaming or not): every malformed request gets
INVALID_ARGUMENT / 400 (413 for a body over the limit) with a message naming the field as the client wrote it, never
a 5xx or UNKNOWN/INTERNAL, and the server answers the next valid request correctly. Odd but valid requests are
served, and refused requests are counted.

Runs against the package's Serve app (conftest.py: `server`, `client`, `reference`); apart from test_app.py because
it is some 150 cases of table."""

import json
import math
import re
import socket
import time
import urllib.request

import grpc
import pytest

from specserve.protos import specserve_pb2 as pb
from specserve.protos import specserve_pb2_grpc as pb_grpc
from tests.helpers.serve_app import METRICS_REPORT_S, PROMPTS  # conftest.py's `reference` holds their outputs

pytestmark = pytest.mark.slow


def g(prompt="def f(x):", ids=None, model="", method=None, k=None, messages=None, **sampling) -> pb.GenerateRequest:
    req = pb.GenerateRequest(model=model, sampling=pb.SamplingParams(**sampling))
    if prompt:
        req.prompt = prompt
    if ids is not None:
        req.prompt_token_ids.extend(ids)
    req.messages.extend(pb.ChatMessage(role=r, content=t) for r, t in messages or [])
    if method is not None or k is not None:
        req.speculation.method = method or ""
        req.speculation.k = k or 0
    return req


GRPC_CASES = [
    ("no prompt", g(prompt=""), "prompt"),
    ("prompt and ids", g(ids=[5, 6]), "prompt"),
    ("token id out of vocab", g(prompt="", ids=[10**6]), "prompt_token_ids"),
    ("negative token id", g(prompt="", ids=[-1]), "prompt_token_ids"),
    ("int32 minimum token id", g(prompt="", ids=[-(2**31)]), "prompt_token_ids"),
    ("oversized prompt", g(prompt="x" * 9000), "prompt"),
    ("oversized prompt ids", g(prompt="", ids=[5] * 9000), "prompt_token_ids"),
    ("huge prompt text", g(prompt="y" * 300_000), "prompt"),
    ("negative temperature", g(temperature=-1.0), "sampling.temperature"),
    ("NaN temperature", g(temperature=math.nan), "sampling.temperature"),
    ("inf temperature", g(temperature=math.inf), "sampling.temperature"),
    ("huge temperature", g(temperature=1e6), "sampling.temperature"),
    ("top_p above 1", g(top_p=1.5), "sampling.top_p"),
    ("negative top_p", g(top_p=-0.5), "sampling.top_p"),
    ("NaN top_p", g(top_p=math.nan), "sampling.top_p"),
    ("max tokens over the limit", g(max_new_tokens=10**6), "sampling.max_new_tokens"),
    ("max tokens at the uint32 maximum", g(max_new_tokens=2**32 - 1), "sampling.max_new_tokens"),
    ("max tokens over the context", g(max_new_tokens=4000), "sampling.max_new_tokens"),
    ("seed out of range", g(seed=2**64 - 1), "sampling.seed"),
    ("seed at 2^63", g(seed=2**63), "sampling.seed"),
    ("k above 16", g(k=17), "speculation.k"),
    ("k far out of range", g(k=10**6), "speculation.k"),
    ("k at the uint32 maximum", g(k=2**32 - 1), "speculation.k"),
    ("unknown method", g(method="magic"), "speculation.method"),
    ("method in capitals", g(method="DRAFT"), "speculation.method"),
    ("unknown model", g(model="nope"), "model"),
    ("path as model", g(model="../../etc/passwd"), "model"),
    ("long model name", g(model="m" * 100_000), "model"),
    ("method with k out of range", g(method="ngram", k=99), "speculation.k"),
    ("unknown chat role", g(prompt="", messages=[("tool", "x")]), "messages[0].role"),
    ("empty chat role", g(prompt="", messages=[("", "x")]), "messages[0].role"),
    ("too many messages", g(prompt="", messages=[("user", "")] * 5000), "messages"),
    ("more messages than the context", g(prompt="", messages=[("user", "")] * 600), "messages"),
    ("long conversation", g(prompt="", messages=[("user", "z" * 100_000)]), "messages"),
    ("presence penalty over 2", g(presence_penalty=2.5), "sampling.presence_penalty"),
    ("NaN min_p", g(min_p=math.nan), "sampling.min_p"),
    ("logit bias over 100", g(logit_bias={5: 150.0}), "sampling.logit_bias[5]"),
    ("logit bias outside the vocabulary", g(logit_bias={10**6: 1.0}), "sampling.logit_bias"),
    ("min_tokens over max tokens", g(min_tokens=9, max_new_tokens=8), "sampling.min_tokens"),
]


@pytest.mark.parametrize(("name", "request_", "field"), GRPC_CASES, ids=[c[0] for c in GRPC_CASES])
def test_grpc_bad_input(server, client, reference, name, request_, field):
    with grpc.insecure_channel(server["grpc"]) as channel:
        stub = pb_grpc.SpecServeStub(channel)
        with pytest.raises(grpc.RpcError) as e:
            stub.Generate(request_, timeout=60, metadata=(("application", "specserve"),))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()
        assert e.value.details().startswith(f"invalid {field}: "), e.value.details()
        with pytest.raises(grpc.RpcError) as e:  # streaming: refused before any chunk
            list(stub.GenerateStream(request_, timeout=60, metadata=(("application", "specserve"),)))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and f"invalid {field}: " in e.value.details()
    assert client.generate(PROMPTS[0], max_new_tokens=24)["token_ids"] == reference[PROMPTS[0]][0]


def test_grpc_invalid_utf8_and_garbage_bytes(server, client, reference):
    # Field 1 (prompt, a proto3 string) carrying invalid UTF-8, bytes that are no message at all, and a message
    # whose field 1 claims more bytes than there are: INVALID_ARGUMENT naming `request` (the servicer registration
    # decodes without raising; gRPC's own deserializer would answer UNKNOWN).
    for raw, problem in ((b"\x0a\x02\xff\xfe", "bad UTF-8"), (b"\xff\xff\xff\xff", "corrupt"),
                         (b"\x0a\xff\xff\xff\x0f", "corrupt")):  # fmt: skip
        for method, stream in (("Generate", False), ("GenerateStream", True)):
            with grpc.insecure_channel(server["grpc"]) as channel:
                path = f"/specserve.v1.SpecServe/{method}"
                call = channel.unary_stream(path) if stream else channel.unary_unary(path)
                with pytest.raises(grpc.RpcError) as e:
                    out = call(raw, timeout=60, metadata=(("application", "specserve"),))
                    list(out) if stream else out
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()
            assert e.value.details().startswith("invalid request: ") and problem in e.value.details()
    assert client.generate(PROMPTS[0], max_new_tokens=24)["token_ids"] == reference[PROMPTS[0]][0]


def test_grpc_odd_but_valid_input_is_served(server):
    with grpc.insecure_channel(server["grpc"]) as channel:
        stub = pb_grpc.SpecServeStub(channel)
        md = (("application", "specserve"),)
        out = stub.Generate(g(top_k=2**32 - 1, max_new_tokens=4, temperature=0.0), timeout=60, metadata=md)
        assert len(out.token_ids) == 4  # top_k above the vocabulary: no truncation
        out = stub.Generate(g(prompt="", ids=[5] * 500, temperature=0.0), timeout=60, metadata=md)
        assert 0 < len(out.token_ids) <= 512 - 500  # max_new_tokens unset: what fits in the context
        out = stub.Generate(g(prompt="", messages=[("user", "")], max_new_tokens=2), timeout=60, metadata=md)
        assert out.finish_reason in ("length", "stop")


def c(**body) -> bytes:
    return json.dumps({"model": "tiny", "prompt": "def f(x):", "max_tokens": 4, **body}).encode()


def chat(**body) -> bytes:
    return json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], **body}).encode()


def user(content) -> bytes:
    return chat(messages=[{"role": "user", "content": content}])


CHAT = "/v1/chat/completions"
NESTED = b'{"prompt": "x", "metadata": ' + b'{"a": ' * 100_000 + b"1" + b"}" * 100_001
HTTP_CASES = [
    # name, path, body, status, field (the error's `param`)
    ("not JSON", "/v1/completions", b"{prompt: x", 400, "body"),
    ("empty body", "/v1/completions", b"", 400, "body"),
    ("JSON array", "/v1/completions", b"[1, 2]", 400, "body"),
    ("JSON string", "/v1/completions", b'"prompt"', 400, "body"),
    ("invalid UTF-8", "/v1/completions", b'{"prompt": "\xff\xfe"}', 400, "body"),
    ("UTF-8 encoded surrogate", "/v1/completions", b'{"prompt": "\xed\xa0\x80"}', 400, "body"),
    ("oversized body", "/v1/completions", c(prompt="z" * 5_000_000), 413, "body"),
    ("deeply nested array", "/v1/completions", b"[" * 1_000_000, 400, "body"),
    ("deeply nested field", "/v1/completions", NESTED, 400, "body"),
    ("5000-digit number", "/v1/completions", b'{"prompt": "x", "seed": ' + b"9" * 5000 + b"}", 400, "body"),
    ("lone surrogate in prompt", "/v1/completions", rb'{"model": "tiny", "prompt": "a\ud800b"}', 400, "prompt"),
    ("lone low surrogate in prompt", "/v1/completions", rb'{"prompt": "\udc00"}', 400, "prompt"),
    ("lone surrogate in a prompt list", "/v1/completions", rb'{"prompt": ["\ud800"]}', 400, "prompt[0]"),
    ("lone surrogate in model", "/v1/completions", rb'{"prompt": "x", "model": "\ud800"}', 400, "model"),
    ("lone surrogate in user", "/v1/completions", rb'{"prompt": "x", "user": "\ud800"}', 400, "user"),
    ("lone surrogate in chat", CHAT, rb'{"messages": [{"role": "user", "content": "\ud800"}]}', 400,
     "messages[0].content"),
    ("lone surrogate in a text part", CHAT,
     rb'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\udfff"}]}]}', 400,
     "messages[0].content[0].text"),
    ("missing prompt", "/v1/completions", json.dumps({"model": "tiny"}).encode(), 400, "prompt"),
    ("empty prompt", "/v1/completions", c(prompt=""), 400, "prompt"),
    ("null prompt", "/v1/completions", c(prompt=None), 400, "prompt"),
    ("number prompt", "/v1/completions", c(prompt=5), 400, "prompt"),
    ("object prompt", "/v1/completions", c(prompt={"text": "x"}), 400, "prompt"),
    ("two prompts", "/v1/completions", c(prompt=["a", "b"]), 400, "prompt"),
    ("two token prompts", "/v1/completions", c(prompt=[[1], [2]]), 400, "prompt"),
    ("empty token list", "/v1/completions", c(prompt=[]), 400, "prompt"),
    ("bool in token prompt", "/v1/completions", c(prompt=[1, True]), 400, "prompt"),
    ("float in token prompt", "/v1/completions", c(prompt=[1, 2.5]), 400, "prompt"),
    ("600k booleans as tokens", "/v1/completions", c(prompt=[True] * 600_000), 400, "prompt"),
    ("token out of vocab", "/v1/completions", c(prompt=[10**6]), 400, "prompt"),
    ("token at 2^31", "/v1/completions", c(prompt=[2**31]), 400, "prompt"),
    ("too long prompt", "/v1/completions", c(prompt="x" * 9000), 400, "prompt"),
    ("prompt over the context", "/v1/completions", c(prompt=[5] * 512), 400, "prompt"),
    ("NaN temperature", "/v1/completions", b'{"prompt": "x", "temperature": NaN}', 400, "temperature"),
    ("Infinity temperature", "/v1/completions", b'{"prompt": "x", "temperature": Infinity}', 400, "temperature"),
    ("1e999 temperature", "/v1/completions", b'{"prompt": "x", "temperature": 1e999}', 400, "temperature"),
    ("-Infinity top_p", "/v1/completions", b'{"prompt": "x", "top_p": -Infinity}', 400, "top_p"),
    ("string temperature", "/v1/completions", c(temperature="hot"), 400, "temperature"),
    ("bool temperature", "/v1/completions", c(temperature=True), 400, "temperature"),
    ("negative temperature", "/v1/completions", c(temperature=-1), 400, "temperature"),
    ("top_p 2", "/v1/completions", c(top_p=2), 400, "top_p"),
    ("top_p 0", "/v1/completions", c(top_p=0), 400, "top_p"),
    ("negative max_tokens", "/v1/completions", c(max_tokens=-5), 400, "max_tokens"),
    ("zero max_tokens", "/v1/completions", c(max_tokens=0), 400, "max_tokens"),
    ("huge max_tokens", "/v1/completions", c(max_tokens=10**9), 400, "max_tokens"),
    ("max_tokens 2^31", "/v1/completions", c(max_tokens=2**31), 400, "max_tokens"),
    ("max_tokens 2^63", "/v1/completions", c(max_tokens=2**63), 400, "max_tokens"),
    ("max_tokens 2^64", "/v1/completions", c(max_tokens=2**64), 400, "max_tokens"),
    ("max_tokens over the context", "/v1/completions", c(prompt="x" * 100, max_tokens=500), 400, "max_tokens"),
    ("string max_tokens", "/v1/completions", c(max_tokens="10"), 400, "max_tokens"),
    ("float max_tokens", "/v1/completions", c(max_tokens=1.5), 400, "max_tokens"),
    ("whole float max_tokens", "/v1/completions", c(max_tokens=4.0), 400, "max_tokens"),
    ("zero max_completion_tokens", CHAT, chat(max_completion_tokens=0), 400, "max_completion_tokens"),
    ("negative seed", "/v1/completions", c(seed=-1), 400, "seed"),
    ("seed 2^63", "/v1/completions", c(seed=2**63), 400, "seed"),
    ("seed 2^64", "/v1/completions", c(seed=2**64), 400, "seed"),
    ("string seed", "/v1/completions", c(seed="x"), 400, "seed"),
    ("top_k under -1", "/v1/completions", c(top_k=-2), 400, "top_k"),
    ("top_k 2^32", "/v1/completions", c(top_k=2**32), 400, "top_k"),
    ("top_k 2^64", "/v1/completions", c(top_k=2**64), 400, "top_k"),
    ("streamed top_k 2^32", "/v1/completions", c(top_k=2**32, stream=True), 400, "top_k"),
    ("float top_k", "/v1/completions", c(top_k=5.5), 400, "top_k"),
    ("n=17", "/v1/completions", c(n=17), 400, "n"),
    ("n=2^64", "/v1/completions", c(n=2**64), 400, "n"),
    ("string n", "/v1/completions", c(n="1"), 400, "n"),
    ("empty stop sequence", "/v1/completions", c(stop=["\n", ""]), 400, "stop[1]"),
    ("17 stop sequences", "/v1/completions", c(stop=[str(i) for i in range(17)]), 400, "stop"),
    ("stop token id outside the vocabulary", "/v1/completions", c(stop_token_ids=[2**31]), 400, "stop_token_ids"),
    ("100k stop sequences", "/v1/completions", c(stop=["a"] * 100_000), 400, "stop"),
    ("number in stop", "/v1/completions", c(stop=[5]), 400, "stop[0]"),
    ("number stop", "/v1/completions", c(stop=5), 400, "stop"),
    ("logit bias over 100", "/v1/completions", c(logit_bias={"5": 101}), 400, "logit_bias.5"),
    ("logit bias outside the vocabulary", "/v1/completions", c(logit_bias={"99999999": 1}), 400, "logit_bias"),
    ("min_tokens over max_tokens", "/v1/completions", c(min_tokens=9, max_tokens=8), 400, "min_tokens"),
    ("logit bias list", "/v1/completions", c(logit_bias=[1, 2]), 400, "logit_bias"),
    ("logit bias of 100k entries", "/v1/completions", c(logit_bias={str(i): "x" for i in range(100_000)}), 400,
     "logit_bias"),
    ("logprobs over 20", "/v1/completions", c(logprobs=21), 400, "logprobs"),
    ("presence penalty over 2", "/v1/completions", c(presence_penalty=2.5), 400, "presence_penalty"),
    ("repetition penalty 0", "/v1/completions", c(repetition_penalty=0), 400, "repetition_penalty"),
    ("streamed prompt_logprobs", "/v1/completions", c(prompt_logprobs=1, stream=True), 400, "prompt_logprobs"),
    ("stream_options not an object", "/v1/completions", c(stream=True, stream_options="usage"), 400,
     "stream_options"),
    ("string include_usage", "/v1/completions", c(stream=True, stream_options={"include_usage": "yes"}), 400,
     "stream_options.include_usage"),
    ("unknown model", "/v1/completions", c(model="nope"), 400, "model"),
    ("streamed unknown model", "/v1/completions", c(model="nope", stream=True), 400, "model"),
    ("number model", "/v1/completions", c(model=5), 400, "model"),
    ("object model", "/v1/completions", c(model={"name": "tiny"}), 400, "model"),
    ("long model name", "/v1/completions", c(model="m" * 100_000), 400, "model"),
    ("k out of range", "/v1/completions", c(speculation={"k": 99}), 400, "speculation.k"),
    ("k zero", "/v1/completions", c(speculation={"k": 0}), 400, "speculation.k"),
    ("unknown method", "/v1/completions", c(speculation={"method": "x"}), 400, "speculation.method"),
    ("speculation not an object", "/v1/completions", c(speculation="fast"), 400, "speculation"),
    ("string stream", "/v1/completions", c(stream="yes"), 400, "stream"),
    ("chat without messages", CHAT, json.dumps({"model": "tiny"}).encode(), 400, "messages"),
    ("chat with no messages", CHAT, chat(messages=[]), 400, "messages"),
    ("chat messages not a list", CHAT, chat(messages="hi"), 400, "messages"),
    ("chat message not an object", CHAT, chat(messages=["hi"]), 400, "messages[0]"),
    ("chat with a robot", CHAT, chat(messages=[{"role": "robot", "content": "x"}]), 400, "messages[0].role"),
    ("chat tool message", CHAT, chat(messages=[{"role": "tool", "content": "x", "tool_call_id": "1"}]), 400,
     "messages[0].role"),
    ("chat content not text", CHAT, user(5), 400, "messages[0].content"),
    ("chat null content", CHAT, user(None), 400, "messages[0].content"),
    ("chat tool calls", CHAT, chat(messages=[{"role": "assistant", "content": None, "tool_calls": []}]), 400,
     "messages[0].content"),
    ("chat empty parts", CHAT, user([]), 400, "messages[0].content"),
    ("chat image part", CHAT, user([{"type": "text", "text": "what is this?"},
                                    {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]), 400,
     "messages[0].content[1].type"),
    ("chat audio part", CHAT, user([{"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}]), 400,
     "messages[0].content[0].type"),
    ("chat part without type", CHAT, user([{"text": "x"}]), 400, "messages[0].content[0].type"),
    ("chat part not an object", CHAT, user(["x"]), 400, "messages[0].content[0]"),
    ("chat 5000 messages", CHAT, chat(messages=[{"role": "user", "content": ""}] * 5000), 400, "messages"),
    ("chat longer than the context", CHAT, user("z" * 100_000), 400, "messages"),
    ("chat top_logprobs over 20", CHAT, chat(logprobs=True, top_logprobs=21), 400, "top_logprobs"),
    ("chat top_logprobs without logprobs", CHAT, chat(top_logprobs=3), 400, "top_logprobs"),
    ("chat tools", CHAT, chat(tools=[{"type": "function", "function": {"name": "f"}}]), 400, "tools"),
    ("chat response format of no type", CHAT, chat(response_format={"type": "xml"}), 400, "response_format"),
    ("chat response format's bad schema", CHAT, chat(response_format={"type": "json_schema", "json_schema": {
        "name": "a", "schema": {"type": "no such type"}}}), 400, "response_format.json_schema.schema"),
    ("chat NaN top_p", CHAT,
     b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "top_p": NaN}', 400, "top_p"),
    ("streamed chat with a bad part", CHAT, chat(stream=True, messages=[{"role": "user", "content": [{"type": "x"}]}]),
     400, "messages[0].content[0].type"),
]  # fmt: skip


def _post(srv, path, data):
    req = urllib.request.Request(srv["http"] + path, data, {"Content-Type": "application/json"}, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.mark.parametrize(("name", "path", "data", "status", "field"), HTTP_CASES, ids=[c[0] for c in HTTP_CASES])
def test_http_bad_input(server, reference, name, path, data, status, field):
    got, out = _post(server, path, data)
    assert got == status, out
    assert out["error"]["type"] == "invalid_request_error" and out["error"]["param"] == field
    assert out["error"]["message"].startswith(f"invalid {field}: ") and len(out["error"]["message"]) < 400
    got, ok = _post(server, "/v1/completions", c(prompt=PROMPTS[0], max_tokens=24, temperature=0))
    assert got == 200 and ok["choices"][0]["text"] == reference[PROMPTS[0]][1]


HTTP_GOOD = [
    ("text parts", CHAT, user([{"type": "text", "text": "hi"}, {"type": "text", "text": "there"}])),
    ("neutral OpenAI fields", "/v1/completions",
     c(n=1, stop=[], logit_bias={}, logprobs=None, echo=False, frequency_penalty=0.0, presence_penalty=0, user="u",
       metadata={"k": "v"}, store=False, temperature=None, top_p=None, best_of=1, suffix="")),
    ("neutral chat fields", CHAT, chat(stop="", logprobs=False, tools=[], tool_choice="none", parallel_tool_calls=False,
                                       response_format={"type": "text"}, max_tokens=4)),
    ("top_k above the vocabulary", "/v1/completions", c(top_k=2**32 - 1)),
    ("top_k -1 (off, vLLM's)", "/v1/completions", c(top_k=-1)),
    ("unknown fields, ignored (vLLM's)", "/v1/completions", c(frobnicate=1, speculation={"depth": 2},
                                                             stream_options={"x": 1})),
    ("100k unknown fields, ignored", "/v1/completions", c(**{f"f{i}": 0 for i in range(100_000)})),
    ("lone surrogate in an unknown key, ignored", "/v1/completions", rb'{"prompt": "x", "\ud800": 1, "max_tokens": 4}'),
    ("every speculation option", "/v1/completions", c(speculation={"method": "draft", "k": "auto"}, seed=0)),
    ("a batch of one token prompt", "/v1/completions", c(prompt=[[5, 6, 7]])),
    ("max_tokens unset after a long prompt", "/v1/completions", json.dumps({"prompt": [5] * 500}).encode()),
    ("stream_options without stream", "/v1/completions", c(stream_options={"include_usage": True})),
    ("unicode beyond the BMP", "/v1/completions", c(prompt="\U0001f600 \u00e9")),
    ("every logits control", "/v1/completions", c(presence_penalty=-2, frequency_penalty=2, repetition_penalty=1.5,
                                                   min_p=0.5, logit_bias={"5": -100, "6": 100}, min_tokens=3,
                                                   max_tokens=8, temperature=0.7, seed=1)),
]  # fmt: skip


@pytest.mark.parametrize(("name", "path", "data"), HTTP_GOOD, ids=[c[0] for c in HTTP_GOOD])
def test_http_odd_but_valid_input_is_served(server, name, path, data):
    status, out = _post(server, path, data)
    assert status == 200, out
    assert 0 < out["usage"]["completion_tokens"] <= 512 - out["usage"]["prompt_tokens"]


def _raw_http(srv, head: bytes, body: bytes = b"") -> tuple[int, dict]:
    """Send a hand-made request (headers and body as given) and read the status line and JSON body."""
    host, port = srv["http"].removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=60) as sock:
        sock.sendall(head + b"\r\n\r\n" + body)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    headers, _, payload = data.partition(b"\r\n\r\n")
    if b"transfer-encoding: chunked" in headers.lower():
        payload = payload.split(b"\r\n", 1)[1].rsplit(b"\r\n0\r\n", 1)[0]
    return int(headers.split(b" ", 2)[1]), json.loads(payload)


def test_http_declared_or_chunked_bodies_over_the_limit_get_413_before_they_are_read(server, reference):
    start = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nConnection: close"
    # 10 GB announced, nothing sent: refused on the announcement
    status, out = _raw_http(server, start + b"\r\nContent-Length: 10000000000")
    assert status == 413 and out["error"]["param"] == "body" and "exceed the limit" in out["error"]["message"]
    # no length announced: refused once the chunks read pass the limit
    piece = b"x" * 1_000_000
    chunks = (b"%x\r\n" % len(piece) + piece + b"\r\n") * 5 + b"0\r\n\r\n"
    status, out = _raw_http(server, start + b"\r\nTransfer-Encoding: chunked", chunks)
    assert status == 413 and "longer than the limit" in out["error"]["message"]
    status, ok = _post(server, "/v1/completions", c(prompt=PROMPTS[0], max_tokens=24, temperature=0))
    assert status == 200 and ok["choices"][0]["text"] == reference[PROMPTS[0]][1]


def _refused(url: str) -> dict[tuple[str, str], float]:
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    out: dict[tuple[str, str], float] = {}
    for line in text.splitlines():
        if line.startswith("ray_specserve_refused_requests_total{"):
            tags = dict(re.findall(r'(\w+)="([^"]*)"', line))
            key = (tags["route"], tags["status"])
            out[key] = out.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def _settled(url: str, quiet_s: float = 4.0 * METRICS_REPORT_S) -> dict[tuple[str, str], float]:
    """The counts once earlier tests' refusals are exported: unchanged for longer than the app's Ray report period."""
    last, since = _refused(url), time.time()
    while time.time() - since < quiet_s:
        time.sleep(0.5)
        now = _refused(url)
        if now != last:
            last, since = now, time.time()
    return last


def test_refused_requests_are_counted_by_route_and_status(server):
    before = _settled(server["metrics"])
    _post(server, "/v1/completions", c(top_k=-2))
    _post(server, CHAT, user(None))
    _post(server, CHAT, user(None))
    _post(server, "/v1/completions", c(prompt="z" * 5_000_000))
    with grpc.insecure_channel(server["grpc"]) as channel, pytest.raises(grpc.RpcError):
        pb_grpc.SpecServeStub(channel).Generate(g(top_p=2.0), timeout=60, metadata=(("application", "specserve"),))
    expected = {("/v1/completions", "400"): 1, (CHAT, "400"): 2, ("/v1/completions", "413"): 1,
                ("/specserve.v1.SpecServe/Generate", "INVALID_ARGUMENT"): 1}  # fmt: skip
    deadline = time.time() + 60
    while True:  # Ray exports metrics every few seconds
        after = _refused(server["metrics"])
        delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in expected}
        if delta == expected or time.time() > deadline:
            break
        time.sleep(0.5)
    assert delta == expected, (delta, after)


def test_there_are_at_least_a_hundred_and_fifty_cases():
    assert len(GRPC_CASES) + 3 + len(HTTP_CASES) + len(HTTP_GOOD) >= 150
