"""What the scheduler knows of the prompt prefixes its workers hold (affinity.py's records, one per kind of worker):
where a new request is drawn, how much of its prompt its first chunk may skip, and how much a head's request may take
from its target's cache.

A worker holds a request's prompt while it runs (a target after its first round, a draft worker after its first
draft: kv_cache.py copies a running request's prefix for a new one) and after it ends (its cache retained). Both are
recorded; either may be gone since (a hint: the worker computes again what it lacks). Outputs never depend on it.
Several scheduler replicas share their records through the app's registry each poll (about a second): a
conversation's next turn, routed by Serve to another replica, still goes where its history is.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from typing import NamedTuple

from specserve.cluster.scheduling.affinity import BLOCK_TOKENS, PrefixAffinity
from specserve.cluster.scheduling.sched_request import SchedRequest

OUTBOX_MAX = 2048  # records a replica keeps for the others between two polls (a request makes 2-4)


class PrefixRecord(NamedTuple):
    """A worker holds the prefix of these block hashes (affinity.py); plain values, for the registry actor."""

    kind: str  # "target" | "draft"
    worker: str  # its Serve replica id, the same in every scheduler replica
    hashes: list[int]


class PrefixRecords:
    def __init__(self):
        self.affinity = {"target": PrefixAffinity(), "draft": PrefixAffinity()}  # who holds which prefix
        # This replica's records not yet shared with the other scheduler replicas (the newest OUTBOX_MAX)
        self.outbox: deque[PrefixRecord] = deque(maxlen=OUTBOX_MAX)

    def holds_prompt(self, req: SchedRequest, worker: str, kind: str) -> None:
        """`worker` (of `kind`) holds the running request's prompt (recorded once)."""
        if worker not in req.recorded:
            req.recorded.add(worker)
            self._record(kind, worker, req.state.tokens[: req.state.prompt_len])

    def released(self, req: SchedRequest, draft_workers: Iterable[str]) -> None:
        """The request ended: what each of its workers was told stays there for later requests' prefixes."""
        drafts = set(draft_workers)
        for worker, sequence in req.told.items():
            self._record("draft" if worker in drafts else "target", worker, sequence)

    def _record(self, kind: str, worker: str, tokens: list[int]) -> None:
        self.outbox.append(PrefixRecord(kind, worker, self.affinity[kind].record(worker, tokens)))

    def take_outbox(self) -> list[PrefixRecord]:
        """The records made since the last call (for the other scheduler replicas: registry.py's `share_prefixes`)."""
        records = list(self.outbox)
        self.outbox.clear()
        return records

    def merge(self, records: Iterable[PrefixRecord]) -> None:
        """Another scheduler replica's records: its requests' prompts on the workers this replica shares with it, so
        that a conversation's next turn finds its history whichever replica Serve routes it to."""
        for record in records:
            if record.kind in self.affinity:
                self.affinity[record.kind].add(record.worker, record.hashes)

    def forget(self, worker: str) -> None:
        """The worker left or was replaced (its caches with it)."""
        for affinity in self.affinity.values():
            affinity.forget(worker)

    def target_held(self, req: SchedRequest) -> int:
        """How much of the request's prompt (less its last token, which its first round computes) its target likely
        holds."""
        return self.affinity["target"].held(req.state.tokens[: req.state.prompt_len - 1], [req.target_worker])[1]

    def head_prefix(self, req: SchedRequest, requests: Iterable[SchedRequest]) -> int | None:
        """A head's request new to its target worker takes from the target's prefix cache no more than its draft
        worker's head can give: the target sends no features for cached positions, and a head lacking its prompt
        drafts badly (sglang #31600). Of h tokens held, a head gives h - 1 positions (its entry of a position reads
        the token after it); a target all h. The cap holds where the target may hold as much as the head or more
        (kept from requests of other methods, a running request's prompt, or one still prefilling). None: no cap (no
        head, the request is on the worker already, or nothing known)."""
        if req.features is None or req.draft_worker is None or req.target_worker in req.told:
            return None
        prompt = req.state.tokens[:-1]
        head = self.affinity["draft"].held(prompt, [req.draft_worker])[1]
        target = self.affinity["target"].held(prompt, [req.target_worker])[1]
        if (target and target >= head) or _prefilling_beside(req, requests):
            return max(0, head - 1)
        return None


def _prefilling_beside(req: SchedRequest, requests: Iterable[SchedRequest]) -> bool:
    """Another request on its target worker shares the start of its prompt and is not recorded there yet (still
    prefilling): the worker may copy what it computed so far, which no head holds yet."""
    target, start = req.target_worker, req.state.tokens[:BLOCK_TOKENS]
    return any(r is not req and r.target_worker == target and target not in r.recorded
               and r.state.tokens[:BLOCK_TOKENS] == start for r in requests)  # fmt: skip
