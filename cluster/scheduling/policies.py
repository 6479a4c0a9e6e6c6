"""Speculation and autoscaling policies: pure functions (and one small stateful class for hysteresis) over measured
numbers, unit-tested with synthetic inputs.

Speculation. Leviathan's speedup S(k) = E(k) / (k c + 1), with E(k) = (1 - a^(k+1)) / (1 - a) tokens per round,
assumes verifying k + 1 tokens costs one target step: true while the target is memory-bound (idle). A saturated
target is compute-bound and verification costs grow with the tokens verified, so we model
t_verify(k) = t_target (1 + u k) for target utilisation u in [0, 1]: S(k, u) = E(k) / (k c + 1 + u k). The policy
picks the k that maximises it, moves k at most one step per update and only for a clear gain (hysteresis), and turns
speculation off when even the best k would not beat plain decoding: speculation never costs throughput under load.

Autoscaling. Pool replicas report `busy_fraction` (time computing) through Serve's `record_autoscaling_stats`. The
application-level policy sizes each model's target pool to its busy time, and its draft pool to the target demand
times the measured draft/target busy-time ratio, so draft replicas follow the target's demand.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from specserve.workers.speculation.adaptive_k import expected_tokens_per_round as expected_tokens
from specserve.workers.speculation.adaptive_k import fit_acceptance
from specserve.workers.config import MAX_K


def speedup(a: float, c: float, k: int, utilisation: float = 0.0) -> float:
    """S(k, u): throughput of speculation relative to target-only decoding (k = 0 gives 1)."""
    return expected_tokens(a, k) / (k * c + 1.0 + utilisation * k)


def best_k(a: float, c: float, utilisation: float = 0.0, max_k: int = MAX_K) -> tuple[int, float]:
    """(k, S) maximising S(k, u) over 0..max_k; k = 0 means "do not speculate"."""
    best = (0, 1.0)
    for k in range(1, max_k + 1):
        s = speedup(a, c, k, utilisation)
        if s > best[1]:
            best = (k, s)
    return best


@dataclass
class SpeculationPolicy:
    """k for one model's requests from measured acceptance a, cost ratio c and target utilisation u, with
    hysteresis: k moves by one step at a time towards the best k, only when that gains more than `margin`; off
    (k = 0) when speculation would lose by more than `margin`, back on when it wins by more than `margin`."""

    max_k: int = MAX_K
    margin: float = 0.05
    k: int = 4

    def update(self, a: float, c: float, utilisation: float) -> int:
        target_k, s_best = best_k(a, c, utilisation, self.max_k)
        s_now = speedup(a, c, self.k, utilisation) if self.k else 1.0
        if self.k == 0:
            if s_best > 1.0 + self.margin:  # back on at the smallest k that wins; later updates walk it up
                self.k = next(k for k in range(1, target_k + 1) if speedup(a, c, k, utilisation) > 1.0)
        elif s_now < 1.0 - self.margin and s_best <= 1.0 + self.margin:
            self.k = 0
        elif target_k != self.k and s_best > s_now * (1.0 + self.margin):
            self.k += 1 if target_k > self.k else -1
        return self.k


@dataclass
class ModelLoad:
    """A model's recent speculation outcome (decayed sums), from which its policy k is updated.

    Acceptance is only observed while speculating, so an estimate the policy turned speculation off on would never
    be revised: while no round drafts, the evidence fades with time (half-life `fade_half_life_s`) towards a weak
    prior (`prior_rounds` pseudo-rounds of k = 1 at `prior_acceptance`), which turns speculation back on at a small
    k to measure it again; the same prior keeps one unlucky first round from turning it off at all (seen in the
    bench's sweep: a first round accepting 0 of 4 drafted tokens fitted a = 0, and speculation stayed off for good).
    Time, not rounds: many concurrent requests run many plain rounds per second."""

    decay: float = 0.98
    prior_rounds: float = 1.0
    prior_acceptance: float = 2.0 / 3.0
    fade_half_life_s: float = 10.0
    clock: Callable[[], float] = time.monotonic
    rounds: float = 0.0  # rounds that drafted
    drafted: float = 0.0
    committed: float = 0.0  # tokens those rounds committed (accepted + 1 each)
    last_drafted_at: float | None = None

    def observe(self, drafted: int, accepted: int) -> None:
        if drafted:
            w = self._weight() * self.decay
            self.rounds = self.rounds * w + 1
            self.drafted = self.drafted * w + drafted
            self.committed = self.committed * w + accepted + 1
            self.last_drafted_at = self.clock()

    def _weight(self) -> float:
        """How much of the evidence is left after the time since the last drafted round."""
        if self.last_drafted_at is None:
            return 1.0
        return 0.5 ** (max(0.0, self.clock() - self.last_drafted_at) / self.fade_half_life_s)

    def acceptance(self) -> float | None:
        """Per-position acceptance a fitted to the recent tokens per round, the prior included (None before any
        round has drafted)."""
        if self.last_drafted_at is None:
            return None
        w = self._weight()
        rounds = self.rounds * w + self.prior_rounds
        committed = self.committed * w + self.prior_rounds * (1.0 + self.prior_acceptance)
        return fit_acceptance(committed / rounds, (self.drafted * w + self.prior_rounds) / rounds)


@dataclass
class VerifyCostModel:
    """The target's measured cost of a batched forward pass, seconds = t0 + t1 * tokens, fitted by decayed least
    squares to what target workers report per verify (compute_seconds and batch_tokens of the batch it ran in).

    With B requests per target, target-only decoding steps cost t0 + t1 B and verifying k drafted tokens per request
    adds t1 B k: so the policy's utilisation is u = t1 B / (t0 + t1 B), 0 for an idle memory-bound target (a step
    costs the same whatever it verifies) and towards 1 for a saturated compute-bound one."""

    decay: float = 0.99
    w: float = 0.0
    sx: float = 0.0
    sy: float = 0.0
    sxx: float = 0.0
    sxy: float = 0.0

    def observe(self, tokens: int, seconds: float) -> None:
        if tokens <= 0 or seconds <= 0:
            return
        d = self.decay
        self.w, self.sx, self.sy = self.w * d + 1, self.sx * d + tokens, self.sy * d + seconds
        self.sxx, self.sxy = self.sxx * d + tokens * tokens, self.sxy * d + tokens * seconds

    def fit(self) -> tuple[float, float] | None:
        """(t0, t1), or None until batches of different sizes have been seen."""
        det = self.w * self.sxx - self.sx * self.sx
        if self.w < 2 or det <= 1e-9 * max(1.0, self.w * self.sxx):
            return None
        t1 = max(0.0, (self.w * self.sxy - self.sx * self.sy) / det)
        t0 = max(0.0, (self.sy - t1 * self.sx) / self.w)
        return t0, t1

    def utilisation(self, requests_per_target: float) -> float | None:
        fit = self.fit()
        if fit is None or requests_per_target <= 0:
            return None
        t0, t1 = fit
        step = t0 + t1 * requests_per_target
        return 0.0 if step <= 0 else min(1.0, t1 * requests_per_target / step)


def target_utilisation(active_requests: int, healthy_targets: int, saturation_requests: int) -> float:
    """Fraction of the target pool's capacity in use: requests per target over the per-target saturation point."""
    if healthy_targets <= 0:
        return 1.0
    return min(1.0, active_requests / (healthy_targets * saturation_requests))


