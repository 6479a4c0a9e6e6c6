"""A greedy row's outputs against target-only's (cluster/bench/runner.py): identical, and the share of prompts that
were, which bf16 on a GPU needs (not batch-invariant: a near-tie may flip)."""

from specserve.cluster.bench.rows import Row
from specserve.cluster.bench.runner import _fill_speedups  # rows.compare_outputs, as the bench calls it


def _row(name: str, method: str, outputs: list[list[int]]) -> Row:
    row = Row(name, method, None, 0.0)
    row.tokens_per_s, row.outputs = 10.0, outputs
    return row


def test_a_greedy_row_reports_whether_and_how_often_it_matched_target_only():
    base = _row("target-only greedy", "target-only", [[1, 2], [3, 4], [5, 6], [7, 8]])
    same = _row("a", "ngram", [[1, 2], [3, 4], [5, 6], [7, 8]])
    flipped = _row("b", "eagle", [[1, 2], [3, 9], [5, 6], [7, 8]])
    _fill_speedups([base, same, flipped])
    assert (same.identical, same.identical_share) == (True, 1.0)
    assert (flipped.identical, flipped.identical_share) == (False, 0.75)
    assert base.identical is None and base.identical_share is None
