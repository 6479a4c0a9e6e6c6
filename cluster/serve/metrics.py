"""specserve's Prometheus metrics, shaped like vLLM's so that a vLLM panel ports by changing the prefix.

Recorded through Ray's metrics API inside Serve replicas, so they appear on every node's Ray metrics endpoint. Ray's
exporter prefixes them with `ray_`, and Ray 2.60 drops names with ':' (vLLM's `vllm:` separator), so vLLM's
`vllm:<name>` is specserve's `ray_specserve_<name>`: `vllm:spec_decode_num_drafts_total` is
`ray_specserve_spec_decode_num_drafts_total`, with the same labels (`model_name`, 0-based `position`,
`finished_reason`). docs/metrics.md lists every metric with its vLLM counterpart; dashboards/specserve.json uses them.

Ray cannot export a counter at 0 (its `inc` takes positive values only): a counter's series appears with its first
increment (in PromQL, `or vector(0)` where an alert needs it). The gauges are exported for every served model from
the start, at 0, and set again every GAUGE_REFRESH_S (`HeldGauge`). Ray 2.60 exports a histogram's `_sum` from its
buckets' midpoints, so means are best taken from the counters (rate(num_draft_tokens) / rate(num_drafts)) and
latencies from the buckets (histogram_quantile).
"""

from __future__ import annotations

import time
from collections import deque

# vLLM's buckets (vllm/v1/metrics/loggers.py), with finer ones below vLLM's smallest where a round or a queue is short.
TTFT_BUCKETS_S = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                  40.0, 80.0, 160.0, 640.0, 2560.0]  # fmt: skip
ITL_BUCKETS_S = [0.001, 0.0025, 0.005, 0.0075, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
                 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0]  # fmt: skip
REQUEST_BUCKETS_S = [0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0,
                     30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]  # fmt: skip
# Drafted tokens per round: le="0.5" counts the rounds that drafted nothing (Ray's bucket bounds must be positive).
DRAFT_TOKENS_BUCKETS = [0.5, 1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 16, 24, 32, 64]
MAX_POSITIONS = 16  # per-position counters stop here (a tree's deepest path, a chain's largest k)
# Ray 2.60's core worker exports a gauge's value once per set (its recorder clears a gauge's observations at every
# export: src/ray/observability/open_telemetry_metric_recorder.cc) and the metrics agent drops a value two export
# intervals (>= 1 s each) after it arrived, so a gauge nobody sets again vanishes from /metrics: an idle replica's
# gauges did, and a CI run's scrapes missed them for a minute. The replicas set theirs again at this period.
GAUGE_REFRESH_S = 0.5
ROUNDS_FLUSH_S = 1.0  # the round accounting's counters take what was summed at most this often
WINDOW_ROUNDS = 256  # the windowed acceptance gauges: over a model's last this-many drafting rounds on a replica
FINISH_REASONS = {"cancelled": "abort"}  # a request's status -> vLLM's finished_reason; other failures are "error"


