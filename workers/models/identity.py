"""A target model's identity: a sha256 that names its weights, so data and heads built for it can say whose they are.

A directory converted from GGUF carries its GGUF file's sha256 in `specserve-source.json`: that is its identity, so
the same GGUF converted by another transformers version keeps it. Any other Hugging Face directory is hashed over
config.json and its weight files' bytes (~1 s per 500 MB). A GGUF file's identity is its sha256, which is also the
identity of the directory converted from it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path

from specserve.workers.errors import ModelLoadError
from specserve.workers.models.gguf_store import MARKER, file_sha256, is_gguf_file

log = logging.getLogger(__name__)

_WEIGHT_PATTERNS = ("*.safetensors", "pytorch_model*.bin")
_CHUNK = 4 * 2**20


def target_identity(path: str | os.PathLike) -> str:
    """The hex sha256 that identifies the model at `path` (a Hugging Face directory or a GGUF file).

    Raises ModelLoadError naming the path when it does not exist, or is a directory without config.json or weights."""
    path = Path(path).expanduser()
    if is_gguf_file(path):
        return file_sha256(path)
    if not path.is_dir():
        raise ModelLoadError(f"model path {str(path)!r} is neither a model directory nor a GGUF file")
    converted = _converted_source(path)
    if converted is not None:
        return converted
    return _directory_sha256(path)


def _converted_source(directory: Path) -> str | None:
    marker = directory / MARKER
    if not marker.is_file():
        return None
    try:
        digest = json.loads(marker.read_text())["sha256"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ModelLoadError(f"{marker} is unreadable or has no 'sha256' ({err}): convert the GGUF file again") from err
    if not isinstance(digest, str) or len(digest) != 64:
        raise ModelLoadError(f"{marker} has an invalid 'sha256' {digest!r}: convert the GGUF file again")
    return digest


def _directory_sha256(directory: Path) -> str:
    config = directory / "config.json"
    if not config.is_file():
        raise ModelLoadError(f"model directory {str(directory)!r} has no config.json")
    weights = sorted({p for pattern in _WEIGHT_PATTERNS for p in directory.glob(pattern) if p.is_file()})
    if not weights:
        raise ModelLoadError(f"model directory {str(directory)!r} has no weight files (*.safetensors or *.bin)")
    digest = hashlib.sha256()
    for file in [config, *weights]:
        # names too: the same bytes under another shard name are another checkpoint layout
        digest.update(file.name.encode() + b"\0" + str(file.stat().st_size).encode() + b"\0")
        with open(file, "rb") as f:
            while chunk := f.read(_CHUNK):
                digest.update(chunk)
    log.debug("identity of %s: sha256 over %d files", directory, 1 + len(weights))
    return digest.hexdigest()
