"""How many tokens a long prompt's next prefill chunk feeds: sized by time, not by a fixed count, while other requests
decode on the same target worker.

vLLM mixes a chunk into the decode step's own forward under a token budget (`max_num_batched_tokens`), so the decode
rows pay only the chunk's marginal cost. specserve's runner left-pads a batch's rows to the widest, so a chunk of 256
beside rows of 4 would cost five chunks: a chunk runs as its own forward between the other requests' verify batches
(workers/service/batcher.py keeps such a batch apart). Then a chunk's seconds are what every decoding stream on the
worker waits for each round, and what the prompt gains: a fixed 256 tokens cost ~1.3 s deep in a 4K prompt on 2
cores, where a chat round costs ~0.13 s (results/2026-11-27-2334-smollm2-long-prompt: the chat streams' p99 gap 18x
their gap alone). So while others decode there, a chunk feeds as many tokens as cost about CHUNK_SHARE of their
verify batch: the worker alternates one chunk and one batch, the prompt gets CHUNK_SHARE / (CHUNK_SHARE + 1) of it
(its TTFT about 1.5x alone) and a decoding stream's round grows to about CHUNK_SHARE + 1 batches (its drafting
overlaps the chunk). Alone on the worker, a prompt takes the setting's whole chunk: fewest calls, nobody waits.

Both costs are measured from the workers' replies (each reply's batch seconds), per worker, as decayed means: a
position's cost grows with the prompt's depth (attention), which the newest chunks follow.
"""

from __future__ import annotations

from dataclasses import dataclass

CHUNK_SHARE = 2.0  # a chunk costs about this many of the decoding requests' verify batches
MIN_CHUNK_TOKENS = 16  # fewer is mostly a call's fixed cost
DECAY = 0.5  # weight of the older mean: a prompt's next chunk sits a little deeper than its last
ROUND_MAX_WIDTH = 64  # a batch feeding more a row held a chunk (padding keeps them apart; batcher.py)


@dataclass
class _WorkerCosts:
    position_s: float | None = None  # seconds a prefill position costs, of the worker's recent chunks
    round_s: float | None = None  # seconds of a verify batch of its decoding requests


def _decayed(old: float | None, new: float) -> float:
    return new if old is None else DECAY * old + (1 - DECAY) * new


class ChunkPacer:
    """Per target worker: the size of a prompt's next prefill chunk, from what its chunks and its decoding requests'
    verify batches have cost."""

    def __init__(self, max_tokens: int | None):
        """max_tokens: the chunk setting (`prefill_chunk_tokens`): a chunk's most, and its size on an idle worker."""
        self.max_tokens = max_tokens
        self._costs: dict[str, _WorkerCosts] = {}

    def tokens(self, worker: str, others_decoding: bool) -> int:
        """The next chunk's size on `worker`: the setting's while none decode beside it (or nothing is measured),
        else what costs CHUNK_SHARE of their batch (a quarter of the setting until a chunk was measured)."""
        top = self.max_tokens or 0
        costs = self._costs.get(worker)
        if not others_decoding or costs is None or costs.round_s is None:
            return top
        if costs.position_s is None:
            return max(min(top, MIN_CHUNK_TOKENS), top // 4)
        fit = int(CHUNK_SHARE * costs.round_s / costs.position_s)
        return max(min(top, MIN_CHUNK_TOKENS), min(top, fit))

    def chunk_ran(self, worker: str, positions: int, seconds: float) -> None:
        """A chunk fed `positions` new positions in a batch of `seconds`."""
        if positions > 0 and seconds > 0:
            costs = self._costs.setdefault(worker, _WorkerCosts())
            costs.position_s = _decayed(costs.position_s, seconds / positions)

    def round_ran(self, worker: str, rows: int, positions: int, seconds: float) -> None:
        """A decoding request's verify batch of `rows` rows feeding `positions` positions ran `seconds` (one that
        held a chunk too is not a round: the next chunk would be sized by the last)."""
        if rows > 0 and seconds > 0 and positions <= rows * ROUND_MAX_WIDTH:
            costs = self._costs.setdefault(worker, _WorkerCosts())
            costs.round_s = _decayed(costs.round_s, seconds)

    def forget(self, worker: str) -> None:
        """The worker left (a replacement measures afresh)."""
        self._costs.pop(worker, None)
