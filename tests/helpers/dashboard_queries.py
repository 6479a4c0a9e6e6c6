"""The queries of dashboards/specserve.json and the metric names they read, for the dashboard's tests (static ones in
tests/cluster/serve/test_metrics_dashboard.py, the live scrape in
tests/integration/tiny_app/test_app_operations.py)."""

from __future__ import annotations

import json
import re
import urllib.request
from pathlib import Path

DASHBOARD = Path(__file__).resolve().parents[2] / "dashboards" / "specserve.json"
METRIC = re.compile(r"\b(ray_[a-zA-Z0-9_]+)")
SERIES_SUFFIXES = ("_bucket", "_count", "_sum")  # a histogram's series (Prometheus' exposition)


def load() -> dict:
    return json.loads(DASHBOARD.read_text())


def panels(dashboard: dict) -> list[dict]:
    """Every panel, rows' nested ones included, rows themselves not."""
    out = []
    for panel in dashboard["panels"]:
        out.extend(panels(panel) if panel["type"] == "row" else [panel])
    return out


def panel_exprs(dashboard: dict) -> list[str]:
    return [target["expr"] for panel in panels(dashboard) for target in panel.get("targets", [])]


def variable_queries(dashboard: dict) -> list[str]:
    queries = []
    for var in dashboard["templating"]["list"]:
        if var["type"] == "query":
            query = var["query"]
            queries.append(query["query"] if isinstance(query, dict) else query)
    return queries


def metric_names(exprs: list[str]) -> set[str]:
    """The series names the queries select, as a scrape shows them (`ray_` prefix, histogram suffixes)."""
    return {name for expr in exprs for name in METRIC.findall(expr)}


def base_name(series: str) -> str:
    """A series' metric as registered with Ray: no `ray_` prefix, no histogram suffix."""
    name = series.removeprefix("ray_")
    for suffix in SERIES_SUFFIXES:
        if name.endswith(suffix):
            return name.removesuffix(suffix)
    return name


def scraped_names(url: str) -> set[str]:
    """The series names a Prometheus scrape of `url` exposes."""
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    return {re.split(r"[{ ]", line, maxsplit=1)[0] for line in text.splitlines() if line and not line.startswith("#")}