@dataclass
class _Window:
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

    def part(self, start: float, end: float = math.inf) -> _Window:
        """The (logged) rounds that ended in [start, end)."""
        part = _Window()
        for ended, tokens, seconds, load in self.log:
            if start <= ended < end:
                part.add(ended, tokens, seconds, load)
        return part

    def halves(self, now: float) -> tuple[_Window, _Window]:
        """The rounds that ended in the first and in the later half of the time from the first one's end to now."""
        if not self.log:
            return _Window(), _Window()
        mid = (self.log[0][0] + now) / 2
        return self.part(-math.inf, mid), self.part(mid)

    @property
    def rate(self) -> float | None:
        return self.seconds / self.tokens if self.tokens else None


@dataclass
class SpeculationSwitch:
    """A measured check on the model above: the throughput requests actually get while speculation is allowed and
    while it is not (each mode's latest period), compared side by side. The model cannot see everything (a draft
    pool sharing cores with the target, network latency); this can.

    Every so often it probes the other mode (every round started meanwhile runs that way) and keeps whichever was
    measured faster, with a hysteresis margin, wider for turning speculation on: a near tie goes to plain decoding,
    which spends no draft compute and, under load, has the lower tail latency (16 streams here: p99 time per token
    128 ms plain, 203 ms speculating, at 0.95x the throughput; that near a tie a probe's verdict is noise). A probe
    that confirms the current mode doubles the time to the next one (up to `max_interval_s`), so a settled service
    spends little time in the losing mode: probes never take more than `max_probe_share` of the time, nor, by the
    last verdict's measured speedup s, cost more than `max_probe_cost` of throughput (a probe of the slower mode
    loses 1 - min(s, 1/s) of it while it runs: a clear verdict is re-checked rarely, a close one often, where
    probing costs little). A probe that flips it starts over from `interval_s`, and so does a lasting change of load
    that could overturn the verdict (requests per target doubled while speculating, or halved while not, for
    `interval_s`): speculation pays less the more the target batches (its verification moves from memory-bound to
    compute-bound), so more load never makes a losing speculation win, nor less load a winning one lose. More load
    also turns speculation off until measured winning.

    A mode's rate is request-seconds per committed token over its clean rounds (each round's duration and tokens,
    summed: at equal load, inverse throughput; unlike a wall-clock window it does not depend on which request's
    round ends first, and batched requests' rounds end together), compared only when both modes were measured at
    similar loads (within 1.5x). Only clean rounds count: one that started before the last mode change, or within
    two round times of the slower mode after it, shared its batches with rounds of the other mode still in flight
    (under load, a plain round batched with speculating ones is as slow as they are), so it measures neither mode.
    Probes last at least `probe_rounds` round times of the slower mode and as long as the probed mode takes to run a
    window's rounds (plus a margin), and are extended (up to twice) while they have too few rounds. Workers take a
    while to reach a mode's steady state (plain decoding's batches have to merge again; 16 speculating streams start
    in step and ran as fast as plain decoding for 2-4 s, then ~0.65x: a probe that short turned speculation on where
    it lost), so a window whose later half's rate differs from its first half's by more than `settle_tolerance` is
    still settling: a probe is then extended by half its length (up to `max_settle_extensions` times), a probe of
    the other mode is put off while the current one's window is trimmed to its later half, and a verdict compares
    the later halves of windows that still moved. Windows and probes also span `window_requests` request durations:
    under load, requests that start together finish together and the next ones prefill together, so throughput dips
    once per request duration (16 streams here: by up to half, every ~3 s), and a shorter window measures where it
    fell in that cycle (probes of 2.6 s rated plain decoding 20-30% below its segments). A probe that ends without
    enough clean rounds of both modes is no verdict, and then the switch turns speculation off until one says
    otherwise: off is never slower than itself. Turning speculation on also waits for plain decoding to be measured
    again after the probe, and the probe must beat that window too (single probes under load measured speculation
    1.12-1.2x faster where side-by-side segments ran it at 0.8-0.95x)."""

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
    decay: float = 0.8
    clock: Callable[[], float] = time.monotonic
    on: bool = True
    last_measured_speedup: float | None = None  # spec over plain throughput, as measured for the last verdict
    _next_probe: float | None = None
    _probe_until: float | None = None
    _probe_started: float = 0.0
    _probe_samples: int = 0
    _probe_extensions: int = 0  # for want of rounds
    _settle_extensions: int = 0  # while the probed mode's rate still moves
    _postponed: int = 0  # probes put off while the current mode's rate still moved
    _probe_ran: float = 0.0  # how long the last probe ran
    _pending: bool = False  # the last probe measured speculation faster: confirm against a fresh window first
    _interval: float = 0.0
    _mode: bool | None = None  # what allow() last answered
    _settled_at: float = -math.inf  # rounds that started before this overlapped the other mode's
    _round_s: dict = field(default_factory=lambda: {True: 0.0, False: 0.0})  # recent round duration per mode
    _request_s: float = 0.0  # recent request duration, start to last token
    _decided_load: float | None = None  # requests per target when the last decision was made
    _load: float | None = None  # requests per target, as last noted
    _load_changed_at: float | None = None  # since when the load differs from the decided one
    _windows: dict = field(default_factory=lambda: {True: _Window(), False: _Window()})  # True: speculation allowed

    def observe(self, tokens: int, seconds: float, speculated: bool) -> None:
        """One round that ended now: `tokens` committed in `seconds`, speculating or not."""
        if tokens <= 0 or seconds <= 0:
            return
        mode = speculated if self._mode is None else self._mode
        recent = self._round_s[mode]
        self._round_s[mode] = seconds if recent == 0 else recent * self.decay + seconds * (1 - self.decay)
        now = self.clock()
        started = now - seconds
        if started < self._settled_at:
            return  # overlapped rounds of the other mode
        # Filed under the current mode ("spec" = the policy was allowed to speculate, whatever k it chose), so the
        # comparison is policy-on against policy-off.
        if self._probe_until is not None and mode != self.on:
            self._probe_samples += 1
        self._windows[mode].add(now, tokens, seconds, max(1.0, self._load or 1.0))

    def _rate(self, allowed: bool) -> float | None:
        """Seconds of request time per committed token over the mode's clean rounds (inverse per-request speed: at
        equal load, inverse throughput)."""
        return self._windows[allowed].rate

    def _mean_load(self, allowed: bool) -> float | None:
        w = self._windows[allowed]
        return w.loads / w.rounds if w.rounds else None

    @property
    def spec_s_per_token(self) -> float | None:
        """Request-seconds per committed token while speculation was allowed, since that mode was entered."""
        return self._rate(True)

    @property
    def plain_s_per_token(self) -> float | None:
        return self._rate(False)

    def note_load(self, requests_per_target: float) -> None:
        """The current load. A change by 2x or more since the last decision that lasts `interval_s` forgets the
        rates measured before it (a window mixing two loads measures neither), and brings the next probe forward if
        it could overturn the verdict (requests per target doubled while speculating, halved while not; doubled
        while speculating also turns speculation off until a probe measures it winning at the new load), else
        restarts the wait for it; momentary swings (requests starting and ending) do nothing."""
        now = self.clock()
        self._load = requests_per_target
        if self._decided_load is None:
            self._decided_load = requests_per_target
            return
        ratio = max(requests_per_target, 1.0) / max(self._decided_load, 1.0)
        if 0.5 < ratio < 2:
            self._load_changed_at = None
            return
        if self._load_changed_at is None:
            self._load_changed_at = now
        if now - self._load_changed_at < self.interval_s or self._next_probe is None or self._probe_until is not None:
            return
        self._decided_load, self._load_changed_at = requests_per_target, None
        self._windows = {True: _Window(), False: _Window()}  # measured at the old load: neither compares with the new
        self._pending = False  # nor does a probe measured there
        if ratio >= 2 if self.on else ratio <= 0.5:  # a change that could overturn the verdict: re-measure soon
            self._interval = self.interval_s
            self._next_probe = min(self._next_probe, now)
            # From the safe side: at more load, plain decoding until speculation is measured winning there. A probe
            # measures the mode it switches to while the workers still hold the other's state (batches out of step,
            # drafts to catch up), so it leans towards the mode it started from.
            self.on = False
        else:
            # A change that bears the verdict out (more load while plain, less while speculating): the backed-off
            # wait starts over, as for a verdict confirmed now. Left due, a probe could come right after the change,
            # while the new load's window was still young (at 16-32 streams here a probe of speculation runs ~0.65x).
            self._next_probe = max(self._next_probe, now + self._interval)

    def measured_speedup(self) -> float | None:
        if self.spec_s_per_token is None or self.plain_s_per_token is None:
            return None
        return self.plain_s_per_token / self.spec_s_per_token

    def allow(self) -> bool:
        """Whether a round starting now may speculate."""
        now = self.clock()
        mode = self._mode_at(now)
        if mode != self._mode:
            self._mode, self._settled_at = mode, now + self._settle_s()
            self._windows[mode] = _Window()  # a new period of this mode: compared with the other's latest
        return mode

    def _probe_length(self) -> float:
        """`probe_rounds` round times of the slower mode: the faster one's first rounds share batches with the
        slower one's last, so its probe must outlast them too."""
        return max(self.probe_s, self.probe_rounds * max(self._round_s.values()))

    def _settle_s(self) -> float:
        """After a mode change, how long rounds still share batches with the other mode's: the slower mode's rounds
        in flight hold the workers' batches for up to a round time, and rounds queued behind them for about another."""
        return min(2 * max(self._round_s.values()), self._probe_length() / 2)

    def _probe_rounds_needed(self) -> float:
        """Clean rounds a probe collects: a few of each concurrent request's."""
        return max(self.min_rounds, self.rounds_per_request * (self._load or 0))

    def _expected_probe_s(self, mode: bool) -> float:
        """How long a probe of `mode` takes: settling, then its rounds (all concurrent requests run rounds of
        `mode`'s recent duration back to back) over `window_requests` request durations, and no less than
        `_probe_length`."""
        collect = self._probe_rounds_needed() * self._round_s[mode] / max(1.0, self._load or 1.0)
        # round durations vary: a margin, rather than an extension
        return max(self._probe_length(), self._settle_s() + max(1.25 * collect, self.window_requests * self._request_s))

    def request_finished(self, seconds: float) -> None:
        """A request took `seconds` from its start to its last token."""
        if seconds > 0:
            recent = self._request_s
            self._request_s = seconds if recent == 0 else recent * self.decay + seconds * (1 - self.decay)

    def _mode_at(self, now: float) -> bool:
        if self._next_probe is None:  # first call: probe the other mode soon, to have both figures
            self._interval = self.interval_s
            self._next_probe = now + self._probe_length()
        if self._probe_until is not None:
            if now < self._probe_until:
                return not self.on
            # Extended while it has too few rounds, then while its rate still moves
            extend = self._probe_samples < self._probe_rounds_needed() and self._probe_extensions < 2
            if extend:
                self._probe_extensions += 1
            elif self._settle_extensions < self.max_settle_extensions and self._settling(not self.on, now):
                self._settle_extensions += 1
                extend = True
            if extend:
                self._probe_until = now + self._expected_probe_s(not self.on) / 2
                return not self.on
            self._probe_until = None
            for mode in (True, False):  # each mode's steady state: the later half of a window still moving
                if self._settling(mode, now):
                    self._windows[mode] = self._windows[mode].halves(now)[1]
            self._probe_ran = now - self._probe_started
            self._decide(now, final=False)
        measured = self._measured(self.on, self._window_s())
        if self._pending:
            if measured:
                self._decide(now, final=True)  # the probe against the current mode's window after it
        elif now >= self._next_probe and measured:
            if self._postponed < self.max_settle_extensions and self._settling(self.on, now):
                # The current mode has not settled yet (a load change, or the last probe, disturbed it): keep its
                # later half, and compare that with the probe once it has the rounds of a window again
                self._postponed += 1
                self._windows[self.on] = self._windows[self.on].halves(now)[1]
                return self.on
            self._postponed = 0
            self._probe_started = now
            self._probe_until = now + self._expected_probe_s(not self.on)
            self._probe_samples = self._probe_extensions = self._settle_extensions = 0
            return not self.on
        return self.on

    def _settling(self, mode: bool, now: float) -> bool:
        """Whether the mode's rate still moves: the later half of its window differs from the first by more than
        `settle_tolerance` (see the class's note on steady states)."""
        first, later = self._windows[mode].halves(now)
        if min(first.rounds, later.rounds) < self.min_rounds / 2 or first.rate is None or later.rate is None:
            return False  # too few rounds to tell: the count of rounds decides
        return abs(later.rate / first.rate - 1.0) > self.settle_tolerance

    def _window_s(self) -> float:
        """How long the current mode must have been measured before a probe: half a probe, and `window_requests`
        request durations."""
        return max(self._probe_length() / 2, self.window_requests * self._request_s)

    def _measured(self, allowed: bool, seconds: float = 0.0) -> bool:
        """Whether the mode's window has enough rounds for a verdict (`rounds_per_request` per concurrent request) and
        spans `seconds` (the current mode before a probe: else there is nothing to compare the probe with)."""
        w = self._windows[allowed]
        load = self._mean_load(allowed) or 0.0
        rounds = max(self.min_rounds, self.rounds_per_request * load)
        return w.rounds >= rounds and w.seconds >= seconds * max(1.0, load)

    def _decide(self, now: float, final: bool) -> None:
        """After a probe (final=False), or once plain decoding has a fresh window after a probe that measured
        speculation faster (final=True: see `_verdict`)."""
        probe = self._probe_ran
        least = probe * (1 / self.max_probe_share - 1)  # probes take <= max_probe_share of the time
        interval, s = self._verdict(least, final)
        if s is not None:  # a verdict: the next probe runs the slower mode, losing `loss` of throughput meanwhile
            loss = 1.0 - min(s, 1.0 / s)
            probe = max(probe, self._expected_probe_s(not self.on))  # this probe may have run the faster mode
            least = min(self.max_interval_s, max(least, probe * loss / self.max_probe_cost))
        self._next_probe = now + max(interval, least)

    def _verdict(self, least: float, final: bool) -> tuple[float, float | None]:
        """Decide after a probe: the time to the next one (backing off from at least `least`) and the measured
        speedup the verdict rests on (None: no verdict). Turning speculation on is only pending until `final`: the
        probe must also beat plain decoding's window measured after it, not only the one before it (a slow spell
        of the machine, or of plain decoding after a change of load, made single probes at 4 and 16 streams measure
        speculation 1.12-1.2x faster where side-by-side segments ran it at 0.8-0.95x). Turning it off needs no
        confirmation: a near tie goes to plain decoding anyway."""
        self._pending = False
        loads = (self._mean_load(True), self._mean_load(False))
        if None not in loads and max(loads) > 1.5 * min(loads):
            return self.interval_s, None  # the two modes were measured at different loads: no verdict (keep the mode)
        s = self.measured_speedup()
        self.last_measured_speedup = s
        if s is None or not (self._measured(True) and self._measured(False)):
            self.on = False  # too few rounds of a mode: no verdict; until one, do not speculate
            self._interval = self.interval_s
            return self.interval_s, None
        if self._load is not None:
            self._decided_load = self._load
        flip = s < 1.0 - self.margin if self.on else s > 1.0 + self.margin_on
        if flip and not self.on and not final:
            self._pending = True
            self._windows[self.on] = _Window()  # confirmed by a window measured after the probe
            return self.interval_s, s
        if flip:
            self.on = not self.on
            self._interval = self.interval_s
        else:
            self._interval = min(self.max_interval_s, max(self._interval, least) * 2)
        return self._interval, s


