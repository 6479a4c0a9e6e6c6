"""The prompts of tests/integration/tiny_app/ (its `reference` fixture holds their target-only outputs, which the
bad-input cases compare the next valid request against), and a served app's /health."""

import json
import urllib.error
import urllib.request

PROMPTS = ["def add(a, b):", "class Stack:", "for i in range(3):", "import json"]
N = 24  # new tokens of their reference outputs
METRICS_REPORT_S = 1  # how often the metric tests' Ray exports each process's metrics (its metrics_report_interval_ms)


def http_health(server: dict) -> tuple[int, dict]:
    """GET /health of a running app (`server`: start's info): its status code and body, 503 included."""
    try:
        with urllib.request.urlopen(server["http"] + "/health", timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())
