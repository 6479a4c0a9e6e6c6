"""The Serve application's operations end to end on a local Ray (the package's app, conftest.py): Prometheus
metrics and the Grafana dashboard's queries against them, health and draining, and request ids."""

import json
import re
import time
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import pytest
import ray

from tests.helpers import dashboard_queries as dq
from tests.helpers.serve_app import METRICS_REPORT_S, PROMPTS, N, http_health

pytestmark = pytest.mark.slow


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


# The pipeline's rounds, as /health counts them (a round whose request a stop sequence ended reaches no histogram)
ROUNDS = "ray_specserve_rounds_total"


def _scrape_when(url: str, health: str, timeout_s: float = 90.0, settled=None) -> dict[str, float]:
    """Ray exports metrics every few seconds: scrape until the exported round count equals the pipeline's own and
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


def _grpc_health(server, service: str):
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(server["grpc"]) as channel:  # no `application` metadata: as a probe sends it
        return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service), timeout=30)


def test_health_reports_ready_and_a_draining_app_refuses_new_requests_until_it_admits_again(server, client):
    from grpc_health.v1 import health_pb2

    from specserve.cluster.serve.registry import REGISTRY_NAMESPACE, registry_name

    status, body = http_health(server)
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
        while http_health(server)[0] != 503 and time.time() < deadline:
            time.sleep(0.25)
        status, body = http_health(server)
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
    while http_health(server)[0] != 200 and time.time() < deadline:
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
