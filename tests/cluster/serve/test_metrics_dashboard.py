"""dashboards/specserve.json without a server: Grafana's variables (`datasource`, `model_name`) as vLLM's dashboards
have them, every query filtered by model and reading metrics that cluster/serve/metrics.py defines, the panels the
issue asks for, a grid without overlaps. tests/integration/tiny_app/test_app_operations.py checks every query
against a live scrape."""

import pytest

from tests.helpers import dashboard_queries as dq

SELECTOR = '{model_name=~"$model_name"'


@pytest.fixture(scope="module")
def dashboard():
    return dq.load()


@pytest.fixture(scope="module")
def defined(monkeypatch_module):
    """The metric names SchedulerMetrics and WorkerMetrics register with Ray."""
    import ray.util.metrics as ray_metrics

    from specserve.cluster.serve.metrics import SchedulerMetrics, WorkerMetrics

    names = set()

    class Recorder:
        def __init__(self, name, *args, **kwargs):
            names.add(name)

        def set(self, *args, **kwargs):
            pass

    for cls in ("Counter", "Gauge", "Histogram"):
        monkeypatch_module.setattr(ray_metrics, cls, Recorder)
    SchedulerMetrics(["m"])
    WorkerMetrics()
    return names


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


def test_variables_are_a_datasource_and_the_model_name(dashboard):
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    model = variables["model_name"]
    assert model["type"] == "query" and model["multi"] and model["includeAll"]
    assert model["datasource"]["uid"] == "${datasource}"
    assert dq.variable_queries(dashboard) == ["label_values(ray_specserve_num_requests_running, model_name)"]


def test_every_panel_reads_the_chosen_datasource_and_models(dashboard):
    for panel in dq.panels(dashboard):
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            expr = target["expr"]
            for name in dq.METRIC.findall(expr):
                assert f"{name}{SELECTOR}" in expr, f"{panel['title']}: {name} is not filtered by model"
            for pair in ("()", "[]", "{}"):
                assert expr.count(pair[0]) == expr.count(pair[1]), f"{panel['title']}: unbalanced {pair}"


def test_queries_read_only_the_metrics_specserve_defines(dashboard, defined):
    exprs = dq.panel_exprs(dashboard) + dq.variable_queries(dashboard)
    names = dq.metric_names(exprs)
    assert names and all(name.startswith("ray_specserve_") for name in names)
    assert {dq.base_name(name) for name in names} <= defined
    for expr in exprs:  # latency percentiles come from the buckets, by le
        if "histogram_quantile" in expr:
            assert "_bucket{" in expr and "by (le" in expr, expr


def test_the_panels_the_issue_asks_for(dashboard):
    titles = " | ".join(p["title"].lower() for p in dq.panels(dashboard))
    for wanted in ("acceptance rate by draft position", "drafted vs accepted", "draft acceptance rate",
                   "mean acceptance length", "time to first token", "time per output token", "end-to-end",
                   "queue time", "running and waiting", "kv-cache usage", "drafted tokens per round"):  # fmt: skip
        assert wanted in titles, wanted
    exprs = " ".join(dq.panel_exprs(dashboard))
    for quantile in ("histogram_quantile(0.5,", "histogram_quantile(0.99,"):
        assert quantile in exprs


def test_the_grid_has_no_overlaps(dashboard):
    taken = set()
    for panel in dashboard["panels"]:
        g = panel["gridPos"]
        assert g["x"] + g["w"] <= 24, panel["title"]
        cells = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not cells & taken, panel["title"]
        taken |= cells
    assert len({p["id"] for p in dashboard["panels"]}) == len(dashboard["panels"])
