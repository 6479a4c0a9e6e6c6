import msgpack
import pytest
import torch

from specserve.workers.speculation.codec import decode_probs, encode_probs, normalise, sparsify
from specserve.workers.speculation.wire_format import slice_rows


def _dist(V, seed, temperature=1.0):
    return torch.softmax(torch.randn(V, generator=torch.Generator().manual_seed(seed)) * 3 / temperature, -1)


def test_round_trip_is_exact():
    probs = torch.stack([sparsify(_dist(4096, s)) for s in range(4)])  # [4, V]
    decoded = decode_probs(encode_probs(probs), 4096)
    assert torch.equal(decoded, probs)
    assert torch.equal(normalise(decoded), normalise(probs))


def test_round_at_k4_fits_in_8kb_even_for_flat_distributions():
    flat = torch.full((4096,), 1 / 4096)
    probs = torch.stack([sparsify(flat) for _ in range(4)])
    assert len(encode_probs(probs)) <= 8 * 1024


def test_sparsify_keeps_the_high_mass_support():
    p = torch.tensor([0.6, 0.3, 0.0995, 0.0005])
    w = sparsify(p, min_mass=0.999)
    assert (w > 0).tolist() == [True, True, True, False]
    q = normalise(w)
    assert torch.allclose(q[:3], p[:3] / p[:3].sum(), atol=1e-3)
    assert (sparsify(p, max_support=1) > 0).sum() == 1


def test_one_hot_proposals_encode_to_nothing():
    assert encode_probs(None) == b""
    assert decode_probs(b"", 10) is None


def test_out_of_range_index_is_rejected():
    bad = msgpack.packb([[torch.tensor([12], dtype=torch.int32).numpy().tobytes(), b"\x00\x3c"]])
    with pytest.raises(ValueError, match="out of range"):
        decode_probs(bad, 10)


def test_slice_rows_matches_slicing_decoded_rows():
    probs = torch.stack([sparsify(_dist(300, s)) for s in range(4)])
    data = encode_probs(probs)
    assert torch.equal(decode_probs(slice_rows(data, 1, 3), 300), probs[1:3])
    assert slice_rows(data, 4, 6) == b"" and slice_rows(b"", 0, 2) == b""
