"""What the scheduler knows of the prompt prefixes its workers hold (affinity.py's records, one per kind of worker):
where a new request is drawn, how much of its prompt its first chunk may skip, and how much a head's request may take
from its target's cache.

A worker holds a request's prompt while it runs (a target after its first round, a draft worker after its first
draft: kv_cache.py copies a running request's prefix for a new one) and after it ends (its cache retained). Both are
recorded; either may be gone since (a hint: the worker computes again what it lacks). Outputs never depend on it.
"""

from __future__ import annotations

from collections.abc import Iterable

from specserve.cluster.scheduling.affinity import BLOCK_TOKENS, PrefixAffinity
from specserve.cluster.scheduling.sched_request import SchedRequest


class PrefixRecords:
    def __init__(self):
        self.affinity = {"target": PrefixAffinity(), "draft": PrefixAffinity()}  # who holds which prefix

    def holds_prompt(self, req: SchedRequest, worker: str, kind: str) -> None:
        """`worker` (of `kind`) holds the running request's prompt (recorded once)."""
        if worker not in req.recorded:
            req.recorded.add(worker)
            self.affinity[kind].record(worker, req.state.tokens[: req.state.prompt_len])

    def released(self, req: SchedRequest, draft_workers: Iterable[str]) -> None:
        """The request ended: what each of its workers was told stays there for later requests' prefixes."""
        drafts = set(draft_workers)
        for worker, sequence in req.told.items():
            self.affinity["draft" if worker in drafts else "target"].record(worker, sequence)

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
