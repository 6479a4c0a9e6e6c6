"""The k policy, the speculation switch and the autoscaling policy alone, over synthetic measurements and Serve
autoscaling contexts."""

import heapq
import math
import random

import pytest
from ray.serve.config import AutoscalingContext

from specserve.cluster.scheduling.autoscaling import PoolAutoscalingPolicy, pool_sizes
from specserve.cluster.scheduling.k_policy import (
    AcceptanceHistory,
    SpeculationPolicy,
    VerifyCostModel,
    best_k,
    speedup,
    target_utilisation,
)
from specserve.cluster.scheduling.speculation_control import SpeculationControl
from specserve.cluster.scheduling.switch import SpeculationSwitch
from specserve.cluster.scheduling.switch_measure import SwitchSettings
from specserve.cluster.scheduling.switch_verdict import judge, least_wait, next_probe_wait
from specserve.workers.speculation.adaptive_k import expected_tokens_per_round as expected_tokens


def test_leviathan_formulas():
    assert expected_tokens(0.0, 4) == 1.0 and expected_tokens(1.0, 4) == 5.0
    assert expected_tokens(0.5, 2) == pytest.approx(1 + 0.5 + 0.25)
    assert speedup(0.8, 0.1, 0) == 1.0
    assert speedup(0.8, 0.1, 3) == pytest.approx((1 - 0.8**4) / 0.2 / 1.3)


def test_best_k_grows_with_acceptance_and_shrinks_with_cost_and_load():
    ks = [best_k(a, 0.05)[0] for a in (0.5, 0.7, 0.9)]
    assert ks == sorted(ks) and ks[0] < ks[-1]
    assert best_k(0.8, 0.3)[0] < best_k(0.8, 0.02)[0]
    assert best_k(0.8, 0.05, utilisation=1.0)[0] < best_k(0.8, 0.05, utilisation=0.0)[0]
    assert best_k(0.1, 0.2)[0] == 0  # a useless draft: do not speculate
    assert best_k(0.6, 0.05, utilisation=1.0) == (0, 1.0)  # saturated target, mediocre draft: off


def test_policy_moves_k_one_step_at_a_time_with_hysteresis():
    policy = SpeculationPolicy(k=1)
    seen = [policy.update(0.85, 0.05, 0.0) for _ in range(10)]
    _, s_best = best_k(0.85, 0.05)
    assert all(abs(b - a) <= 1 for a, b in zip([1, *seen[:-1]], seen, strict=True))  # smooth
    assert seen[-1] > 1 and speedup(0.85, 0.05, seen[-1]) * (1 + policy.margin) >= s_best  # settled near the best
    # a measurement that barely changes the optimum leaves k alone (no flapping)
    assert policy.update(0.849, 0.05, 0.0) == seen[-1]


def test_policy_turns_off_under_saturation_and_back_on_when_load_drops():
    policy = SpeculationPolicy(k=4)
    ks = [policy.update(0.6, 0.05, 1.0) for _ in range(6)]
    assert ks[-1] == 0
    for k in ks:  # never a k that loses throughput by more than the margin at this load, except while stepping down
        assert k == 0 or speedup(0.6, 0.05, k, 1.0) > 0.8
    assert policy.update(0.6, 0.05, 0.0) > 0


def _rounds(
    history: AcceptanceHistory, policy: SpeculationPolicy, clock, a: float, n: int, rng: random.Random, dt=0.03
):
    """n rounds at the policy's k, each drafted token accepted with probability a until the first rejection."""
    for _ in range(n):
        clock.t += dt
        accepted = 0
        while accepted < policy.k and rng.random() < a:
            accepted += 1
        history.observe(policy.k, accepted)
        policy.update(history.estimate(), 0.075, 0.02)


