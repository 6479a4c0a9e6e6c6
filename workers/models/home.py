"""Where specserve keeps what it builds or converts: $SPECSERVE_HOME, default ~/.cache/specserve."""

from __future__ import annotations

import os
from pathlib import Path


def specserve_home() -> Path:
    return Path(os.environ.get("SPECSERVE_HOME") or Path.home() / ".cache" / "specserve")
