"""A target worker's pass cost with a prompt's chunk in it (cluster/scheduling/pass_cost.py): a fixed part, a part per
position and a part per key the chunk attends over, fitted from its passes; terms the passes cannot tell apart are
dropped, and a disturbed pass counts at most CLIP off the fit."""

import pytest

from specserve.cluster.scheduling.pass_cost import CLIP, PassCost, attended


def _true(chunk: int, depth: int, positions: int) -> float:
    return 0.05 + 0.003 * positions + 0.0011 * attended(chunk, depth)


def test_passes_of_several_sizes_and_depths_give_back_each_part():
    cost = PassCost()
    for i, (chunk, depth, others) in enumerate([(64, 0, 8), (128, 64, 4), (40, 192, 50), (90, 232, 8), (60, 322, 12),
                                                (120, 382, 8), (30, 502, 60), (75, 532, 8)]):  # fmt: skip
        cost.add(chunk, depth, chunk + others, _true(chunk, depth, chunk + others))
        assert (cost.coef is None) == (i < 2)
    assert cost.coef == pytest.approx((0.05, 0.003, 0.0011), rel=1e-6)
    assert cost.chunk_seconds(64, 3000) == pytest.approx(0.003 * 64 + 0.0011 * attended(64, 3000))
    seconds = cost.chunk_seconds(77, 2500)
    assert cost.chunk_for(seconds, 2500) == pytest.approx(77)  # the inverse: deep, fewer positions for the same time
    assert cost.chunk_for(seconds, 100) > 120


def test_one_size_at_growing_depths_fits_what_it_can_tell():
    """A prompt prefilled alone: every chunk 256, every pass 256 positions. The part per position and the fixed part
    cannot be told apart (the fit drops one); what a pass of that size costs at each depth still comes out right."""
    cost = PassCost()
    for depth in range(0, 4096, 256):
        cost.add(256, depth, 256, _true(256, depth, 256))
    assert cost.coef is not None
    fixed, per, per_key = cost.coef
    for depth in (1000, 3500):
        predicted = fixed + per * 256 + per_key * attended(256, depth)
        assert predicted == pytest.approx(_true(256, depth, 256), rel=1e-6)


def test_a_disturbed_pass_counts_at_most_clip_off_the_fit():
    cost = PassCost()
    shapes = [(64, 0, 72), (128, 64, 132), (40, 192, 90), (90, 232, 98), (60, 322, 72), (120, 382, 128)]
    for chunk, depth, positions in shapes:
        cost.add(chunk, depth, positions, _true(chunk, depth, positions))
    cost.add(70, 502, 78, 10 * _true(70, 502, 78))  # another process had the core
    predicted = cost.coef[0] + cost.coef[1] * 78 + cost.coef[2] * attended(70, 502)
    assert predicted < 1.3 * _true(70, 502, 78) and CLIP <= 2.0  # unclipped: 2.6x