def test_acceptance_is_fitted_per_position_from_recent_rounds():
    clock, rng = _Clock(), random.Random(0)
    history, policy = AcceptanceHistory(clock=clock), SpeculationPolicy()
    assert history.estimate() is None  # nothing drafted yet: no estimate, the policy is not run
    _rounds(history, policy, clock, 0.7, 400, rng)
    assert history.estimate() == pytest.approx(0.7, abs=0.08)
    assert policy.k >= 3  # the best k at a = 0.7, c = 0.075 is 4-5
    _rounds(history, policy, clock, 0.2, 400, rng)  # the workload changed: recent rounds decide
    assert history.estimate() == pytest.approx(0.2, abs=0.08) and policy.k <= 2


def test_one_unlucky_round_does_not_turn_speculation_off():
    # The bench's sweep: a first round accepted 0 of 4 drafted tokens, the fit said a = 0, and k went to 0 for good.
    clock = _Clock()
    history, policy = AcceptanceHistory(clock=clock), SpeculationPolicy()
    history.observe(4, 0)
    assert policy.update(history.estimate(), 0.075, 0.02) > 0


def test_speculation_turned_off_for_low_acceptance_is_measured_again_later():
    # Acceptance is only observed while drafting: off must not be for good, or a draft that got better (or a
    # workload it suits) is never noticed.
    clock, rng = _Clock(), random.Random(1)
    history, policy = AcceptanceHistory(clock=clock), SpeculationPolicy()
    _rounds(history, policy, clock, 0.0, 60, rng)
    assert policy.k == 0
    off_since, seen = clock.t, []
    while clock.t - off_since < 120:
        _rounds(history, policy, clock, 0.0, 1, rng)  # plain rounds while off (k = 0 drafts nothing), probes while on
        seen.append(policy.k)
    back_on = seen.index(next(k for k in seen if k > 0))
    assert 5 < back_on * 0.03 < 60  # after a while, not at once: the evidence fades with time
    assert 0 < sum(k > 0 for k in seen) / len(seen) < 0.05  # re-measuring a useless draft costs little
    _rounds(history, policy, clock, 0.8, 2000, rng)  # the draft now agrees: speculation comes back and stays
    assert policy.k >= 3 and history.estimate() > 0.7


def test_target_utilisation():
    assert target_utilisation(0, 2, 8) == 0.0
    assert target_utilisation(8, 2, 8) == 0.5
    assert target_utilisation(100, 2, 8) == 1.0 and target_utilisation(1, 0, 8) == 1.0


def test_pool_sizes_follow_target_demand():
    assert pool_sizes(0.0, 0.0, 0.7) == (1, 1)
    assert pool_sizes(2.1, None, 0.7) == (3, None)
    # targets saturated (2 busy replicas worth) with drafts at 0.4 busy: 4 targets, drafts scale with them
    targets, drafts = pool_sizes(2.0, 0.4, 0.5)
    assert targets == 4 and drafts == math.ceil(0.2 * 4)
    assert pool_sizes(1.0, 1.8, 0.6) == (2, 4)  # a slow draft model: more drafts than targets


def _ctx(name: str, busy: list[float]) -> AutoscalingContext:
    return AutoscalingContext(
        deployment_id=name, deployment_name=name, app_name="specserve", current_num_replicas=len(busy),
        target_num_replicas=len(busy), running_replicas=[f"{name}-{i}" for i in range(len(busy))],
        total_num_requests=0.0, total_queued_requests=0.0,
        aggregated_metrics={"busy_fraction": {f"{name}-{i}": b for i, b in enumerate(busy)}}, raw_metrics={},
        capacity_adjusted_min_replicas=1, capacity_adjusted_max_replicas=8, policy_state={},
        last_scale_up_time=None, last_scale_down_time=None, current_time=0.0, config=None,
    )  # fmt: skip


