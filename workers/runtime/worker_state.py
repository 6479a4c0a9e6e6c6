"""What a draft or target worker knows of each request: its committed tokens, kept in step with the scheduler by the
KV state protocol (see protos/specserve.proto), plus LRU eviction when the KV cache is full."""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import TypeVar

from specserve.workers.errors import InvalidRequestError, KVCapacityError, RequestNotFoundError

T = TypeVar("T")
log = logging.getLogger(__name__)


def check_token_ids(field: str, ids: Sequence[int], vocab_size: int) -> None:
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise InvalidRequestError(field, f"token id {bad[0]} is outside the vocabulary [0, {vocab_size})")


class CommittedTokens:
    """Request id -> committed token sequence, least recently used first."""

    def __init__(self):
        self._tokens: OrderedDict[str, list[int]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._tokens)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._tokens

    def advance(self, request_id: str, committed_len: int, new_tokens: Sequence[int]) -> list[int]:
        """Apply a call's (committed_len, new_tokens): the committed sequence is what the worker already knew up to
        committed_len - len(new_tokens), followed by new_tokens. Raises RequestNotFoundError when the worker knows
        less than that (restarted or evicted): the caller must re-send the whole committed sequence."""
        start = committed_len - len(new_tokens)
        if start < 0:
            raise ValueError(f"committed_len {committed_len} is shorter than the {len(new_tokens)} new tokens")
        known = self._tokens.get(request_id)
        if known is None and start > 0 or known is not None and len(known) < start:
            have = 0 if known is None else len(known)
            raise RequestNotFoundError(
                f"worker holds {have} committed tokens of request {request_id!r}, the call assumes {start}: "
                "re-send the committed sequence"
            )
        tokens = (known[:start] if known else []) + [int(t) for t in new_tokens]
        self._tokens[request_id] = tokens
        self._tokens.move_to_end(request_id)
        return tokens

    def release(self, request_id: str) -> bool:
        return self._tokens.pop(request_id, None) is not None

    def tokens(self, request_id: str) -> list[int] | None:
        """The request's committed tokens (None: not held)."""
        return self._tokens.get(request_id)

    def least_recent(self) -> list[str]:
        return list(self._tokens)


def with_eviction(
    committed: CommittedTokens,
    request_id: str,
    work: Callable[[], T],
    release: Callable[[str], bool],
    spare: frozenset[str] = frozenset(),
) -> T:
    """Run `work`; when the KV cache is full, evict idle requests least recently used first and retry, the `spare`
    ones (rows of the same batch still to run) last. Evicted requests answer NOT_FOUND on their next call and are
    re-sent by the scheduler, so nothing is lost."""
    while True:
        try:
            return work()
        except KVCapacityError:
            lru = [rid for rid in committed.least_recent() if rid != request_id]
            victims = sorted(lru, key=spare.__contains__)  # stable: least recent first, spare ones last
            if not victims:
                raise
            _evict(victims[0], release)


def _evict(request_id: str, release: Callable[[str], bool]) -> None:
    log.info("KV cache full: evicting idle request %r (it answers NOT_FOUND and is re-sent)", request_id)
    release(request_id)


def run_batch(
    committed: CommittedTokens,
    request_ids: Sequence[str],
    batch_work: Callable[[Sequence[int]], list[T]],
    release: Callable[[str], bool],
) -> list[T | Exception]:
    """Run rows `request_ids` as one batch (`batch_work(row indices)`). When the KV cache is full, evict idle
    requests (least recently used, never a row of this batch) and retry; when the batch cannot fit even so, run the
    rows one at a time, each evicting whatever else it needs as a lone call would (rows still to run last), so that
    each row gets its own result or its own error."""
    rows = list(range(len(request_ids)))
    in_batch = set(request_ids)
    while True:
        try:
            return list(batch_work(rows))
        except KVCapacityError:
            victims = [rid for rid in committed.least_recent() if rid not in in_batch]
            if not victims:
                break
            _evict(victims[0], release)
    results: list[T | Exception] = []
    for i in rows:
        if request_ids[i] not in committed:  # evicted by an earlier row of this loop: the scheduler re-sends it
            results.append(RequestNotFoundError(f"request {request_ids[i]!r} was evicted: re-send its sequence"))
            continue
        pending = frozenset(request_ids[j] for j in rows[i + 1 :])
        try:
            results.append(with_eviction(committed, request_ids[i], lambda i=i: batch_work([i])[0], release, pending))
        except KVCapacityError as e:
            results.append(e)
    return results


def run_calls(
    committed: CommittedTokens,
    calls: Sequence,
    prepare: Callable[[object], T],
    work: Callable[[list[T]], list],
    release: Callable[[str], bool],
) -> tuple[list, int]:
    """A worker's batch entry point: `prepare(call)` turns each call into a row (raising InvalidRequestError,
    RequestNotFoundError or ValueError for that call alone), then every prepared row runs through `run_batch` with
    `work(rows)`. Returns (one result or exception per call, in order; how many rows ran)."""
    results: list = [None] * len(calls)
    rows, ready = [], []
    for i, call in enumerate(calls):
        try:
            rows.append(prepare(call))
        except (InvalidRequestError, RequestNotFoundError, ValueError) as e:
            results[i] = e
            continue
        ready.append(i)
    if rows:
        ids = [calls[i].request_id for i in ready]
        outcomes = run_batch(committed, ids, lambda idx: work([rows[j] for j in idx]), release)
        for i, outcome in zip(ready, outcomes, strict=True):
            results[i] = outcome
    return results, len(rows)


def common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens the two sequences share."""
    n = min(len(a), len(b))
    if list(a[:n]) == list(b[:n]):  # fast path: C-speed comparison, the usual case
        return n
    i = 0
    while a[i] == b[i]:
        i += 1
    return i
