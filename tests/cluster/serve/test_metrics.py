"""The metrics alone, with Ray's metric classes replaced by recorders: vLLM's names and labels (`model_name`, 0-based
`position`, `finished_reason`), gauges exported from the start, a request's queue time, TTFT, inter-token latency,
end-to-end latency and time per output token, the windowed acceptance gauges and drafted tokens per round."""

import pytest

from specserve.cluster.serve import metrics as metrics_module
from specserve.cluster.serve.metrics import SchedulerMetrics, WorkerMetrics


class Recorder:
    made: dict[str, "Recorder"] = {}

    def __init__(self, name, description="", *args, tag_keys=()):
        self.name = name
        self.tag_keys = tag_keys or args[-1]  # a histogram's boundaries come before its tag keys
        self.values: dict[tuple, list[float]] = {}
        Recorder.made[name] = self

    def _add(self, value, tags):
        assert set(tags) == set(self.tag_keys), f"{self.name}: tags {tags}"
        self.values.setdefault(tuple(sorted(tags.items())), []).append(value)

    def inc(self, value=1.0, tags=None):
        assert value > 0  # as Ray's Counter requires
        self._add(value, tags)

    set = observe = _add


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


@pytest.fixture
def clock(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(metrics_module.time, "perf_counter", clock)
    return clock


@pytest.fixture
def metrics(monkeypatch):
    import ray.util.metrics as ray_metrics

    Recorder.made = {}
    for cls in ("Counter", "Gauge", "Histogram"):
        monkeypatch.setattr(ray_metrics, cls, Recorder)
    return SchedulerMetrics(["a", "b"])


def values(metric, model="a", **labels):
    metric = getattr(metric, "_gauge", metric)  # a HeldGauge's Ray gauge
    return metric.values.get(tuple(sorted({"model_name": model, **labels}.items())), [])


def last(metric, model="a", **labels):
    return values(metric, model, **labels)[-1]


def test_names_are_vllms_under_specserves_prefix(metrics):
    WorkerMetrics()
    names = set(Recorder.made)
    for vllm in ("spec_decode_num_drafts_total", "spec_decode_num_draft_tokens_total",
                 "spec_decode_num_accepted_tokens_total", "spec_decode_num_accepted_tokens_per_pos_total",
                 "e2e_request_latency_seconds", "request_queue_time_seconds", "time_to_first_token_seconds",
                 "inter_token_latency_seconds", "request_time_per_output_token_seconds", "prompt_tokens_total",
                 "generation_tokens_total", "request_success_total", "num_requests_running", "num_requests_waiting",
                 "kv_cache_usage_perc", "prefix_cache_queries_total", "prefix_cache_hits_total"):  # fmt: skip
        assert f"specserve_{vllm}" in names
    for made in Recorder.made.values():
        assert "model_name" in made.tag_keys and ":" not in made.name  # Ray drops names with ':'
    assert Recorder.made["specserve_spec_decode_num_accepted_tokens_per_pos_total"].tag_keys[-1] == "position"


def test_gauges_are_exported_for_every_model_before_any_request(metrics):
    for gauge in (metrics.running, metrics.waiting, metrics.acceptance_rate, metrics.mean_acceptance_length):
        assert last(gauge, "a") == 0.0 and last(gauge, "b") == 0.0
    assert metrics.ttft.values == {} and metrics.itl.values == {}


def test_refresh_sets_every_gauge_again_at_its_last_value(metrics):
    # Ray 2.60 exports a gauge's value once per set: refresh keeps an idle replica's gauges exported
    req = metrics.request("a", prompt_tokens=3)
    metrics.spec_round("b", drafted=4, accepted=3)
    gauges = (metrics.running, metrics.waiting, metrics.acceptance_rate, metrics.mean_acceptance_length)
    before = {(i, m): len(values(g, m)) for i, g in enumerate(gauges) for m in "ab"}
    metrics.refresh()
    for i, g in enumerate(gauges):
        for m in "ab":
            assert len(values(g, m)) == before[(i, m)] + 1, (i, m)
    assert (last(metrics.waiting, "a"), last(metrics.running, "a")) == (1, 0)
    assert last(metrics.acceptance_rate, "b") == 0.75 and last(metrics.mean_acceptance_length, "b") == 4.0
    assert last(metrics.acceptance_rate, "a") == 0.0
    req.scheduled()
    metrics.refresh()
    assert (last(metrics.waiting, "a"), last(metrics.running, "a")) == (0, 1)


def test_a_request_from_arrival_to_its_end(metrics, clock):
    stats = [{"drafted": 0, "accepted": 0}, {"drafted": 4, "accepted": 2}, {"drafted": 8, "accepted": 3},
             {"drafted": 8, "accepted": 3}]  # fmt: skip
    req = metrics.request("a", prompt_tokens=7)
    assert (last(metrics.waiting), last(metrics.running)) == (1, 0)
    clock.now += 0.25
    req.scheduled()
    assert (last(metrics.waiting), last(metrics.running)) == (0, 1)
    # (tokens committed, round seconds): the first round's 3 tokens arrive together at TTFT.
    for i, (committed, seconds) in enumerate([(3, 0.5), (2, 0.2), (1, 0.1)]):
        clock.now += seconds
        req.round(stats[i], stats[i + 1], committed, "length" if i == 2 else None)
    clock.now += 0.05
    req.finished("ok")
    assert values(metrics.queue_time) == [0.25] and values(metrics.prompt_tokens) == [7]
    assert values(metrics.ttft) == [pytest.approx(0.75)]
    assert values(metrics.itl) == pytest.approx([0.2, 0.1])  # one per round after the first token's
    assert values(metrics.request_tpot) == [pytest.approx(0.3 / 5)]  # (last - first token) / (tokens - 1)
    assert values(metrics.e2e) == [pytest.approx(1.1)]
    assert sum(values(metrics.generation_tokens)) == 6
    assert values(metrics.request_success, finished_reason="length") == [1]
    assert (last(metrics.waiting), last(metrics.running)) == (0, 0)
    assert last(metrics.acceptance_rate, "b") == 0.0  # the other model's gauges are untouched


def test_spec_decode_counters_are_vllms_with_0_based_positions(metrics):
    req = metrics.request("a", 3)
    req.scheduled()
    rounds = [(4, 2), (4, 0), (0, 0), (3, 3)]  # (drafted, accepted); (0, 0): a target-only round
    before = {"drafted": 0, "accepted": 0}
    for drafted, accepted in rounds:
        after = {"drafted": before["drafted"] + drafted, "accepted": before["accepted"] + accepted}
        req.round(before, after, accepted + 1)
        before = after
    assert sum(values(metrics.num_drafts)) == 3  # rounds that drafted
    assert sum(values(metrics.num_draft_tokens)) == 11 and sum(values(metrics.num_accepted_tokens)) == 5
    per_pos = {p: sum(values(metrics.accepted_per_pos, position=str(p))) for p in range(4)}
    assert per_pos == {0: 2, 1: 2, 2: 1, 3: 0}
    assert values(metrics.draft_tokens_per_round) == [4, 4, 0, 3]  # every round, as the planner chose it
    assert last(metrics.acceptance_rate) == pytest.approx(5 / 11)
    assert last(metrics.mean_acceptance_length) == pytest.approx(1 + 5 / 3)


def test_acceptance_gauges_cover_the_last_rounds_only(metrics, monkeypatch):
    monkeypatch.setattr(metrics_module, "WINDOW_ROUNDS", 4)
    for _ in range(10):
        metrics.spec_round("a", 4, 0)
    assert last(metrics.acceptance_rate) == 0.0
    for _ in range(4):
        metrics.spec_round("a", 4, 4)
    assert last(metrics.acceptance_rate) == 1.0 and last(metrics.mean_acceptance_length) == 5.0
    metrics.spec_round("a", 4, 2)
    assert last(metrics.acceptance_rate) == pytest.approx(14 / 16)


@pytest.mark.parametrize(("status", "reason"), [("cancelled", "abort"), ("error", "error"), ("unavailable", "error")])
def test_failed_requests_are_counted_by_vllms_finished_reason(metrics, status, reason):
    req = metrics.request("b", 3)  # never scheduled (no healthy target, say)
    req.finished(status)
    assert values(metrics.request_success, "b", finished_reason=reason) == [1]
    assert (last(metrics.waiting, "b"), last(metrics.running, "b")) == (0, 0)
    assert values(metrics.queue_time, "b") == [] and values(metrics.prompt_tokens, "b") == []
    metrics.request_rejected("b")
    assert values(metrics.rejected, "b") == [1]


def test_worker_kv_cache_usage_is_a_fraction(metrics):
    class Store:
        used_tokens, capacity_tokens, cached_tokens = 64, 256, 32
        capacity_bytes, allocated_bytes = 256 * 1024, 128 * 1024
        prefix_queries, prefix_hits = 100, 40

        def __len__(self):
            return 2

    worker, store = WorkerMetrics(), Store()
    worker.report("a", "target", "target-a-1", store)
    labels = {"kind": "target", "worker": "target-a-1"}
    assert last(worker.usage, **labels) == 0.25 and last(worker.capacity, **labels) == 256
    assert last(worker.cached, **labels) == 32
    assert last(worker.capacity_bytes, **labels) == 256 * 1024 and last(worker.allocated_bytes, **labels) == 128 * 1024
    # the prefix cache counters count up by what the store's totals grew between heartbeats
    store.prefix_queries, store.prefix_hits = 150, 40
    worker.report("a", "target", "target-a-1", store)
    assert values(worker.queries, **labels) == [100, 50] and values(worker.hits, **labels) == [40]


def test_each_served_round_adds_its_parts_to_the_round_seconds_counter(metrics):
    from specserve.cluster.scheduling.round_times import RoundRecord

    record = RoundRecord(total=0.030, plan=0.004, verify_wait=0.020, verify_queue=0.002, verify_work=0.012,
                         stream=0.006)  # fmt: skip
    metrics.round_time("a", record)
    metrics.round_time("a", record)
    assert values(metrics.rounds) == []  # summed, not yet handed to Ray: a round's path makes no metric calls
    metrics.flush_rounds()
    assert values(metrics.rounds) == [2]
    assert sum(values(metrics.round_seconds, part="total")) == pytest.approx(0.060)
    assert sum(values(metrics.round_seconds, part="verify_hop")) == pytest.approx(0.012)
    assert sum(values(metrics.round_seconds, part="overhead")) == pytest.approx(0.036)
    assert values(metrics.round_seconds, part="draft_work") == []  # a part at 0 adds nothing (Ray counts > 0 only)


def test_the_round_accounting_reaches_its_counters_within_a_second_and_when_a_request_ends(metrics, monkeypatch):
    from specserve.cluster.scheduling.round_times import RoundRecord
    from specserve.cluster.serve import metrics as metrics_module

    clock = [100.0]
    monkeypatch.setattr(metrics_module.time, "perf_counter", lambda: clock[0])
    metrics.flush_rounds()
    metrics.round_time("a", RoundRecord(total=0.02))
    assert values(metrics.rounds) == []
    clock[0] += metrics_module.ROUNDS_FLUSH_S
    metrics.round_time("a", RoundRecord(total=0.02))
    assert values(metrics.rounds) == [2] and sum(values(metrics.round_seconds, part="total")) == pytest.approx(0.04)
    metrics.round_time("a", RoundRecord(total=0.02))
    request = metrics.request("a", 3)
    request.finished("ok")
    assert sum(values(metrics.rounds)) == 3