def test_app_policy_scales_draft_and_target_pools_together():
    contexts = {n: _ctx(n, b) for n, b in (("target-m", [0.95, 0.9]), ("draft-m", [0.5]), ("ingress", []))}
    decisions, state = PoolAutoscalingPolicy(goal_busy_fraction=0.7)(contexts)
    assert decisions == {"target-m": 3, "draft-m": math.ceil(0.5 / 1.85 * 3)} and "ingress" not in decisions
    idle = {n: _ctx(n, b) for n, b in (("target-m", [0.05, 0.0]), ("draft-m", [0.01, 0.0]))}
    assert PoolAutoscalingPolicy()(idle)[0] == {"target-m": 1, "draft-m": 1}
    with pytest.raises(ValueError):
        PoolAutoscalingPolicy(goal_busy_fraction=0)


def test_verify_cost_model_fits_batched_step_costs_and_turns_them_into_utilisation():
    model = VerifyCostModel()
    assert model.utilisation(8) is None  # nothing measured yet
    for tokens in (5, 10, 20, 40, 80, 160):
        model.observe(tokens, 0.010 + 0.0005 * tokens)  # t0 = 10 ms, t1 = 0.5 ms per token
    t0, t1 = model.fit()
    assert t0 == pytest.approx(0.010, rel=1e-6) and t1 == pytest.approx(0.0005, rel=1e-6)
    assert model.utilisation(1) == pytest.approx(0.0005 / 0.0105)
    assert model.utilisation(100) == pytest.approx(0.05 / 0.06)
    # A saturated target makes speculation lose: the policy's best k falls as the batch grows.
    a, c = 0.7, 0.05
    assert best_k(a, c, model.utilisation(1))[0] > best_k(a, c, model.utilisation(100))[0]


def test_one_batch_size_alone_fits_nothing():
    model = VerifyCostModel()
    for _ in range(10):
        model.observe(16, 0.02)
    assert model.fit() is None and model.utilisation(4) is None


class _Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def _drive(switch: SpeculationSwitch, clock: _Clock, seconds: float, spec_rate: float, plain_rate: float) -> list:
    """One stream's rounds for `seconds`, each as long as its mode's rate says (4 tokens speculating, 1 without),
    observed when it ends. Returns (speculated, duration) per round."""
    rounds, end = [], clock.t + seconds
    while clock.t < end:
        speculate = switch.allow()
        tokens = 4 if speculate else 1
        duration = tokens * (spec_rate if speculate else plain_rate)
        clock.t += duration
        switch.observe(tokens, duration, speculate)
        rounds.append((speculate, duration))
    return rounds


def _spec_time_share(rounds: list) -> float:
    return sum(d for s, d in rounds if s) / sum(d for _, d in rounds)


def test_switch_turns_losing_speculation_off_and_backs_off_its_probes():
    clock = _Clock()
    switch = SpeculationSwitch(clock=clock)
    rounds = _drive(switch, clock, 3.0, spec_rate=0.03, plain_rate=0.02)  # speculation measured 1.5x slower
    assert not switch.on and switch.measured_speedup() == pytest.approx(0.02 / 0.03)
    later = _drive(switch, clock, 60.0, spec_rate=0.03, plain_rate=0.02)
    # Settled: probes of the losing mode get rarer (at 1, 2, 4, 8, ... s intervals): < 10% of the time.
    assert _spec_time_share(later) < 0.1 and all(s for s, _ in rounds[:2])  # it started on


@pytest.mark.parametrize("plain_after", [0.015, 0.03])
def test_a_flip_waits_until_the_probe_also_beats_the_current_mode_measured_after_it(plain_after):
    clock = _Clock()
    switch = SpeculationSwitch(clock=clock, on=False)
    while switch.last_measured_speedup is None:  # plain decoding in a slow spell (0.03), then a probe of speculation
        _drive(switch, clock, 0.01, spec_rate=0.02, plain_rate=0.03)
    assert switch.last_measured_speedup == pytest.approx(1.5) and not switch.on  # faster, but only pending
    rounds = _drive(switch, clock, 10.0, spec_rate=0.02, plain_rate=plain_after)
    if plain_after < 0.02:  # the slow spell is over: plain decoding measured after the probe beats it, off it stays
        assert not switch.on and not rounds[-1][0] and switch.last_measured_speedup == pytest.approx(0.75)
    else:  # still slower after the probe: speculation goes on
        assert switch.on and rounds[-1][0]