class SchedulerMetrics:
    """Scheduler-side metrics of one scheduler replica: requests, speculative decoding, latency, queue."""

    def __init__(self, models: list[str] = ()):
        """models: the served models, whose gauges are exported from the start (at 0)."""
        from ray.util.metrics import Counter, Histogram

        m, mp = ("model_name",), ("model_name", "position")
        self.num_drafts = Counter("specserve_spec_decode_num_drafts_total", "Rounds that drafted (vLLM: drafts).", m)
        self.num_draft_tokens = Counter("specserve_spec_decode_num_draft_tokens_total", "Drafted tokens.", m)
        self.num_accepted_tokens = Counter(
            "specserve_spec_decode_num_accepted_tokens_total", "Drafted tokens the target kept.", m
        )
        self.accepted_per_pos = Counter(
            "specserve_spec_decode_num_accepted_tokens_per_pos_total",
            "Drafts whose token at 0-based `position` was accepted.",
            mp,
        )
        self.draft_tokens_per_round = Histogram(
            "specserve_spec_decode_draft_tokens_per_round",
            "Tokens drafted each round, as the planner chose them (0: a target-only round).",
            DRAFT_TOKENS_BUCKETS,
            m,
        )
        self.acceptance_rate = HeldGauge(
            "specserve_spec_decode_acceptance_rate",
            f"accepted / drafted over the model's last {WINDOW_ROUNDS} drafting rounds here (0 before any).",
            m,
        )
        self.mean_acceptance_length = HeldGauge(
            "specserve_spec_decode_mean_acceptance_length",
            f"1 + accepted / drafts over the model's last {WINDOW_ROUNDS} drafting rounds here (0 before any).",
            m,
        )
        self.round_seconds = Counter(
            "specserve_round_seconds_total",
            "Served rounds' wall time by part (cluster/scheduling/round_times.py): total, plan (the scheduler's own), "
            "draft_queue / draft_work / draft_hop and verify_queue / verify_work / verify_hop (the worker's batcher, "
            "its batch's compute, the rest of the call), verify_forward (of verify_work, the forward pass's host time: "
            "on a GPU its launches), stream (to the client), overhead (total less the work).",
            ("model_name", "part"),
        )
        self.rounds = Counter("specserve_rounds_total", "Served rounds (each commits one or more tokens).", m)
        self._request_metrics()
        self._windows: dict[str, _Window] = {}
        self._counts: dict[str, list[int]] = {}  # model -> [waiting, running]
        self._pending_rounds: dict[str, dict[str, float]] = {}  # model -> part ("": rounds) -> summed since a flush
        self._flushed_at = time.perf_counter()
        for model in models:
            self._count(model)
            self.acceptance_rate.set(0.0, tags={"model_name": model})
            self.mean_acceptance_length.set(0.0, tags={"model_name": model})

    def refresh(self) -> None:
        """Every gauge's values set again (so Ray keeps exporting them) and the summed rounds handed over: the
        replica calls it every GAUGE_REFRESH_S."""
        for gauge in (self.running, self.waiting, self.acceptance_rate, self.mean_acceptance_length):
            gauge.refresh()
        self.flush_rounds()

    def _request_metrics(self) -> None:
        from ray.util.metrics import Counter, Histogram

        m = ("model_name",)
        self.running = HeldGauge("specserve_num_requests_running", "Requests running their rounds here.", m)
        self.waiting = HeldGauge("specserve_num_requests_waiting", "Requests admitted here, waiting to run.", m)
        self.prompt_tokens = Counter("specserve_prompt_tokens_total", "Prompt tokens of the requests run.", m)
        self.generation_tokens = Counter("specserve_generation_tokens_total", "Tokens generated (committed).", m)
        self.request_success = Counter(
            "specserve_request_success_total",
            "Finished requests by finished_reason (stop, length; abort: cancelled; error: failed).",
            ("model_name", "finished_reason"),
        )
        self.rejected = Counter("specserve_request_rejected_total", "Requests refused at admission (busy).", m)
        self.e2e = Histogram(
            "specserve_e2e_request_latency_seconds", "Arrival here to the last token.", REQUEST_BUCKETS_S, m
        )
        self.queue_time = Histogram(
            "specserve_request_queue_time_seconds", "Arrival here to the first round.", REQUEST_BUCKETS_S, m
        )
        self.ttft = Histogram("specserve_time_to_first_token_seconds", "Arrival here to the first token.",
                              TTFT_BUCKETS_S, m)  # fmt: skip
        self.itl = Histogram(
            "specserve_inter_token_latency_seconds",
            "Time between a request's rounds (each round commits one or more tokens).",
            ITL_BUCKETS_S,
            m,
        )
        self.request_tpot = Histogram(
            "specserve_request_time_per_output_token_seconds",
            "Per request: (last token - first token) / (tokens - 1), for requests of two tokens or more.",
            ITL_BUCKETS_S,
            m,
        )

    def request(self, model: str, prompt_tokens: int, arrived_at: float | None = None) -> RequestMetrics:
        """A request arrived (admitted, perhaps to wait in the queue; `arrived_at`: time.time() at the ingress): its
        metrics until it ends."""
        return RequestMetrics(self, model, prompt_tokens, arrived_at)

    def request_rejected(self, model: str) -> None:
        self.rejected.inc(1, tags={"model_name": model})

    def _count(self, model: str, waiting: int = 0, running: int = 0) -> None:
        counts = self._counts.setdefault(model, [0, 0])
        counts[0], counts[1] = max(0, counts[0] + waiting), max(0, counts[1] + running)
        self.waiting.set(counts[0], tags={"model_name": model})
        self.running.set(counts[1], tags={"model_name": model})

    def round_time(self, model: str, record) -> None:
        """One round's accounting (a RoundRecord): rate() of a part over rate() of the rounds is its mean a round.
        Summed here and handed to Ray at most once a second (`flush_rounds`): a round's dozen `inc` calls took ~0.2
        ms of the round's path on a 2-core CPU, and Ray exports metrics every few seconds anyway."""
        pending = self._pending_rounds.setdefault(model, {})
        pending[""] = pending.get("", 0.0) + 1.0
        for part, seconds in record.parts().items():
            if seconds > 0:
                pending[part] = pending.get(part, 0.0) + seconds
        if time.perf_counter() - self._flushed_at >= ROUNDS_FLUSH_S:
            self.flush_rounds()

    def flush_rounds(self) -> None:
        """The rounds summed since the last flush, to their counters (also when a request ends, so that an idle
        replica holds none back)."""
        self._flushed_at = time.perf_counter()
        pending, self._pending_rounds = self._pending_rounds, {}
        for model, sums in pending.items():
            for part, value in sums.items():
                if not part:
                    self.rounds.inc(value, tags={"model_name": model})
                elif value > 0:
                    self.round_seconds.inc(value, tags={"model_name": model, "part": part})

    def spec_round(self, model: str, drafted: int, accepted: int) -> None:
        """One round's speculative decoding: `drafted` tokens proposed, `accepted` of them kept."""
        tags = {"model_name": model}
        self.draft_tokens_per_round.observe(drafted, tags=tags)
        if not drafted:
            return
        self.num_drafts.inc(1, tags=tags)
        self.num_draft_tokens.inc(drafted, tags=tags)
        if accepted:
            self.num_accepted_tokens.inc(accepted, tags=tags)
            for pos in range(min(accepted, MAX_POSITIONS)):
                self.accepted_per_pos.inc(1, tags={"model_name": model, "position": str(pos)})
        window = self._windows.setdefault(model, _Window(WINDOW_ROUNDS))
        window.add(drafted, accepted)
        self.acceptance_rate.set(window.accepted / window.drafted, tags=tags)
        self.mean_acceptance_length.set(1.0 + window.accepted / len(window.rounds), tags=tags)


