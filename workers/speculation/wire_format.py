"""The wire forms as bytes, torch-free: what the scheduler handles without decoding to tensors.

Encoded draft-probability rows (codec.py's `encode_probs`: msgpack rows of int32 indices and float16 values) are
sliced as they are; the EAGLE-3 features of committed positions travel target -> scheduler -> draft worker as a
`FeatureBlock` (float16 rows; the head only drafts from them: rounding changes proposals, never outputs), which the
scheduler cuts and joins as bytes and every receiver decodes strictly. codec.py is the tensor side.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import msgpack
import numpy as np

from specserve.workers.errors import InvalidRequestError

if TYPE_CHECKING:
    import torch


def slice_rows(data: bytes, start: int, stop: int) -> bytes:
    """Encoded probs of rows start..stop-1, without decoding them (b"" stays b"": one-hot proposals)."""
    if not data:
        return b""
    rows = msgpack.unpackb(data, raw=False)[start:stop]
    return msgpack.packb(rows, use_bin_type=True) if rows else b""


_FEATURE_KEYS = {"start", "rows", "cols", "data"}


@dataclass(frozen=True)
class FeatureBlock:
    """Features of positions start..start+rows-1: rows x cols float16, little-endian, row-major, as they travel."""

    start: int
    rows: int
    cols: int
    data: bytes = field(repr=False)

    @property
    def end(self) -> int:
        return self.start + self.rows

    def _rows(self, first: int, stop: int) -> FeatureBlock:
        """Rows first..stop-1 (indices into this block)."""
        row = 2 * self.cols
        return FeatureBlock(self.start + first, stop - first, self.cols, self.data[first * row : stop * row])

    def since(self, position: int) -> FeatureBlock | None:
        """The positions from `position` on (None when none are left)."""
        first = max(0, position - self.start)
        return self._rows(first, self.rows) if first < self.rows else None

    def newest(self, max_bytes: int) -> FeatureBlock:
        """The newest positions whose data fits `max_bytes` (at least one)."""
        keep = max(1, max_bytes // (2 * self.cols))
        return self._rows(self.rows - keep, self.rows) if keep < self.rows else self

    def then(self, later: FeatureBlock) -> FeatureBlock:
        """These positions up to `later.start`, then `later`'s (which replace any they overlap). `later` must start
        no later than this block ends."""
        if later.cols != self.cols or later.start > self.end:
            raise ValueError(f"cannot join features {later.start}.. ({later.cols} wide) after {self.start}..{self.end}")
        if later.start <= self.start:
            return later
        head = self._rows(0, later.start - self.start)
        return FeatureBlock(self.start, head.rows + later.rows, self.cols, head.data + later.data)

    def to_tensor(self) -> torch.Tensor:
        """[rows, cols] float32 (the draft worker's: torch is imported here, not by the scheduler)."""
        import torch

        array = np.frombuffer(self.data, dtype="<f2").reshape(self.rows, self.cols)
        return torch.from_numpy(array.astype(np.float32))

    def encode(self) -> bytes:
        return msgpack.packb(
            {"start": self.start, "rows": self.rows, "cols": self.cols, "data": self.data}, use_bin_type=True
        )


def decode_features(data: bytes, cols: int | None = None) -> FeatureBlock | None:
    """msgpack bytes -> the FeatureBlock, checked strictly (None for b""): a map of exactly start, rows, cols, data;
    rows x cols float16 values, all finite; `cols` as given when given. InvalidRequestError naming `features`."""
    if not data:
        return None
    try:
        value = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except (ValueError, TypeError, msgpack.UnpackException) as e:
        raise InvalidRequestError("features", f"is not msgpack ({type(e).__name__}: {e})") from None
    if not isinstance(value, dict) or set(value) != _FEATURE_KEYS:
        raise InvalidRequestError("features", f"must be a map of exactly {sorted(_FEATURE_KEYS)}")
    start, rows, width, raw = (value[k] for k in ("start", "rows", "cols", "data"))
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in (start, rows, width)) or not isinstance(
        raw, bytes
    ):
        raise InvalidRequestError("features", "start, rows and cols must be integers and data bytes")
    if start < 0 or rows < 1 or width < 1:
        raise InvalidRequestError("features", f"start {start} must be >= 0, rows {rows} and cols {width} >= 1")
    if cols is not None and width != cols:
        raise InvalidRequestError("features", f"{width} values per position, this head reads {cols}")
    if len(raw) != 2 * rows * width:
        raise InvalidRequestError("features", f"{len(raw)} bytes of data for {rows} x {width} float16 values")
    if not np.isfinite(np.frombuffer(raw, dtype="<f2")).all():
        raise InvalidRequestError("features", "has values that are not finite")
    return FeatureBlock(start, rows, width, raw)