def test_switch_counts_only_rounds_that_did_not_overlap_the_other_mode():
    clock = _Clock()
    switch = SpeculationSwitch(clock=clock)
    while switch.last_measured_speedup is None:  # one probe of plain decoding (a round at a time): on it stays
        _drive(switch, clock, 0.01, spec_rate=0.01, plain_rate=0.02)
    assert switch.on and switch.last_measured_speedup == pytest.approx(2.0)
    while switch._probe_until is None:  # speculating rounds until the next probe starts ...
        _drive(switch, clock, 0.01, spec_rate=0.01, plain_rate=0.02)
    spec = switch.spec_s_per_token
    assert spec == pytest.approx(0.01) and switch.plain_s_per_token is None
    assert switch.allow() is False
    clock.t += 0.01
    switch.observe(1, 0.5, speculated=False)  # ... then a round that started before the change: not a sample
    switch.observe(
        1, 0.5 * switch.measurements.round_s[False], speculated=False
    )  # one that started right after it: not one either
    assert switch.spec_s_per_token == spec and switch.plain_s_per_token is None  # the probe has no sample yet
    clock.t += 1.0
    switch.observe(1, 0.03, speculated=False)  # later rounds of the probe count
    assert switch.plain_s_per_token == pytest.approx(0.03)


def test_probes_last_several_round_times_under_load():
    clock = _Clock()
    switch = SpeculationSwitch(clock=clock)
    _drive(switch, clock, 12.0, spec_rate=0.1, plain_rate=0.3)  # rounds of 0.3-0.4 s: longer than probe_s
    assert switch.measurements.probe_length() >= switch.settings.probe_rounds * 0.3 and switch.on
    assert switch.measured_speedup() == pytest.approx(3.0)  # clean samples of both modes were collected


def test_switch_keeps_winning_speculation_on_and_comes_back_when_it_wins_again():
    clock = _Clock()
    switch = SpeculationSwitch(clock=clock)
    _drive(switch, clock, 2.0, spec_rate=0.01, plain_rate=0.02)
    assert switch.on
    _drive(switch, clock, 40.0, spec_rate=0.05, plain_rate=0.02)  # load changed: speculation now loses
    assert not switch.on
    # and wins again: a later probe turns it back on (probes of a clearly losing mode are rare: <= max_interval_s)
    _drive(switch, clock, switch.settings.max_interval_s + 20.0, spec_rate=0.01, plain_rate=0.02)
    assert switch.on


