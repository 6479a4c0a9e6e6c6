"""How many tokens a long prompt's next prefill chunk feeds: sized by time, not by a fixed count, while other requests
decode on the same target worker.

vLLM mixes a chunk into the decode step's own forward under a token budget (`max_num_batched_tokens`), so the decode
rows pay only the chunk's marginal cost; so does specserve's packed pass (workers/runtime/ragged.py) where the chunk
arrives with their calls, else the chunk runs as a forward of its own. Either way a chunk's seconds are what each
decoding stream on the worker waits for a round, and what the prompt gains: a fixed 256 tokens cost ~1.3 s deep in
a 4K prompt on 2 cores, where a chat round took ~0.14 s (results/2026-11-27-2334-smollm2-long-prompt: the streams'
p99 gap 18x alone). The decoding rounds counted are chains' and trees' alike (the scheduler's apply_round).

So while others decode there, a chunk is sized to cost about CHUNK_SHARE of their round (their round's wall time,
drafting and hops included, as measured while no chunk ran beside it, nor started before it ended): their rows ride
in the chunk's pass (the batcher holds a prompt's pass for them, `prefill_wait_ms`), so each stream's round grows to
about CHUNK_SHARE of its own. A chunk's cost is fitted as a fixed part and a part per position (decayed least squares
over the prompt's latest chunks: deeper in the prompt both grow). The fit is per prompt: two prompts chunking on one
worker at different depths, fitted as one, gave a per-position part near zero and 256-token chunks beside the
streams. Where the fixed part (a forward's reading of every weight, the decoding rows beside the chunk: 70-250 ms for
SmolLM2 on 2 cores) would take more than half that pass, shrinking would only slow the prompt: the chunk is then as
long as makes its own positions PROMPT_SHARE of its pass.

The two settings trade the prompt's TTFT against the streams' gaps; on the 2-core CPU neither trade meets both of issue
54's bounds (TTFT within 1.5x alone, the streams' p99 gap within 2x). The long-prompt bench, quick
(results/2026-11-28-2145-smollm2-long-prompt-merged): CHUNK_SHARE 2 gave 2.4x / 1.7x, 3 gave 2.1x / 2.0x and 2.7x / 1.8x
(these settings), and 2 with the prompt's share at 2/3 gave 1.45x / 3.6x. Steps are at most MAX_STEP, so the fit sees
several sizes. Alone on the worker, a prompt takes the setting's whole chunk: fewest calls, nobody waits.

The decoding rounds planned while a prompt prefills on their worker count its next chunk in their pass (`beside`):
its positions as tokens the pass commits and its fitted seconds, so their planners verify only the drafted positions
expected to commit more than the prompt's positions they displace (planner/costs.py's ChunkBeside).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from specserve.workers.speculation.planner.costs import ChunkBeside

CHUNK_SHARE = 3.0  # a chunk's pass costs about this many of the decoding requests' rounds
MIN_CHUNK_TOKENS = 16  # fewer is mostly a call's fixed cost
PROMPT_SHARE = 1 / 2  # of a chunk's pass, at least this much is the chunk's own positions
MAX_STEP = 2.0  # a chunk's size changes at most this factor from the last one's
DECAY = 0.8  # weight of the older mean in the decoding rounds' time
FIT_DECAY = 0.7  # weight of older chunks in the cost fit
IN_FLIGHT = -1  # a round's epoch when it started beside a chunk
PROMPTS_KEPT = 8  # prompts whose chunk fits a worker keeps (the newest)


@dataclass
class _Worker:
    round_s: float | None = None  # a decoding request's round, while no chunk ran beside it (decayed mean)
    size: int | None = None  # the latest paced size, where a new prompt starts (None: not measured yet)
    sizes: dict[str, int] = field(default_factory=dict)  # per prompt (request id): its next chunk's tokens
    epoch: int = 0  # chunks planned so far: a round that saw this change had a chunk beside it
    done: int = 0  # the epoch of the latest chunk that ran (below `epoch`: one is in flight)
    beside: bool = False  # whether the chunk in flight was planned beside decoding requests
    chunks: int = 0
    chunk_s: float = 0.0  # the latest chunk's seconds
    chunk_n: int = 0  # and its positions
    fits: dict[str, list[float]] = field(default_factory=dict)  # per prompt, decayed sums: 1, n, s, n^2, n*s
    prompt: str | None = None  # the prompt prefilling there now (its first chunk planned, its last not yet run)


class ChunkPacer:
    """Per target worker: the size of a prompt's next prefill chunk, from what its decoding requests' rounds and its
    chunks have cost."""

    def __init__(self, max_tokens: int | None):
        """max_tokens: the chunk setting (`prefill_chunk_tokens`): a chunk's most, and its size on an idle worker."""
        self.max_tokens = max_tokens or 0
        self._workers: dict[str, _Worker] = {}

    def _at(self, worker: str) -> _Worker:
        return self._workers.setdefault(worker, _Worker())

    def size(self, worker: str, others_decoding: bool, prompt: str = "") -> int:
        """The next chunk of `prompt` (a request id) on `worker`: the setting's while none decode beside it or their
        round is not measured, else the size that costs CHUNK_SHARE of their round (for a prompt not measured yet the
        worker's latest; a quarter of the setting until a chunk beside them was measured)."""
        w = self._at(worker)
        if not others_decoding or w.round_s is None:
            return self.max_tokens
        return w.sizes.get(prompt) or w.size or min(self.max_tokens, max(MIN_CHUNK_TOKENS, self.max_tokens // 4))

    def started(self, worker: str, others_decoding: bool, prompt: str = "") -> None:
        """A chunk of `prompt` (of `size`'s answer) goes to the worker."""
        w = self._at(worker)
        w.epoch += 1
        w.beside = others_decoding and w.round_s is not None
        w.prompt = prompt

    def ended(self, prompt: str) -> None:
        """The prompt's chunks are over (the rest goes with its first round, or it ended)."""
        for w in self._workers.values():
            if w.prompt == prompt:
                w.prompt = None

    def beside(self, worker: str) -> ChunkBeside | None:
        """The chunk that a decoding round planned now on `worker` shares its pass with (None: no prompt prefills
        there): the prompt's next chunk, its seconds by the prompt's cost fit per position (before two sizes were
        measured, the latest chunk's seconds per position, its fixed part included)."""
        w = self._workers.get(worker)
        if w is None or w.prompt is None:
            return None
        positions = self.size(worker, True, w.prompt)
        fit = w.fits.get(w.prompt)
        per = _per_position(fit) if fit else 0.0
        if per <= 0:
            if not w.chunk_n:
                return None
            per = w.chunk_s / w.chunk_n
        return ChunkBeside(positions, per * positions)

    def chunk_ran(self, worker: str, positions: int, seconds: float, prompt: str = "") -> None:
        """The chunk in flight (of `prompt`) fed `positions` positions in `seconds` of its worker's batch; one beside
        decoding requests moves the prompt's size towards its budget."""
        w = self._at(worker)
        w.done = w.epoch
        if positions <= 0 or seconds <= 0:
            return
        w.chunks += 1
        w.chunk_s, w.chunk_n = seconds, positions
        fit = w.fits.pop(prompt, None) or [0.0] * 5
        sample = (1, positions, seconds, positions**2, positions * seconds)
        w.fits[prompt] = [FIT_DECAY * old + new for old, new in zip(fit, sample, strict=True)]
        if w.beside and w.round_s is not None:
            want = _fitted_size(w.fits[prompt], CHUNK_SHARE * w.round_s, positions, seconds)
            want = min(MAX_STEP * positions, max(positions / MAX_STEP, want))
            w.size = min(self.max_tokens, max(MIN_CHUNK_TOKENS, round(want)))
            w.sizes.pop(prompt, None)
            w.sizes[prompt] = w.size
        for kept in (w.fits, w.sizes):  # the newest prompts' (finished ones are not told apart: few chunk at once)
            while len(kept) > PROMPTS_KEPT:
                kept.pop(next(iter(kept)))

    def epoch(self, worker: str) -> int:
        """Read at a round's start; `round_ran` compares it. A round that starts while a chunk runs gets IN_FLIGHT:
        it waits for that chunk's pass (or rides in it) even where it is answered after the chunk."""
        w = self._at(worker)
        return w.epoch if w.done == w.epoch else IN_FLIGHT

    def round_ran(self, worker: str, seconds: float, epoch: int) -> None:
        """A decoding request's round took `seconds`; it counts when no chunk was planned or running meanwhile."""
        w = self._at(worker)
        if seconds > 0 and epoch == w.epoch == w.done:
            w.round_s = seconds if w.round_s is None else DECAY * w.round_s + (1 - DECAY) * seconds

    def forget(self, worker: str) -> None:
        """The worker left (a replacement measures afresh)."""
        self._workers.pop(worker, None)

    def status(self) -> dict:
        """Per worker: the decoding round it paces against, the next chunk's size beside it, chunks run, the last
        one's seconds."""
        return {name: {"round_ms": round(1e3 * w.round_s, 1) if w.round_s else None, "next_tokens": w.size,
                       "chunks": w.chunks, "last_chunk_ms": round(1e3 * w.chunk_s, 1)}
                for name, w in self._workers.items()}  # fmt: skip


def _per_position(fit: list[float]) -> float:
    """The fit's seconds per position (0: no spread of sizes yet, or none fitted)."""
    w, n, s, nn, ns = fit
    spread = w * nn - n * n
    return (w * ns - n * s) / spread if spread > 1e-9 * max(1.0, nn * w) else 0.0


def _fitted_size(fit: list[float], budget_s: float, positions: int, seconds: float) -> float:
    """The size whose fitted cost (fixed + per position) is the budget, but at least the size at which the positions
    take PROMPT_SHARE of the pass. With no spread of sizes yet: proportional."""
    w, n, s, _, _ = fit
    per = _per_position(fit)
    if per <= 0:
        return positions * budget_s / seconds
    fixed = max(0.0, (s - per * n) / w)
    return max((budget_s - fixed) / per, PROMPT_SHARE / (1 - PROMPT_SHARE) * fixed / per)
