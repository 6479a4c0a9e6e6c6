"""The Serve application end to end on a local Ray: the public gRPC service through Serve's gRPC proxy (unary,
streaming, reflection, errors), the OpenAI-compatible HTTP API through the real `openai` package, Prometheus
metrics and the Grafana dashboard's queries against them, and the CLI client. Greedy outputs must equal target-only
decoding."""

import json
import re
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import openai
import pytest
import ray

from specserve.client import SpecServeClient
from specserve.cluster.app_config import serve_config
from specserve.cluster.serve.local_ray import init_ray
from specserve.cluster.serve.server import start, stop
from specserve.workers.config.request import SamplingParams, SpecParams
from specserve.workers.config.settings import ModelConfig
from specserve.workers.runtime.loading import load_model
from specserve.workers.service.local_processes import free_port
from specserve.workers.speculation.engine import SpecEngine
from tests.helpers import dashboard_queries as dq
from tests.helpers.serve_app import METRICS_REPORT_S, PROMPTS, tiny_app_config

pytestmark = pytest.mark.slow

N = 24


@pytest.fixture(scope="module")
def server(tiny_target, tiny_draft):
    metrics_port = free_port()
    # Metrics leave each process every second (Ray's default: 10 s), so that the metric tests wait less for them
    init_ray(num_cpus=4, include_dashboard=False, _metrics_export_port=metrics_port, configure_logging=False,
             log_to_driver=False, _system_config={"metrics_report_interval_ms": METRICS_REPORT_S * 1000})  # fmt: skip
    app = tiny_app_config(tiny_target, tiny_draft)
    config = serve_config(app, grpc_port=free_port(), http_port=free_port())
    info = start(config, metrics_port=metrics_port, ready_timeout_s=300)
    yield info
    stop({**info, "started_ray": False})
    ray.shutdown()


@pytest.fixture(scope="module")
def reference(tiny_target):
    engine = SpecEngine(load_model(ModelConfig(path=tiny_target, device="cpu")))
    out = {}
    for p in PROMPTS:
        r = engine.generate(p, SamplingParams(max_new_tokens=N), SpecParams(method="none"))
        out[p] = (r.token_ids, r.text)
    return out


@pytest.fixture(scope="module")
def client(server):
    with SpecServeClient(server["grpc"], timeout_s=120) as c:
        yield c


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=server["http"] + "/v1", api_key="unused", max_retries=0, timeout=120)


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
    assert [m.id for m in oai.models.list().data] == ["tiny"]
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


def _scrape(url: str) -> dict[str, float]:
    """Model "tiny"'s samples by name (and position), summed over the other labels."""
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    values: dict[str, float] = {}
    for line in text.splitlines():
        m = re.match(r"^(ray_specserve_\w+)\{([^}]*)\} ([0-9.e+-]+)$", line)
        if m and 'model_name="tiny"' in m.group(2):
            key = m.group(1) + ("" if "position" not in m.group(2) else re.search(r'position="(\d+)"', m.group(2))[0])
            values[key] = values.get(key, 0.0) + float(m.group(3))
    return values


ROUNDS = "ray_specserve_spec_decode_draft_tokens_per_round_count"  # one observation per round, drafting or not


def _scrape_when(url: str, health: str, timeout_s: float = 90.0, settled=None) -> dict[str, float]:
    """Ray exports metrics every few seconds: scrape until the exported round count equals the scheduler's own and
    `settled` holds, or, without one, until every value has stayed unchanged for longer than the report period (one
    process's metrics need not all leave in the same export: a CI run's baseline once caught the round count
    exported but not an earlier test's drafted tokens)."""
    deadline, quiet_s = time.time() + timeout_s, 4.0 * METRICS_REPORT_S
    last, since = None, time.time()
    while True:
        body = json.loads(urllib.request.urlopen(health, timeout=10).read())
        rounds = body.get("models", body)["tiny"]["rounds"]  # /health: {"status", "models": {name: status}}
        values = _scrape(url)
        if values != last:
            last, since = values, time.time()
        done = settled(values) if settled else time.time() - since >= quiet_s
        if (values.get(ROUNDS, 0) == rounds and done) or time.time() > deadline:
            return values
        time.sleep(0.5)


