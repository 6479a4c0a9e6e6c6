"""What a target worker's forward pass costs with a prompt's chunk in it, fitted from the passes its chunks ran in:

    seconds = fixed + per_position * positions + per_key * attended

positions: every position the pass fed (the chunk's, the decoding rows', a new request's prompt); attended: the
chunk's positions times the keys each attends over (its depth in its prompt), in thousands. Deep in a long prompt the
attention is most of a position's cost: SmolLM2-135M on one thread fed a 64-token chunk in 189 ms at depth 100 and
in 392 ms at depth 2,800 (results/2026-11-28-2305-smollm2-long-prompt-beside). Fitted on a chunk's positions alone, a
prompt's growing depth read as a growing fixed part, and a pass that also carried another prompt's rest as dear
positions: chunks halved and doubled, and a second prompt's chunks went to a quarter of their size for 20 chunks.

One fit per worker (a model's cost does not depend on whose chunk it is), by decayed least squares; a pass far off
the fit (another process had the core a moment) counts at most CLIP off it. Until the passes tell every term apart
(too few, or too alike), the fit drops the terms they cannot tell, and keeps the fit before where that explains the
passes better (a pass at depth 0 after 4K positions of another prompt, dropping the keys' term, made the next
chunks 256 deep in the new prompt). Pure and torch-free.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

FIT_DECAY = 0.9  # weight of older passes
CLIP = 1.5  # a pass counts at most this factor off the fit
MIN_PASSES = 3
MIN_PIVOT = 1e-2  # of the scaled normal equations: a term must vary beyond ~10% of what the others explain
# the terms tried: (fixed, per position, per key) kept or dropped
_TERMS = ((True, True, True), (True, True, False), (True, False, True))


def attended(chunk: int, depth: int) -> float:
    """Thousands of keys the chunk's positions attend over, `depth` positions before it."""
    return chunk * (depth + (chunk + 1) / 2) / 1e3


@dataclass
class PassCost:
    xx: list[list[float]] = field(default_factory=lambda: [[0.0] * 3 for _ in range(3)])  # decayed sums of x x^T
    xy: list[float] = field(default_factory=lambda: [0.0] * 3)  # and of x * seconds
    yy: float = 0.0  # and of seconds^2
    passes: int = 0
    coef: tuple[float, float, float] | None = None  # fixed, per position, per thousand keys (None: not fitted)

    def add(self, chunk: int, depth: int, positions: int, seconds: float) -> None:
        """A pass that fed `positions` in all, `chunk` of them a prompt's chunk at `depth`, took `seconds`."""
        x = (1.0, float(positions), attended(chunk, depth))
        if self.coef is not None:
            predicted = _dot(self.coef, x)
            seconds = min(CLIP * predicted, max(predicted / CLIP, seconds))
        self.yy = FIT_DECAY * self.yy + seconds * seconds
        for i in range(3):
            self.xy[i] = FIT_DECAY * self.xy[i] + x[i] * seconds
            for j in range(3):
                self.xx[i][j] = FIT_DECAY * self.xx[i][j] + x[i] * x[j]
        self.passes += 1
        if self.passes < MIN_PASSES:
            return
        # Of the fits the passes can tell (every term, or without one) and the one before, what explains them best: a
        # pass that leaves a term untold then keeps the fit that has it.
        fits = [c for terms in _TERMS if (c := self._solve(terms)) is not None]
        self.coef = min(fits + ([self.coef] if self.coef else []), key=self._residual, default=None)

    def _residual(self, coef: tuple[float, float, float]) -> float:
        """The decayed sum of squared errors of the passes under `coef`."""
        quad = sum(coef[i] * self.xx[i][j] * coef[j] for i in range(3) for j in range(3))
        return self.yy - 2 * _dot(coef, self.xy) + quad

    def _solve(self, terms: tuple[bool, bool, bool]) -> tuple[float, float, float] | None:
        """Least squares over the kept terms; None where the passes do not tell them apart (a pivot of the normal
        equations, scaled to a unit diagonal, under MIN_PIVOT: a term's values within a few percent of another's
        multiple) or a part comes out negative."""
        keep = [i for i in range(3) if terms[i] and self.xx[i][i] > 0]
        if len(keep) < 2 or keep[0] != 0:
            return None
        scale = [math.sqrt(self.xx[i][i]) for i in keep]
        n = len(keep)
        a = [[self.xx[i][j] / (scale[r] * scale[c]) for c, j in enumerate(keep)] + [self.xy[i] / scale[r]]
             for r, i in enumerate(keep)]  # fmt: skip
        for col in range(n):  # Gaussian elimination, the largest pivot first
            pivot = max(range(col, n), key=lambda r: abs(a[r][col]))
            a[col], a[pivot] = a[pivot], a[col]
            if abs(a[col][col]) < MIN_PIVOT:
                return None
            for r in range(n):
                if r != col:
                    f = a[r][col] / a[col][col]
                    a[r] = [v - f * p for v, p in zip(a[r], a[col], strict=True)]
        out = [0.0, 0.0, 0.0]
        for i in range(n):
            out[keep[i]] = a[i][n] / a[i][i] / scale[i]
        if min(out) < 0 or out[1] + out[2] <= 0:  # every part of a pass costs something, or the fit is noise
            return None
        return out[0], out[1], out[2]

    def seconds(self, chunk: int, depth: int, positions: int) -> float | None:
        """A whole pass's seconds (None: not fitted)."""
        return None if self.coef is None else _dot(self.coef, (1.0, float(positions), attended(chunk, depth)))

    def chunk_seconds(self, chunk: int, depth: int) -> float | None:
        """What a chunk's own positions add to a pass (None: not fitted)."""
        if self.coef is None:
            return None
        return self.coef[1] * chunk + self.coef[2] * attended(chunk, depth)

    def chunk_for(self, seconds: float, depth: int) -> float | None:
        """The chunk whose own positions at `depth` add `seconds` (None: not fitted)."""
        if self.coef is None:
            return None
        if seconds <= 0:
            return 0.0
        _, b, c = self.coef
        # b n + c n (depth + (n + 1) / 2) / 1e3 = seconds: a quadratic in n
        p, q = c / 2e3, b + c * (depth + 0.5) / 1e3
        root = q + math.sqrt(q * q + 4 * p * seconds)  # the stable form of the quadratic's root (p may be ~0)
        return 2 * seconds / root if root > 0 else None


def _dot(a, b) -> float:
    return sum(x * y for x, y in zip(a, b, strict=True))
