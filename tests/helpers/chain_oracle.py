"""The chain planner's oracle for one drafter (tests only): the k of largest R(k), by exhaustive search over widths,
which `goodput.choose_row` must agree with where one drafter and one row are planned."""

from collections.abc import Sequence

from specserve.workers.speculation.planner.acceptance import expected_accepted
from specserve.workers.speculation.planner.costs import DraftCost, VerifyCosts


def round_rate(rates: Sequence[float], k: int, costs: VerifyCosts, draft: DraftCost) -> float:
    """R(k): committed tokens per second of rounds drafting k."""
    return (1.0 + expected_accepted(rates, k)) / (draft.of(k) + costs.verify(k))


def best_k(rates: Sequence[float], costs: VerifyCosts, draft: DraftCost, max_k: int, min_k: int = 0) -> int:
    """The k in min_k..max_k (within the measured widths and the rates given) with the largest R(k); 0 means "do
    not draft this round"."""
    top = max(min_k, min(max_k, costs.max_k, len(rates)))
    return max(range(min_k, top + 1), key=lambda k: round_rate(rates, k, costs, draft))