def test_a_change_of_load_that_could_overturn_the_verdict_brings_the_next_probe_forward():
    clock = _Clock()
    switch = SpeculationSwitch(clock=clock)
    switch.note_load(16.0)
    rng = random.Random(0)
    _drive_streams(switch, clock, 60.0, 16, spec_round=0.12, plain_round=0.02, rng=rng)  # settled off, backed off
    while switch._probe_until is not None:  # not mid-probe (load changes wait for a probe to end)
        _drive_streams(switch, clock, 0.5, 16, spec_round=0.12, plain_round=0.02, rng=rng)
    assert not switch.on and switch._interval >= 8
    pending = switch._next_probe
    assert switch.plain_s_per_token is not None
    switch.note_load(64.0)  # more load cannot make a losing speculation win: nothing to re-measure ...
    clock.t += 2 * switch.settings.interval_s
    switch.note_load(64.0)
    assert switch.plain_s_per_token is None  # ... but what was measured at the old load is forgotten ...
    assert switch._next_probe == max(pending, clock.t + switch._interval)  # ... and the wait starts over
    pending = switch._next_probe
    switch.note_load(12.0)  # a small change: nothing happens
    switch.note_load(1.0)  # 16x fewer requests per target, but only for a moment: nothing yet
    clock.t += 0.5
    switch.note_load(16.0)
    assert switch._next_probe == pending and switch._interval >= 8
    switch.note_load(1.0)  # less load for longer than interval_s: probe now, forget what was measured at the old load
    clock.t += switch.settings.interval_s
    switch.note_load(1.0)
    assert switch._next_probe <= clock.t and switch._interval == switch.settings.interval_s
    assert switch.spec_s_per_token is None and switch.plain_s_per_token is None
    _drive(switch, clock, 5.0, spec_rate=0.01, plain_rate=0.02)  # at this load speculation wins: back on
    assert switch.on
    pending = switch._next_probe
    switch.note_load(0.5)  # speculating: less load cannot make it lose (the wait starts over)
    clock.t += 2 * switch.settings.interval_s
    switch.note_load(0.5)
    assert switch._next_probe == max(pending, clock.t + switch._interval) > clock.t
    switch.note_load(4.0)  # but more load can: re-measure, from the safe side (off until speculation wins again)
    clock.t += switch.settings.interval_s
    switch.note_load(4.0)
    assert switch._next_probe <= clock.t and not switch.on
    _drive_streams(switch, clock, 5.0, 4, spec_round=0.04, plain_round=0.02, rng=rng)  # still wins at 4: back on
    assert switch.on


def test_a_probe_without_figures_for_both_modes_is_no_verdict_and_turns_speculation_off():
    clock = _Clock()
    switch = SpeculationSwitch(clock=clock)
    assert switch.allow() is True
    clock.t = switch._next_probe
    assert switch.allow() is True, "no probe before the current mode has been measured"
    while switch._probe_until is None:
        _drive(switch, clock, 0.01, spec_rate=0.01, plain_rate=0.02)  # a round at a time
    assert switch.allow() is False  # probing plain decoding ...
    for _ in range(3):  # ... but no plain round ends during the probe and its two extensions
        clock.t = switch._probe_until + 0.01
        switch.allow()
    assert switch._probe_until is None, "decided"
    # No verdict: off (never slower than itself) until a probe says otherwise, probing again soon, not backing off.
    assert not switch.on and switch._interval == switch.settings.interval_s
    probed = clock.t - switch._probe_started
    assert (
        switch._next_probe - clock.t
        <= max(switch.settings.interval_s, probed * (1 / switch.settings.max_probe_share - 1)) + 1e-9
    )


def _drive_streams(switch, clock, seconds, streams, spec_round, plain_round, rng) -> float:
    """`streams` concurrent requests, each running rounds back to back: a speculating round commits 4 tokens in
    `spec_round` seconds (or `spec_round(seconds speculating since speculation was last turned on)`), a plain one 1
    token in `plain_round`, each duration jittered +-50% (rounds of one batch end at different times). Events in time
    order; the switch decides each round's mode when it starts. Returns the share of request-time spent
    speculating."""
    events = [(clock.t, s, None, 0.0) for s in range(streams)]  # (end, stream, mode of the ending round, duration)
    spec_time = total = 0.0
    end = clock.t + seconds
    spec_since, last_mode = clock.t, None
    while events:
        t, s, mode, duration = heapq.heappop(events)
        clock.t = t
        if mode is not None:
            switch.observe(4 if mode else 1, duration, mode)
            spec_time += duration if mode else 0.0
            total += duration
        if t < end:
            mode = switch.allow()
            if mode and not last_mode:
                spec_since = t
            last_mode = mode
            spec = spec_round(t - spec_since) if callable(spec_round) else spec_round
            duration = (spec if mode else plain_round) * rng.uniform(0.5, 1.5)
            heapq.heappush(events, (t + duration, s, mode, duration))
    return spec_time / total


