"""Acceptance by chain position (workers/speculation/planner/acceptance.py): what a chain is expected to accept, and
counts over rounds on top of a prior."""

import pytest

from specserve.workers.speculation.planner.acceptance import PositionAcceptance, expected_accepted


def test_expected_accepted_multiplies_conditional_rates():
    assert expected_accepted([0.5, 0.5, 0.5], 3) == pytest.approx(0.5 + 0.25 + 0.125)
    assert expected_accepted([0.9, 0.0, 1.0], 3) == pytest.approx(0.9)
    assert expected_accepted([0.5, 0.5], 0) == 0.0


def test_position_acceptance_counts_reach_and_starts_from_the_prior():
    stats = PositionAcceptance(prior=(0.5, 0.2), prior_weight=2.0)
    assert stats.rates(3) == [0.5, 0.2, 0.2]
    stats.observe(drafted=4, accepted=1)  # position 0 accepted, 1 rejected, 2-3 never reached
    stats.observe(drafted=4, accepted=4)
    assert stats.reached == [2, 2, 1, 1] and stats.accepted == [2, 1, 1, 1]
    assert stats.rates(2) == pytest.approx([(2 + 1.0) / 4, (1 + 0.4) / 4])