class HeldGauge:
    """A Ray gauge that keeps its last value for each tag set, so `refresh` can set them all again (GAUGE_REFRESH_S
    says why). The tag sets are the served models: bounded."""

    def __init__(self, name: str, description: str, tag_keys: tuple[str, ...]):
        from ray.util.metrics import Gauge

        self._gauge = Gauge(name, description, tag_keys)
        self._values: dict[tuple[tuple[str, str], ...], float] = {}

    def set(self, value: float, tags: dict[str, str]) -> None:
        self._values[tuple(sorted(tags.items()))] = value
        self._gauge.set(value, tags=tags)

    def refresh(self) -> None:
        for tags, value in self._values.items():
            self._gauge.set(value, tags=dict(tags))


class _Window:
    """The last `size` drafting rounds' drafted and accepted tokens, with their sums."""

    def __init__(self, size: int):
        self.rounds: deque[tuple[int, int]] = deque(maxlen=size)
        self.drafted = self.accepted = 0

    def add(self, drafted: int, accepted: int) -> None:
        if len(self.rounds) == self.rounds.maxlen:
            old_drafted, old_accepted = self.rounds[0]
            self.drafted, self.accepted = self.drafted - old_drafted, self.accepted - old_accepted
        self.rounds.append((drafted, accepted))
        self.drafted, self.accepted = self.drafted + drafted, self.accepted + accepted


class RequestMetrics:
    """One request's metrics, from its arrival at the scheduler replica to its end: waiting until `scheduled` (queue
    time), then running its rounds (`round`: TTFT at the first token, inter-token latency at each later round), then
    `finished` (end-to-end latency, time per output token, its finished_reason)."""

    def __init__(self, metrics: SchedulerMetrics, model: str, prompt_tokens: int, arrived_at: float | None = None):
        self.metrics, self.model, self.prompt_tokens = metrics, model, prompt_tokens
        self.tags = {"model_name": model}
        # The ingress's wall clock to this process's monotonic one (the hop's seconds, never negative)
        ago = max(0.0, time.time() - arrived_at) if arrived_at is not None else 0.0
        self.arrived = time.perf_counter() - ago
        self.first_token: float | None = None
        self.last_token = self.arrived
        self.generated = 0
        self.running = False
        self.finish_reason: str | None = None
        metrics._count(model, waiting=1)

    def scheduled(self) -> None:
        """Its first round starts."""
        if self.running:
            return
        self.running = True
        self.metrics._count(self.model, waiting=-1, running=1)
        self.metrics.queue_time.observe(time.perf_counter() - self.arrived, tags=self.tags)
        if self.prompt_tokens:
            self.metrics.prompt_tokens.inc(self.prompt_tokens, tags=self.tags)

    def round(self, before: dict, after: dict, committed: int, finish_reason: str | None = None) -> None:
        """A round ended: `before` and `after` are the request's stats (drafted, accepted) around it; it committed
        `committed` tokens."""
        now, m = time.perf_counter(), self.metrics
        m.spec_round(self.model, after["drafted"] - before["drafted"], after["accepted"] - before["accepted"])
        if committed:
            m.generation_tokens.inc(committed, tags=self.tags)
            if self.first_token is None:
                self.first_token = now
                m.ttft.observe(now - self.arrived, tags=self.tags)
            else:
                m.itl.observe(now - self.last_token, tags=self.tags)
            self.last_token, self.generated = now, self.generated + committed
        self.finish_reason = finish_reason or self.finish_reason

    def finished(self, status: str) -> None:
        """It ended with `status` (ok, cancelled, invalid, unavailable, error)."""
        m = self.metrics
        if self.running:
            m._count(self.model, running=-1)
        else:
            m._count(self.model, waiting=-1)
        reason = (self.finish_reason or "stop") if status == "ok" else FINISH_REASONS.get(status, "error")
        m.request_success.inc(1, tags={"model_name": self.model, "finished_reason": reason})
        m.flush_rounds()
        m.e2e.observe(time.perf_counter() - self.arrived, tags=self.tags)
        if self.generated > 1:
            m.request_tpot.observe((self.last_token - self.first_token) / (self.generated - 1), tags=self.tags)


