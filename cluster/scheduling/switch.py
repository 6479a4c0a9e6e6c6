"""The speculation switch: a measured check on the k policy (`k_policy.py`). It compares the throughput requests
actually get while speculation is allowed and while it is not (each mode's latest period) side by side. The model
cannot see everything (a draft pool sharing cores with the target, network latency); this can.

This module is its state: when to probe the other mode (every round started meanwhile runs that way), how long a
probe lasts, and how a change of load resets what was measured. What it measures is `switch_measure.py`; how a probe
is judged, `switch_verdict.py`.

Only clean rounds count: one that started before the last mode change, or within two round times of the slower
mode after it, shared its batches with rounds of the other mode still in flight (under load, a plain round batched
with speculating ones is as slow as they are), so it measures neither mode. Probes are extended (up to twice) while
they have too few rounds, and by half their length (up to `max_settle_extensions` times) while the probed mode's
rate still moves; a probe of the other mode is put off while the current one's window is trimmed to its later half,
and a verdict compares the later halves of windows that still moved. A lasting change of load that could overturn
the verdict (requests per target doubled while speculating, or halved while not, for `interval_s`) starts probing
over from `interval_s`: speculation pays less the more the target batches (its verification moves from memory-bound
to compute-bound), so more load never makes a losing speculation win, nor less load a winning one lose. More load
also turns speculation off until measured winning.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable

from specserve.cluster.scheduling.switch_measure import ModeMeasurements, SwitchSettings
from specserve.cluster.scheduling.switch_verdict import judge, least_wait, next_probe_wait

log = logging.getLogger(__name__)


class SpeculationSwitch:
    """Whether a round starting now may speculate (`allow`), from the rounds observed so far (`observe`)."""

    def __init__(
        self, settings: SwitchSettings | None = None, clock: Callable[[], float] = time.monotonic, on: bool = True
    ):
        self.settings = settings or SwitchSettings()
        self.clock = clock
        self.on = on
        self.last_measured_speedup: float | None = None  # spec over plain throughput, as measured for the last verdict
        self.measurements = ModeMeasurements(self.settings)
        self._next_probe: float | None = None
        self._probe_until: float | None = None
        self._probe_started = 0.0
        self._probe_samples = 0
        self._probe_extensions = 0  # for want of rounds
        self._settle_extensions = 0  # while the probed mode's rate still moves
        self._postponed = 0  # probes put off while the current mode's rate still moved
        self._probe_ran = 0.0  # how long the last probe ran
        self._pending = False  # the last probe measured speculation faster: confirm against a fresh window first
        self._interval = 0.0
        self._mode: bool | None = None  # what allow() last answered
        self._settled_at = -math.inf  # rounds that started before this overlapped the other mode's
        self._decided_load: float | None = None  # requests per target when the last decision was made
        self._load_changed_at: float | None = None  # since when the load differs from the decided one

    # -- measurements -------------------------------------------------------------------------------------------------

    def observe(self, tokens: int, seconds: float, speculated: bool) -> None:
        """One round that ended now: `tokens` committed in `seconds`, speculating or not."""
        if tokens <= 0 or seconds <= 0:
            return
        mode = speculated if self._mode is None else self._mode
        self.measurements.round_ended(mode, seconds)
        now = self.clock()
        if now - seconds < self._settled_at:
            return  # overlapped rounds of the other mode
        # Filed under the current mode ("spec" = the policy was allowed to speculate, whatever k it chose), so the
        # comparison is policy-on against policy-off.
        if self._probe_until is not None and mode != self.on:
            self._probe_samples += 1
        self.measurements.add(mode, now, tokens, seconds)

    def request_finished(self, seconds: float) -> None:
        """A request took `seconds` from its start to its last token."""
        self.measurements.request_finished(seconds)

    @property
    def spec_s_per_token(self) -> float | None:
        """Request-seconds per committed token while speculation was allowed, since that mode was entered."""
        return self.measurements.rate(True)

    @property
    def plain_s_per_token(self) -> float | None:
        return self.measurements.rate(False)

    def measured_speedup(self) -> float | None:
        if self.spec_s_per_token is None or self.plain_s_per_token is None:
            return None
        return self.plain_s_per_token / self.spec_s_per_token

    def note_load(self, requests_per_target: float) -> None:
        """The current load. A change by 2x or more since the last decision that lasts `interval_s` forgets the
        rates measured before it (a window mixing two loads measures neither), and brings the next probe forward if
        it could overturn the verdict (requests per target doubled while speculating, halved while not; doubled
        while speculating also turns speculation off until a probe measures it winning at the new load), else
        restarts the wait for it; momentary swings (requests starting and ending) do nothing."""
        now = self.clock()
        self.measurements.load = requests_per_target
        if self._decided_load is None:
            self._decided_load = requests_per_target
            return
        ratio = max(requests_per_target, 1.0) / max(self._decided_load, 1.0)
        if 0.5 < ratio < 2:
            self._load_changed_at = None
            return
        if self._load_changed_at is None:
            self._load_changed_at = now
        interval_s = self.settings.interval_s
        if now - self._load_changed_at < interval_s or self._next_probe is None or self._probe_until is not None:
            return
        self._decided_load, self._load_changed_at = requests_per_target, None
        self.measurements.restart()  # measured at the old load: neither mode compares with the new
        self._pending = False  # nor does a probe measured there
        if ratio >= 2 if self.on else ratio <= 0.5:  # a change that could overturn the verdict: re-measure soon
            self._interval = interval_s
            self._next_probe = min(self._next_probe, now)
            # From the safe side: at more load, plain decoding until speculation is measured winning there. A probe
            # measures the mode it switches to while the workers still hold the other's state (batches out of step,
            # drafts to catch up), so it leans towards the mode it started from.
            self.on = False
            log.debug("load changed %.2fx to %.2f requests per target: speculation off, probing soon", ratio,
                      requests_per_target)  # fmt: skip
        else:
            # A change that bears the verdict out (more load while plain, less while speculating): the backed-off
            # wait starts over, as for a verdict confirmed now. Left due, a probe could come right after the change,
            # while the new load's window was still young (at 16-32 streams here a probe of speculation runs ~0.65x).
            self._next_probe = max(self._next_probe, now + self._interval)

    # -- modes and probes ---------------------------------------------------------------------------------------------

    def allow(self) -> bool:
        """Whether a round starting now may speculate."""
        now = self.clock()
        mode = self._mode_at(now)
        if mode != self._mode:
            self._mode, self._settled_at = mode, now + self.measurements.settle_s()
            self.measurements.restart(mode)  # a new period of this mode: compared with the other's latest
        return mode

    def _mode_at(self, now: float) -> bool:
        if self._next_probe is None:  # first call: probe the other mode soon, to have both figures
            self._interval = self.settings.interval_s
            self._next_probe = now + self.measurements.probe_length()
        if self._probe_until is not None:
            if now < self._probe_until or self._extend_probe(now):
                return not self.on
            self._end_probe(now)
        measured = self.measurements.measured(self.on, self.measurements.window_s())
        if self._pending:
            if measured:
                self._decide(now, final=True)  # the probe against the current mode's window after it
        elif now >= self._next_probe and measured:
            return self._start_probe(now)
        return self.on

    def _extend_probe(self, now: float) -> bool:
        """At the probe's end: extend it while it has too few rounds, then while its rate still moves."""
        m = self.measurements
        extend = self._probe_samples < m.probe_rounds_needed() and self._probe_extensions < 2
        if extend:
            self._probe_extensions += 1
        elif self._settle_extensions < self.settings.max_settle_extensions and m.settling(not self.on, now):
            self._settle_extensions += 1
            extend = True
        if extend:
            self._probe_until = now + m.expected_probe_s(not self.on) / 2
        return extend

    def _end_probe(self, now: float) -> None:
        self._probe_until = None
        for mode in (True, False):  # each mode's steady state: the later half of a window still moving
            if self.measurements.settling(mode, now):
                self.measurements.keep_later_half(mode, now)
        self._probe_ran = now - self._probe_started
        self._decide(now, final=False)

    def _start_probe(self, now: float) -> bool:
        """The mode for a round starting now that a probe is due (the current one's measured)."""
        if self._postponed < self.settings.max_settle_extensions and self.measurements.settling(self.on, now):
            # The current mode has not settled yet (a load change, or the last probe, disturbed it): keep its later
            # half, and compare that with the probe once it has the rounds of a window again
            self._postponed += 1
            self.measurements.keep_later_half(self.on, now)
            return self.on
        self._postponed = 0
        self._probe_started = now
        self._probe_until = now + self.measurements.expected_probe_s(not self.on)
        self._probe_samples = self._probe_extensions = self._settle_extensions = 0
        log.debug("probing speculation %s until %.2f", "off" if self.on else "on", self._probe_until)
        return not self.on

    def _decide(self, now: float, final: bool) -> None:
        """Judge the last probe (`switch_verdict.judge`) and apply the verdict."""
        m, s = self.measurements, self.measured_speedup()
        least = least_wait(self.settings, self._probe_ran)
        loads = (m.mean_load(True), m.mean_load(False))
        both = m.measured(True) and m.measured(False)
        verdict = judge(self.settings, self.on, final, s, loads, both, self._interval, least)
        log.debug("%s", verdict.describe(self.on))
        if verdict.comparable:
            self.last_measured_speedup = s
        if verdict.speedup is not None and m.load is not None:
            self._decided_load = m.load
        self._pending = verdict.pending
        if verdict.pending:
            m.restart(self.on)  # confirmed by a window measured after the probe
        self.on, self._interval = verdict.on, verdict.interval_s
        probe_s = max(self._probe_ran, m.expected_probe_s(not self.on))  # this probe may have run the faster mode
        self._next_probe = now + next_probe_wait(self.settings, verdict, least, probe_s)
