"""Every served round's wall time, accounted for: the scheduler's own work, the draft hop and the verify hop (each
split into the worker's queue, its batch's compute and the rest of the hop: gRPC both ways, serialisation, the event
loop) and the stream back (the time the round's tokens took to leave the scheduler for the client).

On a GPU a forward takes a few milliseconds, so whatever else a round spends decides the served speed (vLLM cut 5-6
ms of idle GPU a step to ~0.15 ms, vllm #10634 / #11133): this is what shows where it goes. `RoundClock` times one
round inside the pipeline; `RoundTimes` keeps the records, their percentiles (status()) and running sums (metrics,
and the load bench, which takes the difference of two readings to account for one segment's rounds).
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

HOPS = ("draft", "verify")


@dataclass(frozen=True)
class RoundRecord:
    """One round, in seconds. waits: the pipeline awaiting the hop; queue and work: what the worker reported (its
    batcher's wait, its batch's compute: the forward and the verification or drafting of every row in it)."""

    total: float = 0.0  # from the round's plan to its tokens' leaving the scheduler
    plan: float = 0.0  # the scheduler's own: planning, applying, encoding (total less the waits and the stream)
    draft_wait: float = 0.0
    draft_queue: float = 0.0
    draft_work: float = 0.0
    verify_wait: float = 0.0
    verify_queue: float = 0.0
    verify_work: float = 0.0
    verify_forward: float = 0.0  # of verify_work, the target forward's host time (a GPU: launching its kernels)
    stream: float = 0.0  # the round's tokens on their way to the client (detokenizing, the reply stream)
    # The chain plan against the round (k='auto''s diagnostic; 0 where the round had no plan): what it meant to draft,
    # the accepted tokens it expected and the seconds it forecast for the worker's round; what was drafted, accepted,
    # and how long the round took from its plan to its commit.
    planned_k: int = 0
    expected_accepted: float = 0.0
    forecast: float = 0.0
    drafted: int = 0
    accepted: int = 0
    realized: float = 0.0

    @property
    def draft_hop(self) -> float:
        """The draft call's wait beyond the worker's queue and compute: the network, serialisation, the loop."""
        return max(0.0, self.draft_wait - self.draft_queue - self.draft_work)

    @property
    def verify_hop(self) -> float:
        return max(0.0, self.verify_wait - self.verify_queue - self.verify_work)

    @property
    def overhead(self) -> float:
        """What the round spent beyond the workers' compute: the served tax a faster forward cannot hide."""
        return self.total - self.draft_work - self.verify_work

    def parts(self) -> dict[str, float]:
        return {
            "total": self.total, "plan": self.plan, "draft_queue": self.draft_queue, "draft_work": self.draft_work,
            "draft_hop": self.draft_hop, "verify_queue": self.verify_queue, "verify_work": self.verify_work,
            "verify_forward": self.verify_forward, "verify_hop": self.verify_hop, "stream": self.stream,
            "overhead": self.overhead,
        }  # fmt: skip


PARTS = tuple(RoundRecord().parts())


class RoundClock:
    """One round's clock: the pipeline marks its waits on workers (`waiting`) and hands over what the workers
    reported (`worker`); `record` closes the round once its tokens have left (`stream_s`)."""

    def __init__(self):
        self.start = time.perf_counter()
        self.waited = {hop: 0.0 for hop in HOPS}
        self.queued = {hop: 0.0 for hop in HOPS}
        self.worked = {hop: 0.0 for hop in HOPS}
        self.forwarded = 0.0  # the verify batches' forward host time (VerifyResult.batch_forward_seconds)
        self.prediction: dict[str, float] = {}  # planned_k, expected_accepted, forecast
        self.outcome: dict[str, float] = {}  # drafted, accepted, realized

    def planned(self, k: int, expected_accepted: float, forecast_s: float) -> None:
        self.prediction = {"planned_k": k, "expected_accepted": expected_accepted, "forecast": forecast_s}

    def verified(self, drafted: int, accepted: int) -> float:
        """The round's outcome; returns its seconds from plan to commit (what the planner's slowdowns weigh)."""
        self.outcome = {"drafted": drafted, "accepted": accepted, "realized": self.elapsed()}
        return self.outcome["realized"]

    @contextlib.contextmanager
    def waiting(self, hop: str = "verify") -> Iterator[None]:
        w0 = time.perf_counter()
        try:
            yield
        finally:
            self.waited[hop] += time.perf_counter() - w0

    def worker(self, hop: str, result) -> None:
        """A worker's reply for this round (a ProposeResult or VerifyResult): its queue time and batch's seconds."""
        self.queued[hop] += getattr(result, "queued_seconds", 0.0) or 0.0
        self.worked[hop] += getattr(result, "batch_seconds", 0.0) or 0.0
        self.forwarded += getattr(result, "batch_forward_seconds", 0.0) or 0.0

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def overhead(self) -> float:
        """The round so far less its waits on workers: the scheduler's own time."""
        return self.elapsed() - sum(self.waited.values())

    def record(self, stream_s: float = 0.0) -> RoundRecord:
        total = self.elapsed()
        waits = sum(self.waited.values())
        return RoundRecord(
            total=total, plan=max(0.0, total - waits - stream_s),
            draft_wait=self.waited["draft"], draft_queue=self.queued["draft"], draft_work=self.worked["draft"],
            verify_wait=self.waited["verify"], verify_queue=self.queued["verify"], verify_work=self.worked["verify"],
            verify_forward=self.forwarded, stream=stream_s, **self.prediction, **self.outcome,
        )  # fmt: skip


