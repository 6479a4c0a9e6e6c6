"""Wire encoding of draft distributions: sparse support (int32 indices) + float16 probabilities, in msgpack.

A draft worker must sample from exactly the distribution the verifier will see, or rejection sampling is no longer
lossless. So the sparse, half-precision form is not a lossy afterthought: `sparsify` builds it first as draft probs
that float16 represents exactly (truncated, not renormalised), the drafter samples from them (argmax(q / E) is
scale-free), they travel as they are, and both sides normalise them with the same `normalise`.
"""

from __future__ import annotations

import msgpack
import numpy as np
import torch


def sparsify(probs: torch.Tensor, max_support: int = 256, min_mass: float = 0.999) -> torch.Tensor:
    """The draft probs a drafter samples from and ships: [V] probabilities -> [V] float32, truncated and not
    renormalised.

    Keeps the most likely tokens until `min_mass` is covered (at most `max_support` of them) and rounds them to
    float16, so that encode -> decode reproduces them exactly. max_support 256 keeps a k=4 round under 8 KB.
    """
    values, order = torch.sort(probs.float(), descending=True)
    mass_before = values.cumsum(0) - values
    keep = int(min(max_support, int((mass_before < min_mass).sum())))
    keep = max(keep, 1)
    half = values[:keep].half().float()
    if float(half.sum()) == 0.0:  # everything underflowed: keep the top token
        half[0] = 1.0
    out = torch.zeros_like(probs, dtype=torch.float32)
    out[order[:keep]] = half
    return out


def normalise(probs: torch.Tensor) -> torch.Tensor:
    """[..., V] truncated (unnormalised) probs -> distributions that sum to 1."""
    return probs / probs.sum(-1, keepdim=True)


def encode_probs(probs: torch.Tensor | None) -> bytes:
    """[k, V] sparse float16-exact probs (as made by `sparsify`) -> msgpack bytes; b"" for None (one-hot)."""
    if probs is None:
        return b""
    rows = []
    for row in probs.float().cpu():
        idx = torch.nonzero(row, as_tuple=False).flatten()
        rows.append([idx.numpy().astype("<i4").tobytes(), row[idx].numpy().astype("<f2").tobytes()])
    return msgpack.packb(rows, use_bin_type=True)


def decode_probs(data: bytes, vocab_size: int) -> torch.Tensor | None:
    """msgpack bytes -> [k, V] float32 probs, exactly as encoded; None for b"" (one-hot proposals)."""
    if not data:
        return None
    rows = msgpack.unpackb(data, raw=False)
    out = torch.zeros(len(rows), vocab_size, dtype=torch.float32)
    for i, (idx_bytes, prob_bytes) in enumerate(rows):
        idx = torch.from_numpy(np.frombuffer(idx_bytes, dtype="<i4").astype(np.int64))
        if len(idx) and (int(idx.max()) >= vocab_size or int(idx.min()) < 0):
            raise ValueError(f"draft distribution index out of range for vocabulary of {vocab_size}")
        out[i, idx] = torch.from_numpy(np.frombuffer(prob_bytes, dtype="<f2").astype(np.float32))
    return out


def slice_rows(data: bytes, start: int, stop: int) -> bytes:
    """Encoded probs of rows start..stop-1, without decoding them (b"" stays b"": one-hot proposals)."""
    if not data:
        return b""
    rows = msgpack.unpackb(data, raw=False)[start:stop]
    return msgpack.packb(rows, use_bin_type=True) if rows else b""
