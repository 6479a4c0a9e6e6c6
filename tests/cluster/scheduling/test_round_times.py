"""The served round's accounting (round_times.py): a round's wall time split into the scheduler's own work, the
draft and verify hops (the worker's queue and compute, the rest of the call) and the stream back; the records'
percentiles and the running sums the load bench takes differences of."""

import pytest

from specserve.cluster.scheduling import round_times
from specserve.cluster.scheduling.round_times import PARTS, RoundClock, RoundRecord, RoundTimes, per_round_ms
from specserve.workers.service.results import ProposeResult, VerifyResult


class _Time:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _round(monkeypatch, now: _Time) -> RoundRecord:
    """A round of 30 ms: 2 ms planning, a 9 ms draft call (the worker queued it 1 ms and drafted 5), 2 ms more
    planning, a 14 ms verify call (2 ms queued, 8 ms forward), then 3 ms on its way to the client."""
    monkeypatch.setattr(round_times.time, "perf_counter", now)
    clock = RoundClock()
    clock.planned(3, 1.5, 0.025)  # k = 3, expecting 1.5 accepted, a 25 ms round
    now.now += 0.002
    with clock.waiting("draft"):
        now.now += 0.009
    clock.worker("draft", ProposeResult([5, 6], batch_seconds=0.005, queued_seconds=0.001))
    now.now += 0.002
    with clock.waiting("verify"):
        now.now += 0.014
    clock.worker("verify", VerifyResult(accepted=1, next_token=7, batch_seconds=0.008, queued_seconds=0.002,
                                        batch_forward_seconds=0.006))  # fmt: skip
    assert clock.verified(2, 1) == pytest.approx(0.027)  # drafted 2 (a shorter chain), accepted 1
    now.now += 0.003
    return clock.record(stream_s=0.003)


def test_a_rounds_wall_time_is_split_into_its_parts(monkeypatch):
    record = _round(monkeypatch, _Time())
    parts = record.parts()
    assert parts["total"] == pytest.approx(0.030)
    assert parts["plan"] == pytest.approx(0.004)  # the scheduler's own: total less the waits and the stream
    assert (parts["draft_queue"], parts["draft_work"], parts["draft_hop"]) == pytest.approx((0.001, 0.005, 0.003))
    assert (parts["verify_queue"], parts["verify_work"], parts["verify_hop"]) == pytest.approx((0.002, 0.008, 0.004))
    assert parts["stream"] == pytest.approx(0.003)
    assert parts["verify_forward"] == pytest.approx(0.006)  # of verify_work: the forward's host time, not a new part
    assert parts["overhead"] == pytest.approx(0.030 - 0.013)  # all but the workers' compute
    split = ("plan", "draft_queue", "draft_work", "draft_hop", "verify_queue", "verify_work", "verify_hop", "stream")
    assert sum(parts[p] for p in split) == pytest.approx(parts["total"])


def test_a_hop_never_goes_negative_when_a_worker_reports_more_than_was_waited(monkeypatch):
    now = _Time()
    monkeypatch.setattr(round_times.time, "perf_counter", now)
    clock = RoundClock()
    with clock.waiting("verify"):
        now.now += 0.001  # a pre-draft's worker ran during the verify: its seconds were not waited for
    clock.worker("verify", VerifyResult(accepted=0, next_token=1, batch_seconds=0.004))
    assert clock.record().verify_hop == 0.0


def test_percentiles_and_sums_over_rounds_and_the_mean_between_two_readings(monkeypatch):
    times, seen = RoundTimes(), []
    times.on_add = seen.append
    now = _Time()
    before = times.summary()
    for _ in range(3):
        times.add(_round(monkeypatch, now))
    after = times.summary()
    assert after["rounds"] == 3 and len(seen) == 3
    assert after["p50_ms"]["verify_work"] == pytest.approx(8.0) and set(after["p90_ms"]) == set(PARTS)
    assert after["sum_s"]["total"] == pytest.approx(0.090)
    assert times.orchestration_s == pytest.approx(0.012)
    means = per_round_ms([(before, after), (after, after)])  # a reading pair with no rounds adds nothing
    assert means["total"] == pytest.approx(30.0) and means["verify_hop"] == pytest.approx(4.0)
    assert per_round_ms([(after, after)]) == {}
    planned = after["plan_vs_round"]  # k='auto''s forecasts against the rounds
    assert planned["rounds"] == 3 and (planned["planned_k"], planned["drafted"]) == (3, 2)
    assert (planned["expected_accepted"], planned["accepted"]) == (1.5, 1)
    assert planned["forecast_ms"] == pytest.approx(25.0) and planned["realized_ms"] == pytest.approx(27.0)
    assert RoundTimes().summary()["plan_vs_round"] == {}
