"""What the speculation switch (`switch.py`) measures: each mode's clean rounds since it was last entered, the recent
round and request durations, and the probe timings derived from them. No decisions here.

A mode's rate is request-seconds per committed token over its clean rounds (each round's duration and tokens,
summed: at equal load, inverse throughput; unlike a wall-clock window it does not depend on which request's round
ends first, and batched requests' rounds end together), compared only when both modes were measured at similar loads
(within 1.5x). Probes last at least `probe_rounds` round times of the slower mode and as long as the probed mode takes
to run a window's rounds (plus a margin). Workers take a while to reach a mode's steady state (plain decoding's
batches have to merge again; 16 speculating streams start in step and ran as fast as plain decoding for 2-4 s, then
~0.65x: a probe that short turned speculation on where it lost), so a window whose later half's rate differs from
its first half's by more than `settle_tolerance` is still settling. Windows and probes also span `window_requests`
request durations: under load, requests that start together finish together and the next ones prefill together, so
throughput dips once per request duration (16 streams here: by up to half, every ~3 s), and a shorter window
measures where it fell in that cycle (probes of 2.6 s rated plain decoding 20-30% below its segments).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field


@dataclass
class SwitchSettings:
    """The speculation switch's knobs (see `switch.py` and this module's notes for why each is what it is)."""

    probe_s: float = 0.25
    probe_rounds: float = 8.0
    min_rounds: int = 16  # clean rounds each mode needs for a verdict, and ...
    rounds_per_request: int = 4  # ... at least this many per concurrent request (a few rounds of each one)
    interval_s: float = 1.0
    max_interval_s: float = 120.0
    margin: float = 0.03  # speculation goes off when measured slower by more than this ...
    margin_on: float = 0.1  # ... and on only when faster by more than this: a near tie goes to plain decoding
    max_probe_share: float = 0.05  # at most this share of the time is spent probing ...
    max_probe_cost: float = 0.02  # ... and at most this share of throughput lost to probing the slower mode
    max_settle_extensions: int = 4  # a probe is extended (by half its length) while its rate still moves ...
    settle_tolerance: float = 0.1  # ... by more than this between its first and later half
    window_requests: float = 2.0  # a mode's window (a probe's too) spans at least this many request durations
    decay: float = 0.8  # of the recent round and request durations


@dataclass
class RoundWindow:
    """One mode's clean rounds since the mode was last entered."""

    tokens: int = 0  # committed by those rounds
    seconds: float = 0.0  # their durations, summed: request-time
    loads: float = 0.0  # sum of the requests per target noted at each round
    rounds: int = 0
    log: deque = field(default_factory=lambda: deque(maxlen=50_000))  # (ended, tokens, seconds, load) per round

    def add(self, ended: float, tokens: int, seconds: float, load: float) -> None:
        self.tokens += tokens
        self.seconds += seconds
        self.loads += load
        self.rounds += 1
        self.log.append((ended, tokens, seconds, load))

    def part(self, start: float, end: float = math.inf) -> RoundWindow:
        """The (logged) rounds that ended in [start, end)."""
        part = RoundWindow()
        for ended, tokens, seconds, load in self.log:
            if start <= ended < end:
                part.add(ended, tokens, seconds, load)
        return part

    def halves(self, now: float) -> tuple[RoundWindow, RoundWindow]:
        """The rounds that ended in the first and in the later half of the time from the first one's end to now."""
        if not self.log:
            return RoundWindow(), RoundWindow()
        mid = (self.log[0][0] + now) / 2
        return self.part(-math.inf, mid), self.part(mid)

    @property
    def rate(self) -> float | None:
        return self.seconds / self.tokens if self.tokens else None


