"""The Serve application's APIs end to end on a local Ray (the package's app, conftest.py): the public gRPC service
through Serve's gRPC proxy (unary, streaming, reflection, errors), the OpenAI-compatible HTTP API through the real
`openai` package, and the CLI client. Greedy outputs must equal target-only decoding. Its first test runs before any
request reached the app: the gauges are exported from the start."""

import json
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import grpc
import openai
import pytest

from specserve.workers.config.request import SamplingParams, SpecParams
from specserve.workers.config.settings import ModelConfig
from specserve.workers.runtime.loading import load_model
from specserve.workers.speculation.engine import SpecEngine
from tests.helpers.serve_app import PROMPTS, N

pytestmark = pytest.mark.slow


def test_gauges_are_exported_before_the_first_request(server):
    deadline, values = time.time() + 60, {}
    while time.time() < deadline and 'ray_specserve_spec_decode_acceptance_rate{model_name="tiny"}' not in values:
        time.sleep(1)
        values = _labelled(server["metrics"])
    gauges = ("spec_decode_acceptance_rate", "spec_decode_mean_acceptance_length", "num_requests_running")
    for name in (*gauges, "num_requests_waiting"):
        assert values[f'ray_specserve_{name}{{model_name="tiny"}}'] == 0.0
    # and they stay exported while nothing changes them: Ray's agent drops a gauge value 2 report intervals (here
    # 2 s) after it arrived, and the replicas set theirs again (cluster/serve/metrics.py, GAUGE_REFRESH_S)
    for _ in range(3):
        time.sleep(2.5)
        values = _labelled(server["metrics"])
        for name in (*gauges, "num_requests_waiting", "kv_cache_capacity_tokens"):
            assert f'ray_specserve_{name}{{model_name="tiny"}}' in values, name


def _labelled(url: str) -> dict[str, float]:
    """Samples keyed by name{model_name="..."} (the other labels dropped)."""
    out = {}
    for line in urllib.request.urlopen(url, timeout=10).read().decode().splitlines():
        if line.startswith("ray_specserve_") and 'model_name="' in line:
            name, rest = line.split("{", 1)
            model = rest.split('model_name="', 1)[1].split('"', 1)[0]
            out[f'{name}{{model_name="{model}"}}'] = float(line.rsplit(" ", 1)[1])
    return out


def test_grpc_generate_is_lossless_for_concurrent_requests(client, reference):
    with ThreadPoolExecutor(len(PROMPTS) * 2) as pool:
        draft = list(pool.map(lambda p: client.generate(p, max_new_tokens=N, k=3), PROMPTS))
        ngram = list(pool.map(lambda p: client.generate(p, max_new_tokens=N, method="ngram", k=2), PROMPTS))
    suffix = [client.generate(p, max_new_tokens=N, method="suffix") for p in PROMPTS * 2]  # again: from the cache
    again = suffix[len(PROMPTS) :]
    assert [s["token_ids"] for s in again] == [reference[p][0] for p in PROMPTS]
    assert sum(s["stats"]["accepted"] for s in again) > sum(s["stats"]["accepted"] for s in suffix[: len(PROMPTS)])
    for p, d, g, s in zip(PROMPTS, draft, ngram, suffix, strict=False):
        assert d["token_ids"] == reference[p][0] == g["token_ids"] == s["token_ids"]
        assert d["text"] == reference[p][1]
        assert d["finish_reason"] in ("length", "stop")
        assert d["stats"]["drafted"] > 0 and d["stats"]["rounds"] < len(d["token_ids"]) + 1


