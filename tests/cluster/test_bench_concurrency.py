"""The concurrency sweep's segment order alone (the sweep itself runs in tests/workers/test_demo.py's bench run)."""

from specserve.cluster.bench_concurrency import SEGMENTS, _segment_order


def test_segments_alternate_so_that_a_steady_drift_favours_neither_mode():
    order = _segment_order(SEGMENTS)
    assert order == [False, True, True, False, True, False, False, True]  # off on, on off, on off, off on
    on = [i for i, spec in enumerate(order) if spec]
    off = [i for i, spec in enumerate(order) if not spec]
    assert len(on) == len(off) == SEGMENTS and sum(on) == sum(off)  # a linear drift in time cancels out
    abab = [spec for _ in range(SEGMENTS) for spec in (False, True)]
    assert sum(i for i, spec in enumerate(abab) if spec) > sum(i for i, spec in enumerate(abab) if not spec)