def test_windows_measure_many_concurrent_streams_without_bias():
    rng = random.Random(0)
    # 16 streams: speculation 4 tokens per 0.4 s round (10 tok/s per stream), plain 1 token per 0.07 s (14.3 tok/s):
    # speculation is 0.7x. A window opened at whichever round ends first, with rounds of unequal length, measured
    # speculation ~20% faster than it is and turned it on.
    for _ in range(3):
        clock = _Clock()
        switch = SpeculationSwitch(clock=clock)
        switch.note_load(16.0)
        _drive_streams(switch, clock, 20.0, 16, spec_round=0.4, plain_round=0.07, rng=rng)
        assert not switch.on
        assert switch.last_measured_speedup == pytest.approx(0.7, rel=0.1)
    share = _drive_streams(switch, clock, 120.0, 16, spec_round=0.4, plain_round=0.07, rng=rng)
    assert share < 0.1  # settled: rare, bounded probes of the losing mode


def test_probes_take_a_bounded_share_of_the_time():
    clock = _Clock()
    switch = SpeculationSwitch(clock=clock)
    rounds = _drive(switch, clock, 30.0, spec_rate=0.01, plain_rate=0.02)  # plain loses: probed, never kept
    probe_time = sum(d for s, d in rounds if not s)
    assert switch.on and 0 < probe_time <= switch.settings.max_probe_share * 30.0 * 1.1


def test_probes_of_a_clearly_losing_mode_cost_a_bounded_share_of_throughput():
    rng = random.Random(1)
    clock = _Clock()
    switch = SpeculationSwitch(clock=clock)
    switch.note_load(16.0)
    # 16 streams, speculation half as fast as plain decoding (4 tokens per 0.28 s round vs 1 per 0.035 s).
    _drive_streams(switch, clock, 20.0, 16, spec_round=0.28, plain_round=0.035, rng=rng)
    assert not switch.on and switch.last_measured_speedup == pytest.approx(0.5, rel=0.1)
    share = _drive_streams(switch, clock, 60.0, 16, spec_round=0.28, plain_round=0.035, rng=rng)
    # Time share alone (<= 10%) let probes cost 4% of throughput here (measured); their measured cost bounds them.
    assert 0 < share * (1 - 0.5) <= switch.settings.max_probe_cost * 1.25


def test_every_round_of_a_request_counts_for_its_mode_its_first_too():
    clock = _Clock()
    control = SpeculationControl(switch=SpeculationSwitch(clock=clock))
    assert control.switch.allow()
    clock.t += 1.0
    control.after_round(drafted=4, accepted=4, committed=5, seconds=0.5)  # prefill on both workers, then a round
    clock.t += 0.1
    control.after_round(drafted=4, accepted=4, committed=5, seconds=0.1)
    # Speculation's prefill on the draft worker is its own cost: the rate includes it (0.6 s for 10 tokens).
    assert control.switch.spec_s_per_token == pytest.approx(0.06)
    assert control.acceptance.estimate() is not None


def test_a_probe_measures_the_probed_mode_once_it_has_settled():
    # 16 speculating streams start in step (all drafting, then all verifying, in full batches) and drift apart over
    # a few seconds into groups that alternate between the workers: measured on 2 shared cores, k = 4 ran as fast as
    # plain decoding for its first 2-4 s and ~0.65x after. Here: 1.2x at first, down to 0.6x after 6 s.
    def spec_round(since: float) -> float:
        speed = 1.2 - 0.6 * min(1.0, since / 6.0)  # over plain decoding
        return 4 * 0.07 / speed

    for seed in range(3):
        rng = random.Random(seed)
        clock = _Clock()
        switch = SpeculationSwitch(clock=clock, on=False)
        switch.note_load(16.0)
        _drive_streams(switch, clock, 20.0, 16, spec_round=spec_round, plain_round=0.07, rng=rng)
        # Its first seconds alone measured speculation 1.0-1.1x, and turned it on for 30 s for one of these seeds
        assert not switch.on
        assert switch.last_measured_speedup < 0.85