def test_grpc_stream_chunks_concatenate_to_the_unary_result(client, reference):
    unary = client.generate(PROMPTS[1], max_new_tokens=N, k=4)
    chunks = list(client.generate_stream(PROMPTS[1], max_new_tokens=N, k=4))
    assert len(chunks) == unary["stats"]["rounds"] > 1  # one chunk per round
    assert sum((c["token_ids"] for c in chunks), []) == unary["token_ids"] == reference[PROMPTS[1]][0]
    assert "".join(c["text"] for c in chunks) == unary["text"]
    assert [c["finish_reason"] for c in chunks[:-1]] == [None] * (len(chunks) - 1)
    assert chunks[-1]["finish_reason"] == unary["finish_reason"]


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"prompt": ""}, "prompt"),
        ({"prompt": "x", "temperature": -1.0}, "temperature"),
        ({"prompt": "x", "top_p": 1.5}, "top_p"),
        ({"prompt": "x", "k": 99}, "k"),
        ({"prompt": "x", "method": "magic"}, "method"),
        ({"prompt": "x", "model": "nope"}, "model"),
        ({"prompt": [10**6]}, "prompt"),
        ({"prompt": "x", "max_new_tokens": 10**6}, "max_new_tokens"),
    ],
)
def test_grpc_bad_input_is_invalid_argument_and_the_server_keeps_serving(client, reference, kwargs, field):
    prompt = kwargs.pop("prompt")
    with pytest.raises(grpc.RpcError) as e:
        client.generate(prompt, **kwargs)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in e.value.details()
    assert client.generate(PROMPTS[0], max_new_tokens=N)["token_ids"] == reference[PROMPTS[0]][0]


def test_grpc_reflection_lists_the_public_service(server):
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    with grpc.insecure_channel(server["grpc"]) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        req = reflection_pb2.ServerReflectionRequest(list_services="")
        answer = next(stub.ServerReflectionInfo(iter([req]), timeout=30))
    assert "specserve.v1.SpecServe" in {s.name for s in answer.list_services_response.service}


def test_openai_completions_greedy_and_stream(oai, reference):
    p = PROMPTS[2]
    out = oai.completions.create(model="tiny", prompt=p, max_tokens=N, temperature=0)
    assert out.choices[0].text == reference[p][1]
    assert out.usage.completion_tokens == len(reference[p][0]) and out.usage.prompt_tokens > 0
    stream = oai.completions.create(model="tiny", prompt=p, max_tokens=N, temperature=0, stream=True,
                                    stream_options={"include_usage": True})  # fmt: skip
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == reference[p][1]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("length", "stop")
    assert chunks[-1].usage.completion_tokens == out.usage.completion_tokens


def test_openai_chat_models_and_errors(oai, server):
    chat = oai.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=8, temperature=0
    )
    assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens > 0
    pieces = oai.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=8, temperature=0, stream=True
    )
    assert "".join(c.choices[0].delta.content or "" for c in pieces if c.choices) == chat.choices[0].message.content
    assert [m.id for m in oai.models.list().data] == ["tiny", "caller", "compat"]
    with pytest.raises(openai.BadRequestError) as e:
        oai.completions.create(model="tiny", prompt="x", temperature=-0.5)
    assert e.value.status_code == 400 and e.value.body["param"] == "temperature"
    bad = [(b'{"prompt": "x", "temperature": NaN}', "temperature"), (b'{"prompt": "x", "top_k": -2}', "top_k"),
           (b'{"prompt": "x", "max_tokens": "many"}', "max_tokens"), (b"[1, 2]", "body")]  # fmt: skip
    for body, param in bad:
        raw = urllib.request.Request(server["http"] + "/v1/completions", data=body, method="POST")
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(raw, timeout=30)
        assert e.value.code == 400 and json.loads(e.value.read())["error"]["param"] == param
    with pytest.raises(openai.BadRequestError) as e:
        oai.completions.create(model="nope", prompt="x")
    assert e.value.body["code"] == "model_not_found"
    raw = urllib.request.Request(server["http"] + "/v1/completions", data=b"{not json", method="POST")
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(raw, timeout=30)
    assert e.value.code == 400 and "not valid JSON" in json.loads(e.value.read())["error"]["message"]