def update_speculation(
    pipeline,
    load: ModelLoad,
    policy: SpeculationPolicy,
    cost_ratio: float,
    saturation_requests: int | None,
    switch: SpeculationSwitch | None = None,
) -> None:
    """Set the pipeline's cap on k for k='auto' requests: the policy's k for the recent acceptance, the draft cost
    ratio and the target pool's utilisation (from `saturation_requests` when configured, else measured), turned
    off while `switch` measures speculation losing."""
    a = load.acceptance()
    if a is None:
        return
    sched = pipeline.scheduler
    targets = len(sched.healthy("target"))
    if switch is not None:
        switch.note_load(len(sched.requests) / max(1, targets))
    if switch is not None and not switch.allow():
        sched.auto_k_cap = 0
        return
    if saturation_requests:
        u = target_utilisation(len(sched.requests), targets, saturation_requests)
    else:
        u = pipeline.verify_costs.utilisation(len(sched.requests) / max(1, targets)) or 0.0
    # Probes of speculation draft the policy's k, not one token: with a fixed cost per drafting round (the draft
    # worker's round trip), k = 1 can lose where a larger k wins (seen at one stream, disaggregated: k = 1 no faster
    # than plain decoding, the policy's k 1.5x).
    sched.auto_k_cap = policy.update(a, cost_ratio, u)


