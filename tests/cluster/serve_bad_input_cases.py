"""Table-driven bad input against a running Serve app, over gRPC (the public SpecServe service through Serve's
gRPC proxy) and HTTP (the OpenAI-compatible API): every malformed request gets INVALID_ARGUMENT / 400 with a message
naming the problem, and the server answers the next valid request correctly.

Collected through tests/cluster/test_serve_app.py, which imports these tests so that they run against its Serve app
instead of starting another one (a Serve app takes ~45 s to start on 2 cores)."""

import json
import math
import urllib.request

import grpc
import pytest

from specserve.protos import specserve_pb2 as pb
from specserve.protos import specserve_pb2_grpc as pb_grpc

from .test_serve_app import PROMPTS  # its `reference` fixture holds these prompts' outputs


def g(prompt="def f(x):", ids=None, model="", method=None, k=None, **sampling) -> pb.GenerateRequest:
    req = pb.GenerateRequest(model=model, sampling=pb.SamplingParams(**sampling))
    if prompt:
        req.prompt = prompt
    if ids is not None:
        req.prompt_token_ids.extend(ids)
    if method is not None or k is not None:
        req.speculation.method = method or ""
        req.speculation.k = k or 0
    return req


GRPC_CASES = [
    ("no prompt", g(prompt=""), "prompt"),
    ("prompt and ids", g(ids=[5, 6]), "prompt"),
    ("token id out of vocab", g(prompt="", ids=[10**6]), "prompt"),
    ("negative token id", g(prompt="", ids=[-1]), "prompt"),
    ("oversized prompt", g(prompt="x" * 9000), "prompt"),
    ("oversized prompt ids", g(prompt="", ids=[5] * 9000), "prompt"),
    ("huge prompt text", g(prompt="y" * 300_000), "prompt"),
    ("negative temperature", g(temperature=-1.0), "temperature"),
    ("NaN temperature", g(temperature=math.nan), "temperature"),
    ("inf temperature", g(temperature=math.inf), "temperature"),
    ("huge temperature", g(temperature=1e6), "temperature"),
    ("top_p above 1", g(top_p=1.5), "top_p"),
    ("negative top_p", g(top_p=-0.5), "top_p"),
    ("NaN top_p", g(top_p=math.nan), "top_p"),
    ("max tokens over the limit", g(max_new_tokens=10**6), "max_new_tokens"),
    ("max tokens over the context", g(max_new_tokens=4000), "max_new_tokens"),
    ("seed out of range", g(seed=2**64 - 1), "seed"),
    ("k above 16", g(k=17), "k"),
    ("k far out of range", g(k=10**6), "k"),
    ("unknown method", g(method="magic"), "method"),
    ("method in capitals", g(method="DRAFT"), "method"),
    ("unknown model", g(model="nope"), "model"),
    ("path as model", g(model="../../etc/passwd"), "model"),
    ("method with k out of range", g(method="ngram", k=99), "k"),
]


@pytest.mark.parametrize(("name", "request_", "field"), GRPC_CASES, ids=[c[0] for c in GRPC_CASES])
def test_grpc_bad_input(server, client, reference, name, request_, field):
    with grpc.insecure_channel(server["grpc"]) as channel:
        stub = pb_grpc.SpecServeStub(channel)
        with pytest.raises(grpc.RpcError) as e:
            stub.Generate(request_, timeout=60, metadata=(("application", "specserve"),))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()
    assert field in e.value.details()
    assert client.generate(PROMPTS[0], max_new_tokens=24)["token_ids"] == reference[PROMPTS[0]][0]


def test_grpc_invalid_utf8_and_garbage_bytes(server, client, reference):
    # Field 1 (prompt, a proto3 string) carrying invalid UTF-8, then bytes that are no message at all. gRPC's own
    # deserializer in Serve's proxy rejects both before any specserve code runs, with status UNKNOWN and a message
    # naming the problem (the one place the status is not INVALID_ARGUMENT).
    for raw, problem in ((b"\x0a\x02\xff\xfe", "UTF-8"), (b"\xff\xff\xff\xff", "Error parsing message")):
        with grpc.insecure_channel(server["grpc"]) as channel:
            call = channel.unary_unary("/specserve.v1.SpecServe/Generate")
            with pytest.raises(grpc.RpcError) as e:
                call(raw, timeout=60, metadata=(("application", "specserve"),))
        assert e.value.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.UNKNOWN), e.value.details()
        assert problem in e.value.details()
    assert client.generate(PROMPTS[0], max_new_tokens=24)["token_ids"] == reference[PROMPTS[0]][0]


def c(**body) -> bytes:
    return json.dumps({"model": "tiny", "prompt": "def f(x):", "max_tokens": 4, **body}).encode()


def chat(**body) -> bytes:
    return json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], **body}).encode()


