"""EAGLE-3 heads packaged with specserve (`eagle_heads/<name>/`, community layout), found by their target's identity.

Only targets whose identity costs nothing to learn are looked up: a GGUF file or a directory converted from one
(identity.py reads the GGUF's sha256 from the conversion marker). Hashing any other directory's weights on every
start would cost seconds for a lookup that finds nothing.
"""

from __future__ import annotations

import json
import logging
import os
from functools import cache
from pathlib import Path

from specserve.workers.errors import ModelLoadError
from specserve.workers.models.gguf_store import MARKER, is_gguf_file
from specserve.workers.models.identity import target_identity

log = logging.getLogger(__name__)

HEADS_DIR = Path(__file__).parent / "eagle_heads"
PACKAGED = "eagle"  # the word a config or request uses for "the packaged head for this target"
# A head drafts by default only if its measured acceptance at position 1 reaches this. On a CPU with packed linear
# layers verifying 2 positions costs ~1.1x a plain step (1.5x without), so a one-token chain from a head costing ~0.06
# of a step breaks even at ~0.17; this leaves a margin (on a GPU a verify costs about one step).
DEFAULT_MIN_ACCEPTANCE = 0.25


@cache
def packaged_heads() -> dict[str, Path]:
    """Target identity -> head directory, for every packaged head."""
    heads = {}
    for config in sorted(HEADS_DIR.glob("*/config.json")):
        identity = (json.loads(config.read_text()).get("specserve") or {}).get("target_identity")
        if identity:
            heads[identity] = config.parent
    return heads


def packaged_head_for(target: str | os.PathLike) -> Path | None:
    """The packaged head made for the model at `target`, or None (no head, or an identity that is costly to learn)."""
    path = Path(target).expanduser()
    if not (is_gguf_file(path) or (path / MARKER).is_file()):
        return None
    return packaged_heads().get(target_identity(path))


def pays(head: str | os.PathLike) -> bool:
    """Whether a head should draft by default: its recorded acceptance (`specserve draft eval --record`) at position 1
    reaches DEFAULT_MIN_ACCEPTANCE; an unmeasured head is given the benefit of the doubt."""
    acceptance = (json.loads((Path(head) / "config.json").read_text()).get("specserve") or {}).get("acceptance")
    return not acceptance or acceptance[0] >= DEFAULT_MIN_ACCEPTANCE


def default_head_for(target: str | os.PathLike) -> Path | None:
    """The packaged head a target drafts with when nothing else is asked for: its packaged head, if that pays."""
    head = packaged_head_for(target)
    return head if head is not None and pays(head) else None


def resolve_head(name: str | os.PathLike, target: str | os.PathLike) -> Path:
    """A head directory from `name`: the word 'eagle' (the packaged head for `target`) or a directory."""
    if str(name) == PACKAGED:
        head = packaged_head_for(target)
        if head is None:
            raise ModelLoadError(
                f"no EAGLE-3 head is packaged for {target}: train one (`specserve draft train --target ...`) and "
                "give its directory"
            )
        return head
    path = Path(name).expanduser()
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"{str(name)!r} is neither 'eagle' nor an EAGLE-3 head directory (no config.json)")
    return path