@dataclass
class SpeculationControl:
    """One model's speculation state, fed after every round of every request: recent acceptance, the policy's k and
    the measured switch. The Serve app keeps one per model; the bench keeps one across its concurrency levels."""

    load: ModelLoad = field(default_factory=ModelLoad)
    policy: SpeculationPolicy = field(default_factory=SpeculationPolicy)
    switch: SpeculationSwitch = field(default_factory=SpeculationSwitch)

    def after_round(
        self, drafted: int, accepted: int, committed: int, seconds: float, request_s: float | None = None
    ) -> None:
        """One round of a request; `request_s`: the request's duration when the round was its last."""
        self.load.observe(drafted, accepted)
        if request_s is not None:
            self.switch.request_finished(request_s)
        # First rounds count too: they prefill the prompt, on the target in either mode and also on the draft worker
        # while speculating, a cost of that mode like any other. Left out, they rated speculation's few rounds per
        # request (about 8 for 32 tokens, against plain decoding's 32) as faster than the streams got them: in one
        # sweep, measured 1.2-1.4x at 4-16 streams where the segments ran 0.96-1.04x.
        self.switch.observe(committed, seconds, drafted > 0)

    def apply(self, pipeline, cost_ratio: float, saturation_requests: int | None) -> None:
        update_speculation(pipeline, self.load, self.policy, cost_ratio, saturation_requests, self.switch)


