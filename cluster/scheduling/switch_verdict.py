"""The speculation switch's decision after a probe: keep the mode, flip it, or no verdict; and when to probe next.
Pure functions of the measured figures (`switch_measure.py`) and the settings.

Whichever mode was measured faster is kept, with a hysteresis margin, wider for turning speculation on: a near tie
goes to plain decoding, which spends no draft compute and, under load, has the lower tail latency (16 streams here:
p99 time per token 128 ms plain, 203 ms speculating, at 0.95x the throughput; that near a tie a probe's verdict is
noise). A probe that confirms the current mode doubles the time to the next one (up to `max_interval_s`), so a
settled service spends little time in the losing mode: probes never take more than `max_probe_share` of the time,
nor, by the verdict's measured speedup s, cost more than `max_probe_cost` of throughput (a probe of the slower mode
loses 1 - min(s, 1/s) of it while it runs: a clear verdict is re-checked rarely, a close one often, where probing
costs little). A probe that flips the mode starts over from `interval_s`. A probe that ends without enough clean
rounds of both modes is no verdict, and then speculation goes off until one says otherwise: off is never slower than
itself.

Turning speculation on is only pending until `final`: the probe must also beat plain decoding's window measured
after it, not only the one before it (a slow spell of the machine, or of plain decoding after a change of load, made
single probes at 4 and 16 streams measure speculation 1.12-1.2x faster where side-by-side segments ran it at
0.8-0.95x). Turning it off needs no confirmation: a near tie goes to plain decoding anyway.
"""

from __future__ import annotations

from dataclasses import dataclass

from specserve.cluster.scheduling.switch_measure import SwitchSettings


@dataclass(frozen=True)
class Verdict:
    on: bool  # speculation allowed from now
    wait_s: float  # to the next probe, before the bound on probing's cost (`next_probe_wait`)
    interval_s: float  # the backed-off interval from now
    speedup: float | None = None  # the measured speedup it rests on; None: no verdict
    comparable: bool = True  # both modes were measured at similar loads (else nothing was judged)
    pending: bool = False  # speculation measured faster: confirm against plain decoding's next window first

    def describe(self, was_on: bool) -> str:
        if not self.comparable:
            return "modes measured at different loads: no verdict"
        if self.speedup is None:
            return "too few rounds of a mode: no verdict, speculation off"
        if self.pending:
            return f"speculation measured {self.speedup:.3f}x: on once plain decoding is measured again"
        state = "on" if self.on else "off"
        return f"speculation {'turned' if self.on != was_on else 'kept'} {state} at a measured {self.speedup:.3f}x"


def judge(
    settings: SwitchSettings,
    on: bool,
    final: bool,
    speedup: float | None,
    loads: tuple[float | None, float | None],
    both_measured: bool,
    interval_s: float,
    least_s: float,
) -> Verdict:
    """After a probe (final=False), or once plain decoding has a fresh window after a probe that measured speculation
    faster (final=True). speedup: speculation's measured throughput over plain decoding's; loads: each mode's mean
    requests per target (speculating, plain); interval_s: the current backed-off interval; least_s: the shortest wait
    that keeps probing within `max_probe_share` of the time."""
    if None not in loads and max(loads) > 1.5 * min(loads):
        return Verdict(on, settings.interval_s, interval_s, comparable=False)  # keep the mode
    if speedup is None or not both_measured:
        return Verdict(False, settings.interval_s, settings.interval_s)  # until a verdict, do not speculate
    flip = speedup < 1.0 - settings.margin if on else speedup > 1.0 + settings.margin_on
    if flip and not on and not final:
        return Verdict(on, settings.interval_s, interval_s, speedup, pending=True)
    if flip:
        return Verdict(not on, settings.interval_s, settings.interval_s, speedup)
    backed_off = min(settings.max_interval_s, max(interval_s, least_s) * 2)
    return Verdict(on, backed_off, backed_off, speedup)


def least_wait(settings: SwitchSettings, probe_ran_s: float) -> float:
    """The shortest wait after a probe that ran `probe_ran_s` for probes to take <= `max_probe_share` of the time."""
    return probe_ran_s * (1 / settings.max_probe_share - 1)


def next_probe_wait(settings: SwitchSettings, verdict: Verdict, least_s: float, probe_s: float) -> float:
    """The time to the next probe: the verdict's, at least `least_s`, and with a verdict long enough that probing the
    slower mode (for `probe_s`) loses at most `max_probe_cost` of throughput."""
    s = verdict.speedup
    if s is not None:
        loss = 1.0 - min(s, 1.0 / s)
        least_s = min(settings.max_interval_s, max(least_s, probe_s * loss / settings.max_probe_cost))
    return max(verdict.wait_s, least_s)
