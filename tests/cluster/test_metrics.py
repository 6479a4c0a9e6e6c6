"""ServiceMetrics alone, with Ray's metric classes replaced by recorders: gauges exist from the start, TPOT is one
observation per generated token after the first, TTFT one per request."""

import pytest

from specserve.cluster.serve.metrics import ServiceMetrics


class Recorder:
    def __init__(self, name, description="", *args, tag_keys=()):
        self.name, self.tag_keys = name, tag_keys
        self.values: dict[tuple, list[float]] = {}

    def _add(self, value, tags):
        assert set(tags) == set(self.tag_keys), f"{self.name}: tags {tags}"
        self.values.setdefault(tuple(sorted(tags.items())), []).append(value)

    def inc(self, value=1.0, tags=None):
        assert value > 0  # as Ray's Counter requires
        self._add(value, tags)

    set = observe = _add


@pytest.fixture
def metrics(monkeypatch):
    import ray.util.metrics as ray_metrics

    for cls in ("Counter", "Gauge", "Histogram"):
        monkeypatch.setattr(ray_metrics, cls, Recorder)
    return ServiceMetrics(["a", "b"])


def last(metric, model):
    return metric.values[(("model", model),)][-1]


def test_gauges_are_exported_for_every_model_before_any_request(metrics):
    for gauge in (metrics.acceptance_rate, metrics.mean_accepted_length, metrics.queue_depth):
        assert last(gauge, "a") == 0.0 and last(gauge, "b") == 0.0
    assert metrics.per_token.values == {} and metrics.ttft.values == {}


def test_tpot_is_recorded_per_generated_token_after_the_first(metrics):
    stats = [{"drafted": 0, "accepted": 0}, {"drafted": 4, "accepted": 2}, {"drafted": 8, "accepted": 3},
             {"drafted": 8, "accepted": 3}]  # fmt: skip
    # (tokens committed, round seconds): the first round's 3 tokens arrive together at TTFT.
    rounds = [(3, 0.5), (2, 0.2), (1, 0.1)]
    since = 0.0
    for i, (committed, seconds) in enumerate(rounds):
        since += seconds
        metrics.round("a", stats[i], stats[i + 1], committed, seconds, i == 0, since)
    observed = metrics.per_token.values[(("model", "a"),)]
    assert len(observed) == sum(c for c, _ in rounds) - 1  # one per token after the first
    assert observed == pytest.approx([0.0, 0.0, 0.1, 0.1, 0.1])
    assert sum(observed) == pytest.approx(0.2 + 0.1)  # latency - TTFT: sum / count is the usual mean TPOT
    assert metrics.ttft.values[(("model", "a"),)] == [0.5]
    assert last(metrics.acceptance_rate, "a") == pytest.approx(3 / 8)
    assert last(metrics.mean_accepted_length, "a") == pytest.approx(6 / 3)
    assert last(metrics.acceptance_rate, "b") == 0.0  # the other model's gauges are untouched


def test_a_round_without_tokens_records_no_latency(metrics):
    s = {"drafted": 0, "accepted": 0}
    metrics.round("a", s, s, 0, 0.3, False, 0.3)
    assert metrics.per_token.values == {} and metrics.ttft.values == {}
    assert sum(metrics.rounds.values[(("model", "a"),)]) == 1