class WorkerMetrics:
    """Worker-side metrics: the KV cache of each worker replica (`kind` target or draft), reported every
    GAUGE_REFRESH_S (which keeps its gauges exported)."""

    def __init__(self):
        from ray.util.metrics import Counter, Gauge

        keys = ("model_name", "kind", "worker")
        self.usage = Gauge("specserve_kv_cache_usage_perc", "KV-cache usage: 1 means 100 percent.", tag_keys=keys)
        self.used = Gauge("specserve_kv_cache_used_tokens", "Cached positions held.", tag_keys=keys)
        self.capacity = Gauge("specserve_kv_cache_capacity_tokens", "KV capacity in positions (sized from the "
                              "memory budget).", tag_keys=keys)  # fmt: skip
        self.capacity_bytes = Gauge("specserve_kv_cache_capacity_bytes", "KV cache memory budget.", tag_keys=keys)
        self.allocated_bytes = Gauge("specserve_kv_cache_allocated_bytes", "KV arena reserved now.", tag_keys=keys)
        self.requests = Gauge("specserve_kv_cache_requests", "Requests with a cache on the worker.", tag_keys=keys)
        self.cached = Gauge("specserve_kv_cache_cached_tokens", "Positions released requests left for later "
                            "prefixes.", tag_keys=keys)  # fmt: skip
        # vLLM's prefix cache counters (tokens), counted up by what the store's totals grew since the last report
        self.queries = Counter("specserve_prefix_cache_queries_total", "Prompt positions new requests brought.",
                               tag_keys=keys)  # fmt: skip
        self.hits = Counter("specserve_prefix_cache_hits_total", "Of those, positions found in the prefix cache.",
                            tag_keys=keys)  # fmt: skip
        self._reported: dict[str, tuple[int, int]] = {}

    def report(self, model: str, kind: str, worker: str, store) -> None:
        tags = {"model_name": model, "kind": kind, "worker": worker}
        capacity = store.capacity_tokens
        self.usage.set(store.used_tokens / capacity if capacity else 0.0, tags=tags)
        self.used.set(store.used_tokens, tags=tags)
        self.capacity.set(capacity, tags=tags)
        self.capacity_bytes.set(store.capacity_bytes, tags=tags)
        self.allocated_bytes.set(store.allocated_bytes, tags=tags)
        self.requests.set(len(store), tags=tags)
        self.cached.set(store.cached_tokens, tags=tags)
        queries, hits = self._reported.get(worker, (0, 0))
        if store.prefix_queries > queries:
            self.queries.inc(store.prefix_queries - queries, tags=tags)
        if store.prefix_hits > hits:
            self.hits.inc(store.prefix_hits - hits, tags=tags)
        self._reported[worker] = (store.prefix_queries, store.prefix_hits)


class IngressMetrics:
    """Ingress-side metrics: requests refused before they run (bad input, no API key, too large, over capacity)."""

    def __init__(self):
        from ray.util.metrics import Counter

        self.refused = Counter(
            "specserve_refused_requests_total",
            "Requests refused, by route (HTTP path or gRPC method) and status (HTTP status code or gRPC status name).",
            tag_keys=("route", "status"),
        )

    def refuse(self, route: str, status: str) -> None:
        self.refused.inc(1, tags={"route": route, "status": status})