def test_metrics_move_by_the_expected_amounts(server, client):
    url, health = server["metrics"], server["http"] + "/health"
    before = _scrape_when(url, health)
    out = client.generate(PROMPTS[3], max_new_tokens=N, k=4)
    s = out["stats"]
    moved = {"spec_decode_num_draft_tokens_total": s["drafted"], "spec_decode_num_accepted_tokens_total": s["accepted"]}
    after = _scrape_when(url, health, settled=lambda values: all(
        values.get("ray_specserve_" + name, 0.0) - before.get("ray_specserve_" + name, 0.0) == n
        for name, n in moved.items()))  # fmt: skip

    def delta(name):
        return after.get("ray_specserve_" + name, 0.0) - before.get("ray_specserve_" + name, 0.0)

    per_pos = sum(delta(f'spec_decode_num_accepted_tokens_per_pos_total position="{i}"'.replace(" ", ""))
                  for i in range(16))  # fmt: skip
    assert delta("spec_decode_draft_tokens_per_round_count") == s["rounds"]
    # rounds that drafted (k = 4: all but the last)
    assert 0 < delta("spec_decode_num_drafts_total") <= s["rounds"], (s, after)
    assert delta("spec_decode_num_draft_tokens_total") == s["drafted"] <= 4 * delta("spec_decode_num_drafts_total")
    assert delta("spec_decode_num_accepted_tokens_total") == s["accepted"] == per_pos  # 0-based positions
    assert delta("generation_tokens_total") == len(out["token_ids"]) and delta("prompt_tokens_total") > 0
    for histogram in ("time_to_first_token", "e2e_request_latency", "request_queue_time",
                      "request_time_per_output_token"):  # fmt: skip
        assert delta(f"{histogram}_seconds_count") == 1, histogram
    assert delta("inter_token_latency_seconds_count") == s["rounds"] - 1  # one per round after the first token's
    assert delta("request_success_total") == 1
    assert after["ray_specserve_kv_cache_capacity_tokens"] > 0 and after["ray_specserve_kv_cache_usage_perc"] >= 0
    assert 0 <= after["ray_specserve_spec_decode_acceptance_rate"] <= 1
    assert after["ray_specserve_num_requests_running"] == after["ray_specserve_num_requests_waiting"] == 0


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


# The table-driven bad-input tests run against this module's Serve app (see tests/helpers/serve_bad_input_cases.py).
from tests.helpers.serve_bad_input_cases import *  # noqa: E402, F403

# dashboards/specserve.json against a live scrape: every metric its queries read is on this app's `/metrics`, as Ray
# exports it (`ray_specserve_*`), once a few requests ran. Prompt lookup finds a repeat in the first prompt and the
# tiny target keeps one of its drafts: the per-position counter, which Ray exports from its first increment only,
# gets one.
DASHBOARD_REQUESTS = [("a b c a b c a b c a b c", {"method": "ngram", "k": 3}), ("def add(a, b):", {"k": 4}),
                      ("import json", {"method": "ngram", "k": 2})]  # fmt: skip


def test_every_dashboard_query_names_a_metric_the_app_exports(server, client):
    dashboard = dq.load()
    wanted = dq.metric_names(dq.panel_exprs(dashboard) + dq.variable_queries(dashboard))
    assert len(wanted) > 15
    for prompt, spec in DASHBOARD_REQUESTS:
        client.generate(prompt, max_new_tokens=24, **spec)
    deadline = time.time() + 120  # Ray exports every few seconds; workers report their KV cache at each heartbeat
    while True:
        missing = wanted - dq.scraped_names(server["metrics"])
        if not missing or time.time() > deadline:
            break
        time.sleep(0.5)
    assert not missing, f"the dashboard reads metrics the app does not export: {sorted(missing)}"


def _health(server) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(server["http"] + "/health", timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _grpc_health(server, service: str):
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(server["grpc"]) as channel:  # no `application` metadata: as a probe sends it
        return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service), timeout=30)


