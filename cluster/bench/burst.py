"""The load bench's burst: N requests sent at once to the served app (greedy, the model's default speculation), as a
batch job, a load generator or an agent fanning out sends them. Every request must be answered (none refused below
the queue's bound, none lost); it reports how long the burst took, time to first token and latency percentiles (the
client's), and the queue time's percentiles (the server's: the scheduler replica's queue-time histogram, read from
`/health` before and after and interpolated within its buckets, as Prometheus' histogram_quantile does)."""

from __future__ import annotations

import json
import math
import statistics
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import asdict, dataclass, field

CHANNEL_REQUESTS = 64  # requests per gRPC channel (HTTP/2 connection), as many load generators spread them


@dataclass
class BurstRow:
    requests: int
    answered: int  # with a finish_reason
    refused: dict[str, int] = field(default_factory=dict)  # gRPC status -> count
    lost: int = 0  # neither answered nor refused within the deadline
    seconds: float = 0.0  # first sent to last answered
    ttft_s: dict[str, float] = field(default_factory=dict)  # p50 / p90 / p99 / max, the client's
    latency_s: dict[str, float] = field(default_factory=dict)
    queue_s: dict[str, float] = field(default_factory=dict)  # p50 / p90 / p99, the server's histogram
    most_running: int = 0  # the most the server ran at once, as /health showed it while the burst ran
    most_queued: int = 0

    def line(self) -> str:
        q = self.queue_s
        refused = f"{sum(self.refused.values())} refused {self.refused}" if self.refused else "0 refused"
        return (f"burst: {self.requests} requests at once: {self.answered} answered, {refused}, {self.lost} lost, "
                f"in {self.seconds:.1f} s; "
                f"at most {self.most_running} running and {self.most_queued} queued; queue time p50 "
                f"{q.get('p50', 0):.2f} s, p90 {q.get('p90', 0):.2f} s, p99 {q.get('p99', 0):.2f} s; TTFT p50 "
                f"{self.ttft_s.get('p50', 0):.2f} s, p99 {self.ttft_s.get('p99', 0):.2f} s")  # fmt: skip

    def to_dict(self) -> dict:
        return asdict(self)


def percentiles(values: list[float]) -> dict[str, float]:
    """p50 / p90 / p99 / max (nearest rank), {} for none."""
    if not values:
        return {}
    ordered = sorted(values)
    at = lambda q: ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]  # noqa: E731
    return {"p50": statistics.median(ordered), "p90": at(0.9), "p99": at(0.99), "max": ordered[-1]}


def histogram_quantile(q: float, buckets: dict[str, int], upper: float = math.inf) -> float:
    """The q-quantile of cumulative bucket counts (bound -> count at or below it), interpolated linearly within its
    bucket (the last finite bound where it falls in the +inf bucket). `upper`: a value none can exceed (a burst's
    queue time cannot outlast the burst), which caps a bucket's edge: a bucket wider than what was observed
    otherwise spreads its counts past it (a 378 s burst's p99 read 555 s in the (300, 600] bucket)."""
    bounds = sorted((float(b), c) for b, c in buckets.items())
    total = bounds[-1][1]
    if total == 0:
        return 0.0
    rank, low, below = q * total, 0.0, 0
    for bound, count in bounds:
        if count >= rank:
            if math.isinf(bound):
                return min(low, upper)
            high = max(low, min(bound, upper))
            return min(upper, low + (high - low) * (rank - below) / max(1, count - below))
        low, below = bound, count
    return min(low, upper)


def _admission(http: str) -> dict:
    """The summed admission of the app's scheduler replicas, as /health's body shows it (one model's entry)."""
    try:
        with urllib.request.urlopen(http + "/health", timeout=30) as r:
            body = json.loads(r.read())
    except urllib.error.HTTPError as e:
        body = json.loads(e.read())
    return next(iter(body["models"].values()))["admission"]


def run_burst(grpc_address: str, http: str, prompts: list[list[int]], n: int, new_tokens: int,
              timeout_s: float = 1800.0) -> BurstRow:  # fmt: skip
    """Send n requests at once (request i: prompt i mod len(prompts), new_tokens tokens, greedy) and wait for all."""
    import grpc

    from specserve.client import SpecServeClient

    before = _admission(http)["queue_time_buckets"]
    clients = [SpecServeClient(grpc_address, timeout_s=timeout_s, retries=0) for _ in range(-(-n // CHANNEL_REQUESTS))]
    answered, refused, ttfts, latencies = [], {}, [], []
    start = time.perf_counter()

    def one(i: int) -> None:
        t0 = time.perf_counter()
        first = None
        try:
            for chunk in clients[i // CHANNEL_REQUESTS].generate_stream(
                prompts[i % len(prompts)], max_new_tokens=new_tokens, temperature=0.0
            ):
                first = first or time.perf_counter()
                if chunk["finish_reason"]:
                    answered.append(i)
            ttfts.append((first or time.perf_counter()) - t0)
            latencies.append(time.perf_counter() - t0)
        except grpc.RpcError as e:
            refused[e.code().name] = refused.get(e.code().name, 0) + 1

    seen = {"running": 0, "queued": 0}
    with ThreadPoolExecutor(n) as pool:
        futures = [pool.submit(one, i) for i in range(n)]
        while not all(f.done() for f in futures) and time.perf_counter() - start < timeout_s:
            now = _admission(http)
            seen = {k: max(seen[k], now[f"{k}_requests"]) for k in seen}
            wait(futures, timeout=0.25)
    seconds = time.perf_counter() - start
    for client in clients:
        client.close()
    after = _admission(http)["queue_time_buckets"]
    delta = {b: after[b] - before.get(b, 0) for b in after}  # read with `seconds` as its cap: none queued longer
    return BurstRow(
        requests=n, answered=len(answered), refused=refused, lost=n - len(answered) - sum(refused.values()),
        seconds=seconds, ttft_s=percentiles(ttfts), latency_s=percentiles(latencies),
        queue_s={f"p{round(100 * q)}": histogram_quantile(q, delta, seconds) for q in (0.5, 0.9, 0.99)},
        most_running=seen["running"], most_queued=seen["queued"],
    )  # fmt: skip