class ModeMeasurements:
    """Both modes' windows (True: speculation allowed) and the recent durations the probe timings follow."""

    def __init__(self, settings: SwitchSettings):
        self.settings = settings
        self.windows = {True: RoundWindow(), False: RoundWindow()}
        self.round_s = {True: 0.0, False: 0.0}  # recent round duration per mode
        self.request_s = 0.0  # recent request duration, start to last token
        self.load: float | None = None  # requests per target, as last noted

    def _decayed(self, recent: float, seconds: float) -> float:
        decay = self.settings.decay
        return seconds if recent == 0 else recent * decay + seconds * (1 - decay)

    def round_ended(self, mode: bool, seconds: float) -> None:
        """Any round of `mode` (clean or not): its duration sets the probe timings."""
        self.round_s[mode] = self._decayed(self.round_s[mode], seconds)

    def request_finished(self, seconds: float) -> None:
        """A request took `seconds` from its start to its last token."""
        if seconds > 0:
            self.request_s = self._decayed(self.request_s, seconds)

    def add(self, mode: bool, ended: float, tokens: int, seconds: float) -> None:
        """A clean round of `mode`, at the load last noted."""
        self.windows[mode].add(ended, tokens, seconds, max(1.0, self.load or 1.0))

    def restart(self, mode: bool | None = None) -> None:
        """A new window for `mode` (None: both)."""
        for m in (True, False) if mode is None else (mode,):
            self.windows[m] = RoundWindow()

    def keep_later_half(self, mode: bool, now: float) -> None:
        """The mode's steady state: the later half of a window that still moved."""
        self.windows[mode] = self.windows[mode].halves(now)[1]

    def rate(self, mode: bool) -> float | None:
        """Seconds of request time per committed token over the mode's clean rounds (inverse per-request speed: at
        equal load, inverse throughput)."""
        return self.windows[mode].rate

    def mean_load(self, mode: bool) -> float | None:
        w = self.windows[mode]
        return w.loads / w.rounds if w.rounds else None

    def settling(self, mode: bool, now: float) -> bool:
        """Whether the mode's rate still moves: the later half of its window differs from the first by more than
        `settle_tolerance`."""
        first, later = self.windows[mode].halves(now)
        if min(first.rounds, later.rounds) < self.settings.min_rounds / 2 or first.rate is None or later.rate is None:
            return False  # too few rounds to tell: the count of rounds decides
        return abs(later.rate / first.rate - 1.0) > self.settings.settle_tolerance

    def measured(self, mode: bool, seconds: float = 0.0) -> bool:
        """Whether the mode's window has enough rounds for a verdict (`rounds_per_request` per concurrent request) and
        spans `seconds` (the current mode before a probe: else there is nothing to compare the probe with)."""
        w = self.windows[mode]
        load = self.mean_load(mode) or 0.0
        rounds = max(self.settings.min_rounds, self.settings.rounds_per_request * load)
        return w.rounds >= rounds and w.seconds >= seconds * max(1.0, load)

    # -- timings ------------------------------------------------------------------------------------------------------

    def probe_length(self) -> float:
        """`probe_rounds` round times of the slower mode: the faster one's first rounds share batches with the
        slower one's last, so its probe must outlast them too."""
        return max(self.settings.probe_s, self.settings.probe_rounds * max(self.round_s.values()))

    def settle_s(self) -> float:
        """After a mode change, how long rounds still share batches with the other mode's: the slower mode's rounds
        in flight hold the workers' batches for up to a round time, and rounds queued behind them for about another."""
        return min(2 * max(self.round_s.values()), self.probe_length() / 2)

    def probe_rounds_needed(self) -> float:
        """Clean rounds a probe collects: a few of each concurrent request's."""
        return max(self.settings.min_rounds, self.settings.rounds_per_request * (self.load or 0))

    def expected_probe_s(self, mode: bool) -> float:
        """How long a probe of `mode` takes: settling, then its rounds (all concurrent requests run rounds of
        `mode`'s recent duration back to back) over `window_requests` request durations, and no less than
        `probe_length`."""
        collect = self.probe_rounds_needed() * self.round_s[mode] / max(1.0, self.load or 1.0)
        # round durations vary: a margin, rather than an extension
        request_s = self.settings.window_requests * self.request_s
        return max(self.probe_length(), self.settle_s() + max(1.25 * collect, request_s))

    def window_s(self) -> float:
        """How long the current mode must have been measured before a probe: half a probe, and `window_requests`
        request durations."""
        return max(self.probe_length() / 2, self.settings.window_requests * self.request_s)