def test_windows_and_probes_span_two_request_durations():
    # Under load, streams finish and prefill together: throughput dips once per request duration, so a window
    # shorter than a couple of them measures where it fell in that cycle.
    clock = _Clock()
    switch = SpeculationSwitch(clock=clock)
    switch.note_load(16.0)
    for _ in range(20):
        switch.request_finished(3.0)
    rng = random.Random(0)
    probes = []
    while not probes:
        _drive_streams(switch, clock, 0.05, 16, spec_round=0.2, plain_round=0.07, rng=rng)
        if switch._probe_until is not None:
            probes.append((clock.t, switch._probe_until - clock.t))
    started, length = probes[0]
    assert started >= 2 * 3.0 and length >= 2 * 3.0
    assert switch.settings.window_requests * 3.0 <= switch.measurements.expected_probe_s(False)


def test_a_near_tie_goes_to_plain_decoding():
    clock = _Clock()
    switch = SpeculationSwitch(clock=clock, on=False)
    _drive(switch, clock, 30.0, spec_rate=0.02 / 1.06, plain_rate=0.02)  # speculation 6% faster: not worth it
    assert not switch.on and switch.last_measured_speedup == pytest.approx(1.06, rel=0.01)
    _drive(switch, clock, 150.0, spec_rate=0.02 / 1.2, plain_rate=0.02)  # 20% faster: on
    assert switch.on
    _drive(switch, clock, 150.0, spec_rate=0.02 / 0.95, plain_rate=0.02)  # 5% slower: off again
    assert not switch.on


def test_a_verdict_keeps_flips_waits_for_confirmation_or_is_no_verdict():
    settings = SwitchSettings()
    loads = (4.0, 4.0)

    def verdict(on, s, final=False, loads=loads, both=True):
        return judge(settings, on, final, s, loads, both, interval_s=4.0, least_s=1.0)

    kept = verdict(True, 1.5)  # speculation wins: kept, and the next probe backs off (twice the interval)
    assert kept.on and kept.speedup == 1.5 and kept.interval_s == kept.wait_s == 8.0
    assert not verdict(True, 0.9).on and verdict(True, 0.9).interval_s == settings.interval_s  # loses: off
    assert verdict(True, 0.98).on  # within the margin: no flapping
    assert not verdict(False, 1.06).on  # a near tie goes to plain decoding (margin_on > margin)
    pending = verdict(False, 1.5)  # winning while off: only once plain decoding is measured again
    assert pending.pending and not pending.on and pending.interval_s == 4.0
    assert verdict(False, 1.5, final=True).on
    apart = verdict(True, 0.5, loads=(2.0, 8.0))  # measured at different loads: nothing judged, the mode stays
    assert not apart.comparable and apart.on and apart.speedup is None and apart.interval_s == 4.0
    thin = verdict(True, 1.5, both=False)  # too few rounds of a mode: off until a verdict
    assert not thin.on and thin.speedup is None and thin.comparable


def test_probes_of_the_slower_mode_wait_long_enough_to_cost_little():
    settings = SwitchSettings()
    close = judge(settings, True, False, 1.2, (1.0, 1.0), True, 1.0, 0.0)
    clear = judge(settings, True, False, 3.0, (1.0, 1.0), True, 1.0, 0.0)
    # a 1 s probe of plain decoding loses 1 - 1/s of throughput while it runs: <= max_probe_cost on average
    assert next_probe_wait(settings, close, 0.0, 1.0) == pytest.approx((1 - 1 / 1.2) / settings.max_probe_cost)
    assert next_probe_wait(settings, clear, 0.0, 1.0) == pytest.approx((1 - 1 / 3.0) / settings.max_probe_cost)
    assert next_probe_wait(settings, clear, 0.0, 10.0) == settings.max_interval_s  # capped
    assert next_probe_wait(settings, clear, 200.0, 1.0) == settings.max_interval_s  # the cap holds for the share too
    assert least_wait(settings, 1.0) == pytest.approx(1 / settings.max_probe_share - 1)
