"""How many tokens a long prompt's next prefill chunk feeds: sized by time, not by a fixed count, while other requests
decode on the same target worker.

vLLM mixes a chunk into the decode step's own forward under a token budget (`max_num_batched_tokens`), so the decode
rows pay only the chunk's marginal cost; so does specserve's packed pass (workers/runtime/ragged.py) where the chunk
arrives with their calls, else the chunk runs as a forward of its own. Either way a chunk's seconds are what each
decoding stream on the worker waits for a round, and what the prompt gains: a fixed 256 tokens cost ~1.3 s deep in
a 4K prompt on 2 cores, where a chat round took ~0.14 s (results/2026-11-27-2334-smollm2-long-prompt: the streams'
p99 gap 18x alone). The decoding rounds counted are chains' and trees' alike (the scheduler's apply_round).

So while others decode there, a chunk is sized so that its own positions cost about CHUNK_SHARE of their round
(their round's wall time, drafting and hops included: the median of the latest rounds that no prompt's prefill
overlapped, from its first chunk to its first round). Their rows ride in the chunk's pass (the batcher holds a
prompt's pass for them, `prefill_wait_ms`), so each stream's round is its own plus the chunk's, and the prompt has
about CHUNK_SHARE / (CHUNK_SHARE + 1) of the worker: within 1.5x its TTFT alone when a round's own part (the pass's
weights and rows, the draft hop) is no more than half the chunk's. What a chunk's positions cost comes from the
worker's fit of its passes (pass_cost.py: a fixed part, a part per position, a part per key the chunk attends over),
so a chunk shrinks as its prompt deepens, before its passes show it. Each such pass comes with what its other rows
cost without the chunk (the worker's start-up profile of that many rows, `PlannerCosts.profiled`), a point at no chunk
that anchors the fit's fixed part: passes of one shape (a few dozen positions, the depth creeping) barely tell a
fixed part from a part per key, and unanchored the fit called 250-300 ms of a 550 ms pass fixed where the rows cost
~70, so it sized chunks to 1.6x their share (results/2026-12-07-1510-smollm2-long-prompt-plain-beside, 10's trace).
Only passes beside decoding requests are fitted for sizing: alone a prompt feeds whole chunks of one size, whose fixed
part a fit cannot tell from their positions' (from them it read 0.6 s "fixed", and sized the first chunks beside
streams to 860 ms passes); they are the floor's measure (below). A chunk grows at most MAX_GROW over the last and
shrinks at most MAX_SHRINK: too big is a long gap for every stream beside it, too small only a slightly later first
token. Alone on the worker, a prompt takes the setting's whole chunk: fewest calls, nobody waits.

CHUNK_SHARE trades the prompt's TTFT against the streams' gaps, and fast rounds starve the prompt: at 57-78 ms a round
(the streams' plain steps on the 2-core CPU), three rounds of a chunk's own time left a pass's rest (the weights'
pass, the rows, and what serving beside them adds: 65-103 ms a pass) a third of it, and a 4K prompt took 1.73-1.75x its
TTFT alone (results/2026-12-07-1855-smollm2-long-prompt-floor). So a floor: the chunk's positions, counted at what they
cost in the worker's passes of whole chunks with nothing beside (a second fit, `alone`: a whole chunk's seconds by its
depth, all that a position's cost alone needs), are on average at least MIN_PROMPT_SHARE of the passes they ride in,
so the prompt keeps about that share of its speed alone. The floor is one pass length for a prompt's passes (the rest's
median over about a prompt's passes, made a chunk by the fit of the passes beside): deep, a position costs more beside
the rows than alone (~12% a key on the CPU), and a floor judged pass by pass made the deep passes 40% longer than the
shallow ones, the streams' worst gaps. Issue 54 asks TTFT <= 1.5x and the streams' p99 gap <= 2x together; on the CPU
the two meet only near one share: at 0.75, one length, the TTFT 1.40-1.46x and the p99 1.76-1.95x in five runs; at
0.7, pass by pass, 1.42x and 1.98x.

The decoding rounds planned while a prompt prefills on their worker count its next chunk in their pass (`beside`):
its positions as tokens the pass commits and its fitted seconds, so their planners verify only the drafted positions
expected to commit more than the prompt's positions they displace (planner/costs.py's ChunkBeside).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from specserve.cluster.scheduling.pass_cost import PassCost
from specserve.workers.speculation.planner.costs import ChunkBeside

CHUNK_SHARE = 3.0  # a chunk's own positions cost about this many of the decoding requests' rounds
MIN_PROMPT_SHARE = 0.75  # and on average at least this share of the passes they ride in, at what they cost alone
RESTS_KEPT = 128  # the passes (about a prompt's) whose rest (all but the chunk's positions at cost alone) sizes it
FIT_RESTS_KEPT = 16  # the latest passes whose rest by the fit (all but the chunk's own cost beside) sizes its chunk
MIN_CHUNK_TOKENS = 16  # fewer is mostly a call's fixed cost
MAX_GROW = 1.25  # a chunk grows at most this factor over the last one (a chunk too big is every stream's long gap)
MAX_SHRINK = 2.0  # and shrinks at most this factor
ROUNDS_KEPT = 256  # the decoding rounds whose median a chunk is paced by (4 streams: ~8 s of them)
IN_FLIGHT = -1  # a round's epoch when it started beside a chunk
PROMPTS_KEPT = 8  # prompts whose chunk fits a worker keeps (the newest)


def _median(values: deque[float]) -> float | None:
    """The upper median (None: none)."""
    return sorted(values)[len(values) // 2] if values else None


@dataclass
class _Worker:
    rounds: deque[float] = field(default_factory=lambda: deque(maxlen=ROUNDS_KEPT))  # while no chunk ran beside them
    size: int | None = None  # the latest paced size, where a new prompt starts (None: not measured yet)
    sizes: dict[str, int] = field(default_factory=dict)  # per prompt (request id): its next chunk's tokens
    epoch: int = 0  # chunks planned so far: a round that saw this change had a chunk beside it
    done: int = 0  # the epoch of the latest chunk that ran (below `epoch`: one is in flight)
    beside: bool = False  # whether the chunk in flight was planned beside decoding requests
    chunks: int = 0
    chunk_s: float = 0.0  # the latest chunk's seconds
    chunk_n: int = 0  # and its positions
    cost: PassCost = field(default_factory=PassCost)  # its passes with a chunk in them
    rests: deque[float] = field(default_factory=lambda: deque(maxlen=RESTS_KEPT))  # but the chunk at its cost alone
    fit_rests: deque[float] = field(default_factory=lambda: deque(maxlen=FIT_RESTS_KEPT))  # but its own by `cost`
    alone: PassCost = field(default_factory=PassCost)  # its passes of a prompt's chunk with nothing decoding beside
    nothing_beside: bool = False  # whether the chunk in flight was planned with no request decoding there
    next_depth: int = 0  # where the prompt prefilling there takes its next chunk from
    prompt: str | None = None  # the prompt prefilling there now (its first chunk planned, its first round not in)

    @property
    def rest_s(self) -> float | None:
        """What a pass beside the decoding requests costs but the chunk's positions at their cost alone (the weights'
        pass, the rows, what serving beside them adds): the median over about a prompt's passes, deep and shallow."""
        rests = self.rests or self.fit_rests
        return _median(rests)

    @property
    def round_s(self) -> float | None:
        """A decoding request's round: the median of the latest, so that the few slow ones around a prompt's first
        round (its rest, its head's catch-up over 4K positions) do not pace the next prompt (as a decayed mean they
        moved it from 91 to 227 ms, and the next prompt's passes to 0.9 s)."""
        return _median(self.rounds)


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
        round is not measured, else the size that costs CHUNK_SHARE of their round, or the floor's (for a prompt not
        measured yet the worker's latest, not a size at its own depth: by a fit of passes deep in the prompt before,
        that made one prompt's first chunk 201 positions, a 0.6 s pass; a quarter of the setting until a chunk beside
        them was measured)."""
        w = self._at(worker)
        if not others_decoding or w.round_s is None:
            return self.max_tokens
        return w.sizes.get(prompt) or w.size or min(self.max_tokens, max(MIN_CHUNK_TOKENS, self.max_tokens // 4))

    def started(self, worker: str, others_decoding: bool, prompt: str = "") -> None:
        """A chunk of `prompt` (of `size`'s answer) goes to the worker."""
        w = self._at(worker)
        w.epoch += 1
        w.beside = others_decoding and w.round_s is not None
        w.nothing_beside = not others_decoding
        w.prompt = prompt

    def ended(self, prompt: str) -> None:
        """The prompt's first round is in (its last chunk's rest went with it), or it ended."""
        for w in self._workers.values():
            if w.prompt == prompt:
                w.prompt = None

    def beside(self, worker: str) -> ChunkBeside | None:
        """The chunk that a decoding round planned now on `worker` shares its pass with (None: no prompt prefills
        there): the prompt's next chunk, its seconds by the worker's pass cost (before that is fitted, the latest
        chunk's pass per position, its fixed part included)."""
        w = self._workers.get(worker)
        if w is None or w.prompt is None:
            return None
        positions = self.size(worker, True, w.prompt)
        seconds = w.cost.chunk_seconds(positions, w.next_depth)
        if seconds is None:
            return ChunkBeside(positions, w.chunk_s * positions / w.chunk_n) if w.chunk_n else None
        return ChunkBeside(positions, seconds)

    def chunk_ran(self, worker: str, positions: int, seconds: float, prompt: str = "", batch_positions: int = 0,
                  depth: int = 0, base_s: float | None = None) -> None:  # fmt: skip
        """The chunk in flight (of `prompt`, `depth` positions into it) fed `positions` positions in `seconds` of its
        worker's batch, which fed `batch_positions` in all (0: not known, the chunk's); one beside decoding requests
        moves the prompt's size towards its budget. base_s: what the batch's other rows cost without the chunk (the
        worker's start-up profile; None: not known), which anchors the fit's fixed part."""
        w = self._at(worker)
        w.done = w.epoch
        if positions <= 0 or seconds <= 0:
            return
        w.chunks += 1
        w.chunk_s, w.chunk_n = seconds, positions
        w.next_depth = depth + positions
        if w.beside:  # a prompt alone feeds whole chunks: passes of one size, whose fixed part the fit cannot tell
            if base_s:  # the rows alone: a point at no chunk, so the fit cannot call the chunk's keys "fixed"
                w.cost.add(0, 0, max(batch_positions - positions, 0), base_s)
            w.cost.add(positions, depth, max(batch_positions, positions), seconds)
            own, alone = w.cost.chunk_seconds(positions, depth), self._alone_seconds(w, positions, depth)
            if own is not None:
                w.fit_rests.append(max(seconds - own, 0.0))
            if alone is not None:
                w.rests.append(max(seconds - alone, 0.0))
        elif w.nothing_beside:  # not a pass beside requests whose round was not measured yet
            w.alone.add(positions, depth, max(batch_positions, positions), seconds)
        if w.beside and w.round_s is not None:
            want = self._want(w, w.next_depth)
            if want is None:  # not fitted yet: the whole pass in proportion, as if its fixed part were a round's
                want = positions * (CHUNK_SHARE + 1) * w.round_s / seconds
            want = min(MAX_GROW * positions, max(positions / MAX_SHRINK, want))
            w.size = min(self.max_tokens, max(MIN_CHUNK_TOKENS, round(want)))
            w.sizes.pop(prompt, None)
            w.sizes[prompt] = w.size
        while len(w.sizes) > PROMPTS_KEPT:  # the newest prompts' (finished ones are not told apart: few chunk at once)
            w.sizes.pop(next(iter(w.sizes)))

    def _alone_seconds(self, w: _Worker, positions: int, depth: int) -> float | None:
        """What `positions` of a prompt at `depth` cost in the worker's passes of whole chunks with nothing beside
        (None: none fitted): their share of such a pass around their middle."""
        whole = self.max_tokens
        middle = depth + positions / 2
        pass_s = w.alone.seconds(whole, max(middle - whole / 2, 0.0), whole) if whole else None
        return None if pass_s is None else positions * pass_s / whole

    def _want(self, w: _Worker, depth: int) -> float | None:
        """The chunk at `depth` whose own positions cost CHUNK_SHARE of a round, or the floor's where that is larger
        (None: no fit yet)."""
        want = w.cost.chunk_for(CHUNK_SHARE * (w.round_s or 0.0), depth)
        return None if want is None else max(want, self._floor(w, depth) or 0.0)

    def _floor(self, w: _Worker, depth: int) -> float | None:
        """The chunk whose pass is as long as one where its positions, at their cost alone, are MIN_PROMPT_SHARE of it
        beside the rest that passes have (None: none measured). One such length for a prompt's every pass, by the
        fit of the passes beside: deep, where a position costs more beside the rows than alone, it would otherwise be
        longer, and the streams' worst gaps with it. Without passes alone, the chunk's own cost is by that fit."""
        if w.rest_s is None or not w.fit_rests:
            return None
        pass_s = w.rest_s / (1 - MIN_PROMPT_SHARE)
        return w.cost.chunk_for(pass_s - _median(w.fit_rests), depth)

    def epoch(self, worker: str) -> int:
        """Read at a round's start; `round_ran` compares it. A round that starts while a prompt prefills there (from
        its first chunk to its first round) gets IN_FLIGHT: it waits for a chunk's pass (or rides in it) even where
        it is answered after it, and the prompt's first round carries its rest."""
        w = self._at(worker)
        return w.epoch if w.done == w.epoch and w.prompt is None else IN_FLIGHT

    def round_ran(self, worker: str, seconds: float, epoch: int) -> None:
        """A decoding request's round took `seconds`; it counts when no chunk was planned or running meanwhile."""
        w = self._at(worker)
        if seconds > 0 and epoch == w.epoch == w.done:
            w.rounds.append(seconds)

    def forget(self, worker: str) -> None:
        """The worker left (a replacement measures afresh)."""
        self._workers.pop(worker, None)

    def status(self) -> dict:
        """Per worker: the decoding round it paces against, the next chunk's size beside it, chunks run, the last
        one's seconds, a pass's rest beside them (the floor's measure), and the fits of the passes beside them and of
        those alone (ms: fixed, a position, a thousand keys; None before one)."""
        return {name: {"round_ms": round(1e3 * w.round_s, 1) if w.round_s else None, "next_tokens": w.size,
                       "chunks": w.chunks, "last_chunk_ms": round(1e3 * w.chunk_s, 1),
                       "pass_rest_ms": round(1e3 * w.rest_s, 1) if w.rest_s is not None else None,
                       "pass_fit_ms": [round(1e3 * c, 4) for c in w.cost.coef] if w.cost.coef else None,
                       "alone_fit_ms": [round(1e3 * c, 4) for c in w.alone.coef] if w.alone.coef else None}
                for name, w in self._workers.items()}  # fmt: skip