HTTP_CASES = [
    ("not JSON", "/v1/completions", b"{prompt: x", "body"),
    ("JSON array", "/v1/completions", b"[1, 2]", "body"),
    ("invalid UTF-8", "/v1/completions", b'{"prompt": "\xff\xfe"}', "body"),
    ("oversized body", "/v1/completions", c(prompt="z" * 5_000_000), "body"),
    ("missing prompt", "/v1/completions", json.dumps({"model": "tiny"}).encode(), "prompt"),
    ("empty prompt", "/v1/completions", c(prompt=""), "prompt"),
    ("number prompt", "/v1/completions", c(prompt=5), "prompt"),
    ("two prompts", "/v1/completions", c(prompt=["a", "b"]), "prompt"),
    ("bool in token prompt", "/v1/completions", c(prompt=[1, True]), "prompt"),
    ("token out of vocab", "/v1/completions", c(prompt=[10**6]), "prompt"),
    ("too long prompt", "/v1/completions", c(prompt="x" * 9000), "prompt"),
    ("NaN temperature", "/v1/completions", b'{"prompt": "x", "temperature": NaN}', "temperature"),
    ("Infinity temperature", "/v1/completions", b'{"prompt": "x", "temperature": Infinity}', "temperature"),
    ("string temperature", "/v1/completions", c(temperature="hot"), "temperature"),
    ("negative temperature", "/v1/completions", c(temperature=-1), "temperature"),
    ("top_p 2", "/v1/completions", c(top_p=2), "top_p"),
    ("top_p 0", "/v1/completions", c(top_p=0), "top_p"),
    ("negative max_tokens", "/v1/completions", c(max_tokens=-5), "max_tokens"),
    ("zero max_tokens", "/v1/completions", c(max_tokens=0), "max_tokens"),
    ("huge max_tokens", "/v1/completions", c(max_tokens=10**9), "max_tokens"),
    ("string max_tokens", "/v1/completions", c(max_tokens="10"), "max_tokens"),
    ("float max_tokens", "/v1/completions", c(max_tokens=1.5), "max_tokens"),
    ("negative seed", "/v1/completions", c(seed=-1), "seed"),
    ("string seed", "/v1/completions", c(seed="x"), "seed"),
    ("negative top_k", "/v1/completions", c(top_k=-1), "top_k"),
    ("unknown field", "/v1/completions", c(frobnicate=1), "frobnicate"),
    ("n=2", "/v1/completions", c(n=2), "n"),
    ("stop sequences", "/v1/completions", c(stop=["\n"]), "stop"),
    ("logprobs", "/v1/completions", c(logprobs=5), "logprobs"),
    ("presence penalty", "/v1/completions", c(presence_penalty=1), "presence_penalty"),
    ("unknown model", "/v1/completions", c(model="nope"), "model"),
    ("number model", "/v1/completions", c(model=5), "model"),
    ("k out of range", "/v1/completions", c(speculation={"k": 99}), "k"),
    ("unknown method", "/v1/completions", c(speculation={"method": "x"}), "method"),
    ("speculation not an object", "/v1/completions", c(speculation="fast"), "speculation"),
    ("unknown speculation field", "/v1/completions", c(speculation={"depth": 2}), "speculation.depth"),
    ("string stream", "/v1/completions", c(stream="yes"), "stream"),
    ("chat without messages", "/v1/chat/completions", json.dumps({"model": "tiny"}).encode(), "messages"),
    ("chat with no messages", "/v1/chat/completions", chat(messages=[]), "messages"),
    ("chat with a robot", "/v1/chat/completions", chat(messages=[{"role": "robot", "content": "x"}]),
     "messages[0].role"),
    ("chat content not text", "/v1/chat/completions", chat(messages=[{"role": "user", "content": 5}]),
     "messages[0].content"),
    ("chat NaN top_p", "/v1/chat/completions",
     b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "top_p": NaN}', "top_p"),
]  # fmt: skip


def _post(srv, path, data):
    req = urllib.request.Request(srv["http"] + path, data, {"Content-Type": "application/json"}, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.mark.parametrize(("name", "path", "data", "field"), HTTP_CASES, ids=[c[0] for c in HTTP_CASES])
def test_http_bad_input(server, reference, name, path, data, field):
    status, out = _post(server, path, data)
    assert status == 400, out
    assert out["error"]["type"] == "invalid_request_error" and field in out["error"]["message"]
    assert out["error"]["param"] == field
    status, ok = _post(server, "/v1/completions", c(prompt=PROMPTS[0], max_tokens=24, temperature=0))
    assert status == 200 and ok["choices"][0]["text"] == reference[PROMPTS[0]][1]


def test_there_are_at_least_fifty_cases():
    assert len(GRPC_CASES) + 1 + len(HTTP_CASES) >= 50