def test_health_reports_ready_and_a_draining_app_refuses_new_requests_until_it_admits_again(server, client):
    from grpc_health.v1 import health_pb2

    from specserve.cluster.serve.registry import REGISTRY_NAMESPACE, registry_name

    status, body = _health(server)
    assert status == 200 and body["status"] == "ok" and body["models"]["tiny"]["targets"]
    serving = health_pb2.HealthCheckResponse.SERVING
    assert _grpc_health(server, "").status == _grpc_health(server, "tiny").status == serving
    with pytest.raises(grpc.RpcError) as err:
        _grpc_health(server, "no-such-model")
    assert err.value.code() == grpc.StatusCode.NOT_FOUND

    registry = ray.get_actor(registry_name(server["app"]), namespace=REGISTRY_NAMESPACE)
    ray.get(registry.set_draining.remote(True))
    try:
        deadline = time.time() + 30
        while _health(server)[0] != 503 and time.time() < deadline:
            time.sleep(0.25)
        status, body = _health(server)
        assert status == 503 and body["status"] == "draining"
        assert _grpc_health(server, "").status == health_pb2.HealthCheckResponse.NOT_SERVING
        with pytest.raises(grpc.RpcError) as err:
            client.generate(PROMPTS[0], max_new_tokens=4)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "draining" in err.value.details()
        request = urllib.request.Request(server["http"] + "/v1/completions", method="POST",
                                         data=json.dumps({"model": "tiny", "prompt": "x", "max_tokens": 2}).encode(),
                                         headers={"content-type": "application/json"})  # fmt: skip
        with pytest.raises(urllib.error.HTTPError) as http_err:
            urllib.request.urlopen(request, timeout=30)
        assert http_err.value.code == 503 and http_err.value.headers["Retry-After"] == "1"
    finally:
        ray.get(registry.set_draining.remote(False))
    deadline = time.time() + 30
    while _health(server)[0] != 200 and time.time() < deadline:
        time.sleep(0.25)
    assert client.generate(PROMPTS[0], max_new_tokens=4)["token_ids"]


def _completion(server, headers: dict, stream: bool = False):
    body = {"model": "tiny", "prompt": PROMPTS[1], "max_tokens": 4, "stream": stream}
    request = urllib.request.Request(server["http"] + "/v1/completions", data=json.dumps(body).encode(),
                                     headers={"content-type": "application/json", **headers})  # fmt: skip
    try:
        with urllib.request.urlopen(request, timeout=60) as r:
            return r.status, r.headers, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.headers, e.read().decode()


def test_request_ids_are_taken_or_made_returned_everywhere_and_logged(server, client):
    status, headers, body = _completion(server, {"x-request-id": "job-7.a"})
    assert status == 200 and headers["x-request-id"] == "job-7.a" and json.loads(body)["id"] == "cmpl-job-7.a"
    status, headers, body = _completion(server, {})
    made = headers["x-request-id"]
    assert status == 200 and made and json.loads(body)["id"] == f"cmpl-{made}"
    status, headers, body = _completion(server, {"x-request-id": "job-8"}, stream=True)
    events = [json.loads(e.removeprefix("data: ")) for e in body.split("\n\n") if e.startswith("data: {")]
    assert headers["x-request-id"] == "job-8" and events and {e["id"] for e in events} == {"cmpl-job-8"}
    status, _, body = _completion(server, {"x-request-id": "no spaces allowed"})
    assert status == 400 and json.loads(body)["error"]["param"] == "x-request-id"

    call = client.stub.Generate.with_call
    request = client.request(PROMPTS[1], max_new_tokens=4)
    _, answer = call(request, metadata=[("x-request-id", "grpc-9")], timeout=60)
    assert ("x-request-id", "grpc-9") in answer.trailing_metadata()
    with pytest.raises(grpc.RpcError) as err:
        call(client.request(PROMPTS[1], max_new_tokens=10**9), metadata=[("x-request-id", "grpc-10")], timeout=60)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().endswith("(request grpc-10)")  # Serve's proxy sends no trailing metadata with errors

    logs = Path(ray._private.worker._global_node.get_session_dir_path()) / "logs"
    deadline = time.time() + 30
    while time.time() < deadline:  # the refusal's log line names the request (worker logs are flushed lazily)
        if any("grpc-10" in p.read_text(errors="replace") for p in logs.rglob("*") if p.is_file()):
            break
        time.sleep(1)
    else:
        pytest.fail("no log line names request grpc-10")


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
