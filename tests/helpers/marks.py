"""The fast loop (`pytest -m "not slow"`, under 5 minutes on 2 cores) keeps one or a few cases of each kind; the other
cases of a parametrized test run in the full suite (CI) only."""

import pytest


def slow_unless(cases: list, fast: list) -> list:
    """`cases` for `pytest.mark.parametrize`, each one not in `fast` marked slow (a tuple case: its values)."""
    missing = [c for c in fast if c not in cases]
    assert not missing, f"fast cases not among the cases: {missing}"
    return [c if c in fast else pytest.param(*(c if isinstance(c, tuple) else (c,)), marks=pytest.mark.slow)
            for c in cases]  # fmt: skip
