"""How long a request's rounds take apart from awaiting workers: the scheduler's own overhead per round."""

from __future__ import annotations

import contextlib
import statistics
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field


@dataclass
class RoundTimes:
    orchestration_s: float = 0.0  # round wall time not spent awaiting workers: the scheduler's own overhead
    rounds: int = 0
    recent: deque = field(default_factory=lambda: deque(maxlen=4096))  # per-round orchestration seconds

    def add(self, overhead_s: float) -> None:
        self.orchestration_s += overhead_s
        self.recent.append(overhead_s)
        self.rounds += 1

    def p50_ms(self) -> float:
        return 1e3 * statistics.median(self.recent) if self.recent else 0.0


class RoundClock:
    """One round's wall time, less the time spent awaiting workers."""

    def __init__(self):
        self.start = time.perf_counter()
        self.waited = 0.0

    @contextlib.contextmanager
    def waiting(self) -> Iterator[None]:
        w0 = time.perf_counter()
        try:
            yield
        finally:
            self.waited += time.perf_counter() - w0

    def overhead(self) -> float:
        return time.perf_counter() - self.start - self.waited