def test_cli_generate_against_the_server(server, reference, capsys):
    from specserve.cluster.cli.main import main

    p = PROMPTS[0]
    assert main(["generate", p, "--address", server["grpc"], "--max-new-tokens", str(N), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out) == {"text", "token_ids", "finish_reason", "stats"} and out["token_ids"] == reference[p][0]
    assert main(["generate", p, "--address", server["grpc"], "--max-new-tokens", str(N), "--stream", "--json"]) == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert sum((c["token_ids"] for c in lines), []) == reference[p][0]
    assert main(["generate", p, "--address", server["grpc"], "--temperature", "-2"]) == 2
    assert "INVALID_ARGUMENT" in capsys.readouterr().err


def _plain(text: str) -> bool:
    return text.isascii() and text.isprintable()


def _cut_at(reference_ids, reference_text, stop, tokenizer):
    """Target-only decoding with a stop sequence: the text before it, the ids through the token completing it."""
    n = next(n for n in range(1, len(reference_ids) + 1) if stop in tokenizer.decode(reference_ids[:n]))
    return reference_text[: reference_text.index(stop)], reference_ids[:n]


def test_stop_sequences_and_stop_token_ids_cut_where_target_only_would_on_every_path(server, client, oai, reference,
                                                                                    tiny_target):  # fmt: skip
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_target)
    ids, text = reference[PROMPTS[2]]
    # three plain characters past the start (tokens are single bytes here: a stop straddles rounds)
    at = next(i for i in range(len(text) // 3, len(text) - 3) if _plain(text[i : i + 3]))
    stop = text[at : at + 3]
    want_text, want_ids = _cut_at(ids, text, stop, tokenizer)
    for method, k in (("draft", 4), ("ngram", 3), ("suffix", None), ("none", None)):
        out = client.generate(PROMPTS[2], max_new_tokens=N, method=method, k=k, stop=[stop, "\x00never"])
        assert (out["text"], out["token_ids"], out["finish_reason"]) == (want_text, want_ids, "stop"), method
        chunks = list(client.generate_stream(PROMPTS[2], max_new_tokens=N, method=method, k=k, stop=[stop]))
        assert "".join(c["text"] for c in chunks) == want_text and chunks[-1]["finish_reason"] == "stop"
        assert [t for c in chunks for t in c["token_ids"]] == want_ids
    kept = client.generate(PROMPTS[2], max_new_tokens=N, k=4, stop=[stop], include_stop_str_in_output=True)
    assert kept["text"] == want_text + stop
    by_id = client.generate(PROMPTS[2], max_new_tokens=N, k=4, stop_token_ids=[ids[5]])
    first = ids.index(ids[5])
    assert by_id["token_ids"] == ids[: first + 1] and by_id["finish_reason"] == "stop"

    completion = oai.completions.create(model="tiny", prompt=PROMPTS[2], max_tokens=N, temperature=0, stop=stop)
    assert (completion.choices[0].text, completion.choices[0].finish_reason) == (want_text, "stop")
    streamed = oai.completions.create(model="tiny", prompt=PROMPTS[2], max_tokens=N, temperature=0, stop=[stop],
                                      stream=True)  # fmt: skip
    assert "".join(c.choices[0].text for c in streamed) == want_text
    for bad, field in (({"stop": [""]}, "stop"), ({"stop": ["x"] * 17}, "stop"),
                       ({"stop_token_ids": [10**6]}, "stop_token_ids")):  # fmt: skip
        with pytest.raises(openai.BadRequestError) as err:
            oai.completions.create(model="tiny", prompt="x", max_tokens=2, extra_body=bad)
        assert err.value.body["param"].startswith(field)


def test_n_choices_each_equal_their_own_request_streamed_or_not(oai, reference):
    greedy = oai.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=N, temperature=0, n=3)
    assert [c.index for c in greedy.choices] == [0, 1, 2]
    assert {c.text for c in greedy.choices} == {reference[PROMPTS[0]][1]}
    assert greedy.usage.completion_tokens == 3 * len(reference[PROMPTS[0]][0])

    # a fixed k: with k='auto' the drafts (and so the tokens a seed draws) follow the batch's load
    fixed = {"speculation": {"k": 3}}
    sampled = oai.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=8, temperature=1.0, seed=40, n=3,
                                     extra_body=fixed)  # fmt: skip
    alone = [oai.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=8, temperature=1.0, seed=40 + i,
                                    extra_body=fixed) for i in range(3)]  # fmt: skip
    assert [c.text for c in sampled.choices] == [a.choices[0].text for a in alone]  # choice i: seed + i
    assert len({c.text for c in sampled.choices}) > 1

    stream = oai.chat.completions.create(model="tiny", messages=[{"role": "user", "content": PROMPTS[1]}],
                                         max_tokens=8, temperature=1.0, seed=40, n=2, stream=True,
                                         extra_body=fixed)  # fmt: skip
    texts, finished = {0: "", 1: ""}, set()
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finished.add(choice.index)
    chat = oai.chat.completions.create(model="tiny", messages=[{"role": "user", "content": PROMPTS[1]}],
                                       max_tokens=8, temperature=1.0, seed=40, n=2, extra_body=fixed)  # fmt: skip
    assert finished == {0, 1} and [texts[0], texts[1]] == [c.message.content for c in chat.choices]
    for bad in (0, 17):
        with pytest.raises(openai.BadRequestError) as err:
            oai.completions.create(model="tiny", prompt="x", max_tokens=2, n=bad)
        assert err.value.body["param"] == "n"


