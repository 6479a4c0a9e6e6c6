"""A round's drafted chain as the scheduler handles it (torch-free): what a draft worker's client hands back for a
chain call (a tree comes back as a `DraftTree`), prompt lookup's continuation, or the rest of a pre-draft. A target
worker's verification comes back as the worker's own VerifyResult (workers/service/results.py); the calls that go out
are the scheduler's `Call`s (scheduler.py)."""

from __future__ import annotations

from typing import NamedTuple


class DraftReply(NamedTuple):
    """A round's drafted chain: from a draft worker, prompt lookup or the rest of a pre-draft."""

    drafted: list[int]  # 0..k tokens (none: the round is a plain target step)
    draft_probs: bytes = b""  # their draft distributions (codec.encode_probs); empty: one-hot (greedy, lookup)
