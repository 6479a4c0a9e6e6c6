"""The demo family's offline corpus: the Python standard library's own source, split into train and held-out files.

Always present, no network. Test suites are left out (they are repetitive and odd); every file whose path hashes
into bucket 0 of 10 is held out for evaluation, so the split is stable across runs and machines.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

from specserve.workers.models.demo import stdlib_root

_SKIP_DIRS = {"site-packages", "test", "tests", "idle_test", "__pycache__", "ensurepip", "turtledemo"}


@dataclass(frozen=True)
class Corpus:
    root: Path
    train: list[Path]
    held_out: list[Path]

    def read(self, paths: list[Path]) -> list[str]:
        return [p.read_text(encoding="utf-8", errors="replace") for p in paths]


def _held_out(rel: str) -> bool:
    return int(hashlib.sha1(rel.encode()).hexdigest(), 16) % 10 == 0


def stdlib_corpus(root: str | Path | None = None, max_files: int | None = None) -> Corpus:
    """Source files of the standard library at `root` (default: this Python's), sorted for reproducibility."""
    root = Path(root) if root else stdlib_root()
    files: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS)
        files.extend(Path(dirpath) / f for f in sorted(filenames) if f.endswith(".py"))
    files.sort(key=lambda p: p.relative_to(root).as_posix())
    if max_files is not None:
        files = files[:max_files]
    train = [p for p in files if not _held_out(p.relative_to(root).as_posix())]
    held_out = [p for p in files if _held_out(p.relative_to(root).as_posix())]
    return Corpus(root=root, train=train, held_out=held_out)
