"""Synthetic verify cost surfaces for the goodput planner's tests: a CPU's and a GPU's shapes, from this project's
measurements (SmolLM2-135M on 2 cores: 58 64 62 65 69 70 74 74 78 ms for 1..9 positions, 4 plain rows 1.5x one
row) and the usual GPU shape (flat until the batch's tokens fill the chip, then linear)."""

from __future__ import annotations

from specserve.workers.speculation.planner.costs import PROFILE_ROWS, VerifySurface

WIDTHS = 17
CPU_ONE_ROW_MS = (58, 64, 62, 65, 69, 70, 74, 74, 78)  # 1..9 positions, then +1 ms a position


def cpu_seconds(rows: int, width: int) -> float:
    """A CPU: one row's measured shape (a bump at width 2), each further row 0.16 of a step plus its positions."""
    one = CPU_ONE_ROW_MS[width - 1] if width <= len(CPU_ONE_ROW_MS) else CPU_ONE_ROW_MS[-1] + width - 9
    return (one + (rows - 1) * (9.5 + 2.5 * width)) / 1e3


def gpu_seconds(rows: int, width: int, knee_tokens: int = 64) -> float:
    """A GPU: 20 ms a forward until rows x width passes the knee, then linear in the tokens."""
    return 0.02 * max(1.0, rows * width / knee_tokens)


def surface(seconds, rows=PROFILE_ROWS, widths: int = WIDTHS) -> VerifySurface:
    return VerifySurface(tuple(rows), tuple(tuple(seconds(r, w) for w in range(1, widths + 1)) for r in rows))


def cpu_surface() -> VerifySurface:
    return surface(cpu_seconds)


def gpu_surface() -> VerifySurface:
    return surface(gpu_seconds)
