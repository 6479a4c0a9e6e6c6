"""Wire encoding of draft distributions: sparse support (int32 indices) + float16 probabilities, in msgpack.

A draft worker must sample from exactly the distribution the verifier will see, or rejection sampling is no longer
lossless. So the sparse, half-precision form is not a lossy afterthought: `sparsify` builds it first as draft probs
that float16 represents exactly (truncated, not renormalised), the drafter samples from them (argmax(q / E) is
scale-free), they travel as they are, and both sides normalise them with the same `normalise`.

Also the EAGLE-3 features a target hands to a head, as the float16 `FeatureBlock` of wire_format.py. This module is
the tensor side of the wire (torch <-> bytes); wire_format.py the torch-free side the scheduler reads.
"""

from __future__ import annotations

import msgpack
import numpy as np
import torch

from specserve.protos.wire import MAX_FEATURE_BYTES
from specserve.workers.speculation.wire_format import FeatureBlock


def sparsify(probs: torch.Tensor, max_support: int = 256, min_mass: float = 0.999) -> torch.Tensor:
    """The draft probs a drafter samples from and ships: [V] probabilities -> [V] float32, truncated and not
    renormalised.

    Keeps the most likely tokens until `min_mass` is covered (at most `max_support` of them) and rounds them to
    float16, so that encode -> decode reproduces them exactly. max_support 256 keeps a k=4 round under 8 KB.
    """
    # The top max_support only: sorting the whole vocabulary (49K for SmolLM2) cost more than the head's step.
    values, order = torch.topk(probs.float(), min(max_support, probs.shape[-1]))
    mass_before = values.cumsum(0) - values
    keep = max(int((mass_before < min_mass).sum()), 1)
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


# --- EAGLE-3 features -------------------------------------------------------------------------------------------
# The target's features of committed positions travel target -> scheduler -> draft worker as float16 (the head only
# drafts from them: rounding changes proposals, never outputs). The scheduler cuts and joins blocks as bytes.

_FP16_MAX = 65504.0


def feature_block(start: int, features: torch.Tensor, max_bytes: int | None = None) -> FeatureBlock | None:
    """features [m, F] of positions start..start+m-1 -> their float16 block, the newest positions that fit
    `max_bytes` (default MAX_FEATURE_BYTES; values beyond float16's range are clamped, NaN sent as 0); None when
    m = 0."""
    if features.shape[0] == 0:
        return None
    keep = max(1, (MAX_FEATURE_BYTES if max_bytes is None else max_bytes) // (2 * features.shape[1]))
    dropped = max(0, features.shape[0] - keep)  # the oldest positions, beyond the byte limit
    half = torch.nan_to_num(features[dropped:].detach().float(), nan=0.0, posinf=_FP16_MAX, neginf=-_FP16_MAX)
    half = half.clamp(-_FP16_MAX, _FP16_MAX).to(torch.float16).cpu().contiguous()
    rows, cols = half.shape
    return FeatureBlock(start + dropped, rows, cols, half.numpy().astype("<f2").tobytes())


def encode_features(start: int, features: torch.Tensor, max_bytes: int | None = None) -> bytes:
    """`feature_block` as msgpack bytes; b"" when there are none."""
    block = feature_block(start, features, max_bytes)
    return block.encode() if block is not None else b""