@dataclass
class RoundTimes:
    """A pipeline's rounds: the newest records (percentiles) and running sums since it started (rates)."""

    rounds: int = 0
    sums: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PARTS, 0.0))
    recent: deque = field(default_factory=lambda: deque(maxlen=4096))  # RoundRecord.parts() of the newest rounds
    plans: deque = field(default_factory=lambda: deque(maxlen=4096))  # the newest planned rounds' RoundRecords
    on_add: Callable[[RoundRecord], None] | None = None  # e.g. the scheduler replica's metrics

    def add(self, record: RoundRecord) -> None:
        parts = record.parts()
        for name, seconds in parts.items():
            self.sums[name] += seconds
        self.recent.append(parts)
        if record.forecast > 0:
            self.plans.append(record)
        self.rounds += 1
        if self.on_add is not None:
            self.on_add(record)

    @property
    def orchestration_s(self) -> float:
        return self.sums["plan"]

    def p50_ms(self, part: str = "plan") -> float:
        return self.percentile_ms(part, 50)

    def percentile_ms(self, part: str, q: int) -> float:
        return 1e3 * self._cuts(part)[q - 1]

    def _cuts(self, part: str) -> list[float]:
        """The 99 percentile cuts of `part` over the newest rounds, in seconds (zeros before any round)."""
        values = [r[part] for r in self.recent]
        if len(values) < 2:
            return [values[0] if values else 0.0] * 99
        return statistics.quantiles(values, n=100, method="inclusive")

    def summary(self) -> dict:
        """status()'s view: p50 and p90 of each part over the newest rounds, and the running sums."""
        cuts = {part: self._cuts(part) for part in PARTS}  # one sort a part
        return {
            "rounds": self.rounds,
            "p50_ms": {part: round(1e3 * cut[49], 3) for part, cut in cuts.items()},
            "p90_ms": {part: round(1e3 * cut[89], 3) for part, cut in cuts.items()},
            "sum_s": {part: round(seconds, 6) for part, seconds in self.sums.items()},
            "plan_vs_round": self.plan_vs_round(),
        }

    def plan_vs_round(self) -> dict:
        """k='auto''s forecasts against its rounds, means over the newest planned rounds: planned and drafted tokens,
        expected and accepted ones, forecast and realized seconds (the forecast is of the worker's batch round, before
        the realized slowdowns the planner also weighs)."""
        plans = list(self.plans)
        if not plans:
            return {}
        mean = lambda f: round(statistics.fmean(f(r) for r in plans), 4)  # noqa: E731
        return {
            "rounds": len(plans), "planned_k": mean(lambda r: r.planned_k), "drafted": mean(lambda r: r.drafted),
            "expected_accepted": mean(lambda r: r.expected_accepted), "accepted": mean(lambda r: r.accepted),
            "forecast_ms": 1e3 * mean(lambda r: r.forecast), "realized_ms": 1e3 * mean(lambda r: r.realized),
        }  # fmt: skip


def per_round_ms(readings: list[tuple[dict, dict]]) -> dict[str, float]:
    """The mean of each part over the rounds between each (before, after) pair of `summary()` readings, pooled, in ms
    (the load bench's columns: the readings around each segment of a mode)."""
    rounds = sum(after["rounds"] - before["rounds"] for before, after in readings)
    if rounds <= 0:
        return {}
    return {part: round(1e3 * sum(a["sum_s"][part] - b["sum_s"][part] for b, a in readings) / rounds, 3)
            for part in PARTS}  # fmt: skip
