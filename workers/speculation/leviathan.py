"""Leviathan et al.'s speculation math, for the benchmark's bound: expected tokens per round and speedup under one
acceptance rate for every position, and that rate fitted to a measured tokens per round. (What k to draft is the
goodput planner's, planner/goodput.py, from acceptance per position and measured costs.)"""

from __future__ import annotations


def expected_tokens_per_round(a: float, k: float) -> float:
    """E[tokens committed per round] when each drafted token is accepted with probability a: (1 - a^(k+1)) / (1 - a)."""
    if a >= 1.0:
        return k + 1.0
    return (1.0 - a ** (k + 1)) / (1.0 - a)


def leviathan_speedup(a: float, k: float, c: float) -> float:
    """S(k) = (1 - a^(k+1)) / ((1 - a)(k c + 1)): expected speedup with cost ratio c = t_draft / t_target."""
    return expected_tokens_per_round(a, k) / (k * c + 1.0)


def fit_acceptance(tokens_per_round: float, k: float) -> float:
    """The per-position acceptance a whose expected tokens per round at this k equal the measured figure."""
    if k <= 0 or tokens_per_round <= 1.0:
        return 0.0
    if tokens_per_round >= k + 1:
        return 1.0
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if expected_tokens_per_round(mid, k) < tokens_per_round:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2
