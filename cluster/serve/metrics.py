"""specserve's Prometheus metrics, recorded through Ray's metrics API so they appear on every node's Ray metrics
endpoint (Ray's exporter prefixes them with `ray_`: `specserve_rounds_total` is scraped as
`ray_specserve_rounds_total`). Created inside Serve replicas only.

The gauges (`specserve_acceptance_rate`, `specserve_mean_accepted_length`, `specserve_queue_depth`) are exported for
every served model from the start, at 0: a series that exists before the first request, as Prometheus users expect
(absent series break dashboards and `absent()`-style alerts). NaN, PromQL's own "0/0", would be the truer value for
an undefined ratio, but Ray 2.60's exporter drops NaN samples, which would leave the series missing again. So 0 means
"nothing drafted yet" as long as `specserve_drafted_tokens_total` has not moved (a real mean accepted length is
never below 1); alert on, e.g., `acceptance_rate < 0.5 and rate(drafted_tokens_total[5m]) > 0`, and prefer
rate(accepted) / rate(drafted) for windowed averages.
"""

from __future__ import annotations

_LATENCY_BOUNDARIES_S = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0]
MAX_POSITIONS = 16


class ServiceMetrics:
    """Scheduler-side metrics: requests, rounds, acceptance, latency, queue depth."""

    def __init__(self, models: list[str] = ()):
        """models: the served models, whose gauges are exported from the start (at 0)."""
        from ray.util.metrics import Counter, Gauge, Histogram

        m = ("model",)
        mp, ms = ("model", "position"), ("model", "status")
        self.requests = Counter("specserve_requests_total", "Finished requests by status.", tag_keys=ms)
        self.rounds = Counter("specserve_rounds_total", "Verification rounds (target forward passes).", tag_keys=m)
        self.drafted = Counter("specserve_drafted_tokens_total", "Tokens proposed by drafters.", tag_keys=m)
        self.accepted = Counter("specserve_accepted_tokens_total", "Drafted tokens the target kept.", tag_keys=m)
        self.generated = Counter("specserve_generated_tokens_total", "Tokens committed (returned).", tag_keys=m)
        self.position_drafted = Counter(
            "specserve_position_drafted_total", "Rounds that drafted position i (1-based).", tag_keys=mp
        )
        self.position_accepted = Counter(
            "specserve_position_accepted_total", "Rounds whose position i was accepted.", tag_keys=mp
        )
        self.acceptance_rate = Gauge(
            "specserve_acceptance_rate", "accepted / drafted since start (0 until something is drafted).", tag_keys=m
        )
        self.mean_accepted_length = Gauge(
            "specserve_mean_accepted_length", "Tokens committed per round since start (0 before the first round).",
            tag_keys=m,
        )  # fmt: skip
        self.queue_depth = Gauge("specserve_queue_depth", "Requests in flight at this ingress replica.", tag_keys=m)
        self.ttft = Histogram("specserve_ttft_seconds", "Time to first token.", _LATENCY_BOUNDARIES_S, tag_keys=m)
        self.per_token = Histogram(
            "specserve_per_token_latency_seconds", "Time per output token (TPOT), one observation per generated token "
            "after the first: a round's time / its tokens; 0 for the first round's other tokens, which arrive with the "
            "first. sum / count = (latency - TTFT) / (tokens - 1).", _LATENCY_BOUNDARIES_S, tag_keys=m,
        )  # fmt: skip
        self._totals: dict[str, list[int]] = {}  # model -> [drafted, accepted, rounds, generated]
        self._inflight: dict[str, int] = {}
        for model in models:
            for gauge in (self.acceptance_rate, self.mean_accepted_length, self.queue_depth):
                gauge.set(0.0, tags={"model": model})

    def request_started(self, model: str) -> None:
        self._inflight[model] = self._inflight.get(model, 0) + 1
        self.queue_depth.set(self._inflight[model], tags={"model": model})

    def request_finished(self, model: str, status: str, started: bool = True) -> None:
        if started:
            self._inflight[model] = max(0, self._inflight.get(model, 0) - 1)
            self.queue_depth.set(self._inflight[model], tags={"model": model})
        self.requests.inc(1, tags={"model": model, "status": status})

    def round(self, model: str, before: dict, after: dict, committed: int, seconds: float, first: bool,
              since_start: float) -> None:  # fmt: skip
        tags = {"model": model}
        drafted = after["drafted"] - before["drafted"]
        accepted = after["accepted"] - before["accepted"]
        self.rounds.inc(1, tags=tags)
        if committed:
            self.generated.inc(committed, tags=tags)
        if drafted:
            self.drafted.inc(drafted, tags=tags)
            for pos in range(1, min(drafted, MAX_POSITIONS) + 1):
                self.position_drafted.inc(1, tags={"model": model, "position": str(pos)})
        if accepted:
            self.accepted.inc(accepted, tags=tags)
            for pos in range(1, min(accepted, MAX_POSITIONS) + 1):
                self.position_accepted.inc(1, tags={"model": model, "position": str(pos)})
        totals = self._totals.setdefault(model, [0, 0, 0, 0])
        totals[0] += drafted
        totals[1] += accepted
        totals[2] += 1
        totals[3] += committed
        if totals[0]:
            self.acceptance_rate.set(totals[1] / totals[0], tags=tags)
        self.mean_accepted_length.set(totals[3] / totals[2], tags=tags)
        if first:
            self.ttft.observe(since_start, tags=tags)
        # A round's tokens arrive together; the first token's own time is TTFT, not TPOT.
        per_token = 0.0 if first else seconds / max(committed, 1)
        for _ in range(committed - 1 if first else committed):
            self.per_token.observe(per_token, tags=tags)


class WorkerMetrics:
    """Worker-side metrics: KV-cache usage of each worker replica."""

    def __init__(self):
        from ray.util.metrics import Gauge

        keys = ("model", "kind", "worker")
        self.used = Gauge("specserve_kv_cache_used_tokens", "Cached positions held.", tag_keys=keys)
        self.capacity = Gauge("specserve_kv_cache_capacity_tokens", "Configured KV capacity.", tag_keys=keys)
        self.requests = Gauge("specserve_kv_cache_requests", "Requests with a cache on the worker.", tag_keys=keys)

    def report(self, model: str, kind: str, worker: str, store) -> None:
        tags = {"model": model, "kind": kind, "worker": worker}
        self.used.set(store.used_tokens, tags=tags)
        self.capacity.set(store.capacity_tokens, tags=tags)
        self.requests.set(len(store), tags=tags)


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
