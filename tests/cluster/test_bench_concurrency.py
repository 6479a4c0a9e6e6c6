"""The concurrency sweep's segment order and on/off statistics alone (the sweep itself runs in
tests/workers/test_demo.py's bench run)."""

import math
import random

import pytest

from specserve.cluster.bench.concurrency import PAIRS, LevelRow, _pairs, _segment_order, ratio_ci95, request_length


@pytest.mark.parametrize("pairs", [4, PAIRS])
def test_segments_alternate_so_that_a_steady_drift_favours_neither_mode(pairs):
    order = _segment_order(pairs)
    assert order[:8] == [False, True, True, False, True, False, False, True]  # off on, on off, on off, off on
    assert all(order[i] != order[i + 1] for i in range(0, len(order), 2))  # every pair has one of each
    on = [i for i, spec in enumerate(order) if spec]
    off = [i for i, spec in enumerate(order) if not spec]
    assert len(on) == len(off) == pairs and sum(on) == sum(off)  # a linear drift in time cancels out
    abab = [spec for _ in range(pairs) for spec in (False, True)]
    assert sum(i for i, spec in enumerate(abab) if spec) > sum(i for i, spec in enumerate(abab) if not spec)


def test_pairs_match_each_on_segment_with_the_off_segment_beside_it():
    order = _segment_order(2)  # off on, on off
    segments = [LevelRow(4, "off", tokens_per_s=1.0), LevelRow(4, "on", tokens_per_s=2.0),
                LevelRow(4, "on", tokens_per_s=3.0), LevelRow(4, "off", tokens_per_s=4.0)]  # fmt: skip
    assert [(on.tokens_per_s, off.tokens_per_s) for on, off in _pairs(segments, order)] == [(2.0, 1.0), (3.0, 4.0)]


def test_ratio_interval_covers_the_true_ratio_about_95_percent_of_the_time():
    rng = random.Random(0)
    covered, trials = 0, 2000
    for _ in range(trials):  # each pair: the true ratio 0.9 times log-normal noise of 10%
        lo, hi = ratio_ci95([0.9 * math.exp(rng.gauss(0.0, 0.1)) for _ in range(PAIRS)])
        covered += lo <= 0.9 <= hi
    assert 0.93 <= covered / trials <= 0.97
    lo, hi = ratio_ci95([0.95, 1.05, 1.0, 1.0])
    assert lo < 1.0 < hi and math.sqrt(lo * hi) == pytest.approx((0.95 * 1.05) ** 0.25)  # around the geometric mean
    assert ratio_ci95([0.8, 0.82, 0.79, 0.81])[1] < 1.0  # consistently slower: the interval excludes a tie
    assert ratio_ci95([1.2]) is None  # one pair: no spread to judge by


def test_requests_differ_in_length_around_the_mean_and_each_mode_gets_the_same_ones():
    lengths = [request_length(i, 32) for i in range(2000)]
    assert min(lengths) == 16 and max(lengths) == 48  # half to one and a half times the mean, ends included
    assert abs(sum(lengths) / len(lengths) - 32) < 1
    assert len(set(lengths[:16])) >= 8  # the streams' first requests do not end together
    assert lengths == [request_length(i, 32) for i in range(2000)]  # fixed per request index
    assert request_length(5, 1) == 1