def test_tokenize_detokenize_and_a_models_card_as_vllm_serves_them(server, oai, tiny_target):
    from transformers import AutoTokenizer

    from specserve.workers.models.chat import ChatMessage, chat_prompt_ids

    tokenizer = AutoTokenizer.from_pretrained(tiny_target)

    def post(path, body):
        request = urllib.request.Request(server["http"] + path, data=json.dumps(body).encode(),
                                         headers={"content-type": "application/json"})  # fmt: skip
        try:
            with urllib.request.urlopen(request, timeout=30) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    status, out = post("/tokenize", {"model": "tiny", "prompt": PROMPTS[0]})
    completion = oai.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=1, temperature=0)
    assert status == 200 and out["count"] == len(out["tokens"]) == completion.usage.prompt_tokens
    assert out["max_model_len"] == 512
    status, chat = post("/tokenize", {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]})
    assert chat["tokens"] == chat_prompt_ids(tokenizer, (ChatMessage("user", "hi"),))
    assert post("/detokenize", {"model": "tiny", "tokens": out["tokens"]}) == (200, {"prompt": PROMPTS[0]})
    status, err = post("/detokenize", {"model": "tiny", "tokens": [10**6]})
    assert status == 400 and err["error"]["param"] == "tokens"
    status, err = post("/tokenize", {"model": "tiny", "prompt": "x", "messages": [{"role": "user", "content": "x"}]})
    assert status == 400 and err["error"]["param"] == "prompt"
    assert oai.models.retrieve("tiny").id == "tiny"
    with pytest.raises(openai.NotFoundError):
        oai.models.retrieve("no-such-model")


def test_ignore_eos_runs_to_max_tokens_as_target_only_does(client, oai, tiny_target):
    engine = SpecEngine(load_model(ModelConfig(path=tiny_target, device="cpu")))
    eos = min(engine.target.eos_token_ids) if engine.target.eos_token_ids else None
    prompt = [eos, eos, eos] if eos is not None else PROMPTS[0]  # EOS invites EOS
    params = SamplingParams(max_new_tokens=N, stop_at_eos=False)
    want = engine.generate(prompt, params, SpecParams(method="none")).token_ids
    out = client.generate(list(prompt) if isinstance(prompt, list) else prompt, max_new_tokens=N, k=3,
                          ignore_eos=True)  # fmt: skip
    assert out["token_ids"] == want and len(want) == N and out["finish_reason"] == "length"
    completion = oai.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=N, temperature=0,
                                        extra_body={"ignore_eos": True})  # fmt: skip
    assert completion.usage.completion_tokens == N
