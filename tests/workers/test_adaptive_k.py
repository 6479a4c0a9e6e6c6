import pytest

from specserve.workers.speculation.adaptive_k import (
    AdaptiveK,
    expected_tokens_per_round,
    fit_acceptance,
    leviathan_speedup,
)


def test_expected_tokens_per_round_limits():
    assert expected_tokens_per_round(0.0, 4) == 1.0
    assert expected_tokens_per_round(1.0, 4) == 5.0
    assert expected_tokens_per_round(0.5, 2) == pytest.approx(1 + 0.5 + 0.25)


def test_leviathan_speedup_matches_paper_formula():
    a, k, c = 0.8, 4, 0.05
    assert leviathan_speedup(a, k, c) == pytest.approx((1 - a ** (k + 1)) / ((1 - a) * (k * c + 1)))


@pytest.mark.parametrize("a", [0.1, 0.5, 0.73, 0.95])
@pytest.mark.parametrize("k", [1, 4, 6])
def test_fit_acceptance_inverts_expected_tokens(a, k):
    assert fit_acceptance(expected_tokens_per_round(a, k), k) == pytest.approx(a, abs=1e-6)


def test_adaptive_k_grows_with_high_acceptance_and_shrinks_with_low():
    high = AdaptiveK(cost_ratio=0.05, k=4)
    for _ in range(50):
        k = high.observe(drafted=high.k, accepted=high.k)  # everything accepted
    assert k > 4
    low = AdaptiveK(cost_ratio=0.3, k=4)
    for _ in range(50):
        k = low.observe(drafted=low.k, accepted=0)
    assert k == 1


def test_adaptive_k_is_stable_near_a_tie():
    ctl = AdaptiveK(cost_ratio=0.1, k=4)
    ks = set()
    for i in range(200):  # acceptance hovering around 0.7
        ks.add(ctl.observe(drafted=ctl.k, accepted=ctl.k if i % 10 < 7 else ctl.k // 2))
    assert len(ks) <= 3
