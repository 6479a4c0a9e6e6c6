import pytest

from specserve.workers.speculation.leviathan import (
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
