"""What the scheduler asks of a worker (`Call`: the KV state protocol's fields and what to do), and a draft made ahead
for the next round (`PreDraft`). Plain data: scheduler.py plans them, pipeline.py and worker_clients.py run them."""

from __future__ import annotations

from dataclasses import dataclass, field

from specserve.workers.service.results import ProposeResult


@dataclass
class Call:
    """One worker call: the KV state protocol's fields plus what to do."""

    worker: str
    request_id: str
    committed_len: int
    new_tokens: list[int]
    k: int = 0  # draft calls
    drafted: list[int] = field(default_factory=list)  # verify calls
    draft_probs: bytes = b""  # verify calls
    features: bytes = b""  # EAGLE-3 draft calls: the target's features of the newly committed positions (encoded)
    want_features: bool = False  # EAGLE-3 verify calls: return the committed positions' features
    tree: bool = False  # draft calls: a tree of up to k nodes
    parents: list[int] | None = None  # verify calls: `drafted` is a tree with these parents
    prompt_logprobs: int | None = None  # verify calls: the committed tokens' logprobs too (the prompt's), top-n
    prefix_at_most: int | None = None  # verify calls of a request new to the worker: the most positions taken from
    # another request's cached prefix (a head's request: what its draft worker's head holds)
    expected_len: int | None = None  # verify calls of a prompt's chunk: the prompt's whole length (its KV run's size)
    # The whole sequence committed_len counts (never sent unless the worker lost the request). Kept on the call
    # because a concurrent restart may clear what the scheduler remembers telling the worker.
    sequence: list[int] = field(default_factory=list, repr=False)


@dataclass
class PreDraft:
    """Tokens drafted ahead for round r + 1, continuing the drafted tokens of round r."""

    after: list[int]  # the committed + drafted sequence they continue
    draft: ProposeResult