# -- autoscaling ---------------------------------------------------------------------------------------------------


def _busy(ctx) -> float:
    """Sum of the replicas' busy fractions (replica-equivalents of work) from the aggregated custom metric."""
    per_replica = (ctx.aggregated_metrics or {}).get("busy_fraction") or {}
    return float(sum(per_replica.values()))


def pool_sizes(target_busy: float, draft_busy: float | None, goal: float) -> tuple[int, int | None]:
    """(target replicas, draft replicas or None) so that each replica is busy `goal` of the time on average.
    Drafts follow the target: the draft work per unit of target work (the measured busy ratio) times the target pool
    that is being asked for, so a saturated target pool that grows brings its drafts along."""
    targets = max(1, math.ceil(target_busy / goal - 1e-9))
    if draft_busy is None:
        return targets, None
    ratio = draft_busy / target_busy if target_busy > 0 else 0.0
    drafts = max(1, math.ceil(max(draft_busy / goal, ratio * targets) - 1e-9))
    return targets, drafts


class PoolAutoscalingPolicy:
    """Serve application-level autoscaling policy (`autoscaling_policy.policy_function` in the Serve config):
    scales every model's `target-<model>` and `draft-<model>` deployments together."""

    def __init__(self, goal_busy_fraction: float = 0.7):
        if not 0 < goal_busy_fraction <= 1:
            raise ValueError(f"goal_busy_fraction must be in (0, 1], got {goal_busy_fraction}")
        self.goal = goal_busy_fraction

    def __call__(self, contexts: dict) -> tuple[dict, dict]:
        by_name = {ctx.deployment_name: (dep_id, ctx) for dep_id, ctx in contexts.items()}
        decisions: dict = {}
        for name, (dep_id, ctx) in by_name.items():
            if not name.startswith("target-"):
                continue
            draft = by_name.get("draft-" + name[len("target-") :])
            targets, drafts = pool_sizes(_busy(ctx), _busy(draft[1]) if draft else None, self.goal)
            decisions[dep_id] = targets
            if draft is not None:
                decisions[draft[0]] = drafts
        return decisions, {}
