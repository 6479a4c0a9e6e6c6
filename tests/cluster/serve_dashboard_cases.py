"""dashboards/specserve.json against a live scrape: every metric its queries read is on the `/metrics` endpoint of a
running app, as Ray exports it (`ray_specserve_*`), once a few requests ran. Star-imported by test_serve_app.py,
whose module-scoped `server` and `client` fixtures these tests use (one app for both files' tests)."""

import time

from tests.cluster import dashboard_queries as dq

# Prompt lookup finds a repeat in this prompt and the tiny target keeps one of its drafts: the per-position counter,
# which Ray exports from its first increment only, gets one.
REQUESTS = [("a b c a b c a b c a b c", {"method": "ngram", "k": 3}), ("def add(a, b):", {"k": 4}),
            ("import json", {"method": "ngram", "k": 2})]  # fmt: skip


def test_every_dashboard_query_names_a_metric_the_app_exports(server, client):
    dashboard = dq.load()
    wanted = dq.metric_names(dq.panel_exprs(dashboard) + dq.variable_queries(dashboard))
    assert len(wanted) > 15
    for prompt, spec in REQUESTS:
        client.generate(prompt, max_new_tokens=24, **spec)
    deadline = time.time() + 120  # Ray exports every few seconds; workers report their KV cache at each heartbeat
    while True:
        missing = wanted - dq.scraped_names(server["metrics"])
        if not missing or time.time() > deadline:
            break
        time.sleep(2)
    assert not missing, f"the dashboard reads metrics the app does not export: {sorted(missing)}"
