"""The concurrency sweep of `specserve bench`: 1, 4, 16, 32 concurrent greedy streams through the disaggregated
workers (a target and a draft worker process, each behind its gRPC server, continuous batching on both; this process
runs the scheduler), speculation on (k='auto' under the load-aware speculation policy, as the Serve app runs it) vs
off, measured side by side in one run.

The policy's state (acceptance, the target's fitted step cost, the measured switch) is kept across levels, as a running
service keeps it while its load changes. A stream is a closed loop: it sends its next request when the last one
finished. Requests ask for new_tokens on average, each a different length between half and one and a half times that
(fixed per request index, so both modes run the same requests): with equal lengths, plain decoding's streams ran in
lockstep, all prefilling together and all decoding in one batch, a best case for it that independent arrivals never
give (measured at 16 streams: 0.89x that throughput once the same streams were out of step).

Each level first runs a `settle_s` pass with the policy live, unmeasured (it settles at the new load, as in a service
that has been at that load for a while), then `pairs` pairs of an off and an on segment,
`segment_s` seconds apiece, in Thue-Morse order (off on, on off, on off, off on, ...: so that this machine's slow
phases land on both modes alike, and a steady drift of its speed, which ABAB order charges to the later mode, cancels
out); a segment ends when its streams finish the requests they started in time, but its throughput counts only the
tokens committed within its `segment_s` window, at steady load (not while the streams drain). The switch's clock runs
only during on segments' windows, so neither the off segments nor the drains count as time it spent in a mode, and it
measures no draining round (a service's load does not stop every few seconds). A mode's throughput sums its segments'
windows; `spread` is how much the off segments' throughputs differ from each other (max - min over mean): the noise
floor of the on/off ratio. The two segments of a pair ran back to back, so their ratio is nearly free of the
machine's slower swings: `ratio_ci95` is a 95% confidence interval of the on/off ratio from the pairs' ratios (a
t-interval of their logs), what "on >= off" can honestly be judged by on a noisy machine. `identical` compares every
request both modes ran (same index, same prompt)."""

from __future__ import annotations

import asyncio
import math
import random
import statistics
import time
from dataclasses import asdict, dataclass, field

from specserve.cluster.pools.worker_processes import WorkerProcesses
from specserve.cluster.scheduling.k_policy import VerifyCostModel
from specserve.cluster.scheduling.pipeline import Pipeline
from specserve.cluster.scheduling.scheduler import Scheduler
from specserve.cluster.scheduling.speculation_control import SpeculationControl
from specserve.cluster.scheduling.switch import SpeculationSwitch
from specserve.cluster.scheduling.worker_clients import DraftClient, TargetClient
from specserve.workers.config import BatchingConfig, ModelConfig, SamplingParams, SpecParams

LEVELS = (1, 4, 16, 32)
SETTLE_S = 45.0
SEGMENT_S = 7.5
PAIRS = 8
# Two-sided 95% quantiles of Student's t by degrees of freedom (1-15)
_T95 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131)


def _segment_order(pairs: int) -> list[bool]:
    """Off (False) and on (True) segments, pairs in Thue-Morse order (AB BA BA AB ...): with 4 or 8 pairs each
    mode's mean position is the same, so a linear drift of the machine's speed favours neither."""
    order: list[bool] = []
    for i in range(pairs):
        order += [False, True] if bin(i).count("1") % 2 == 0 else [True, False]
    return order


def ratio_ci95(ratios: list[float]) -> tuple[float, float] | None:
    """95% confidence interval of the on/off ratio from paired segments' ratios (a t-interval of their logs; None
    for fewer than 2 pairs)."""
    if len(ratios) < 2 or min(ratios) <= 0:
        return None
    logs = [math.log(r) for r in ratios]
    half = _T95[min(len(logs) - 1, len(_T95)) - 1] * statistics.stdev(logs) / math.sqrt(len(logs))
    mean = statistics.fmean(logs)
    return math.exp(mean - half), math.exp(mean + half)


@dataclass
class LevelRow:
    streams: int
    speculation: str  # "on (k=auto + policy)" | "off"
    requests: int = 0  # in all (each stream sends the next when its last one finished)
    new_tokens: int = 0  # per request, on average (see request_length)
    tokens: int = 0  # every request's tokens, those finishing after the window included
    seconds: float = 0.0
    window_tokens: int = 0  # tokens committed within the measured window
    window_s: float = 0.0
    tokens_per_s: float = 0.0  # aggregate over all streams, within the window (steady load, no drain)
    tpot_ms_p50: float = 0.0  # per-token latency: a request's time over its generated tokens
    tpot_ms_p99: float = 0.0
    target_batch_mean: float = 0.0  # requests per target forward pass
    final_k_cap: int | None = None  # the policy's k at the end (0: speculation turned off)
    identical: bool | None = None  # spec-on rows: same tokens as spec-off
    spread: float | None = None  # off rows: (max - min) / mean of the off segments' tokens/s
    pair_ratios: list[float] = field(default_factory=list)  # on rows: on / off tokens/s of each back-to-back pair
    ratio_ci95: tuple[float, float] | None = None  # on rows: 95% confidence interval of on / off, from the pairs
    segment_tokens_per_s: list[float] = field(default_factory=list)
    outputs: dict[int, list[int]] = field(default_factory=dict, repr=False)  # request index -> tokens
    tpots: list[float] = field(default_factory=list, repr=False)


def request_lengths(new_tokens: int) -> tuple[int, int]:
    """(shortest, longest) max_new_tokens of the sweep's requests: half to one and a half times the mean."""
    return max(1, new_tokens // 2), max(1, new_tokens * 3 // 2)


def request_length(i: int, new_tokens: int) -> int:
    """Request i's max_new_tokens: uniform over request_lengths(new_tokens), seeded by i."""
    return random.Random(i).randint(*request_lengths(new_tokens))


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def _level(
    w,
    prompts,
    streams,
    new_tokens,
    pass_s,
    speculate,
    cost_ratio,
    state: SpeculationControl,
    costs: VerifyCostModel,
    clock: _SegmentClock | None = None,
) -> LevelRow:
    row = LevelRow(streams, "on (k=auto + policy)" if speculate else "off", new_tokens=new_tokens)
    pipeline, clients = _pipeline(w, cost_ratio, costs)
    spec = SpecParams(method="draft", k="auto") if speculate else SpecParams(method="none")
    if speculate:  # the policy's current decision applies from the first round, as in a running service
        state.apply(pipeline, cost_ratio, None)

    async def request(i: int) -> list[int]:
        prompt = prompts[i % len(prompts)]
        cut = (i // len(prompts)) % max(1, len(prompt) // 2)  # requests beyond the prompt count differ too
        prompt = prompt[: len(prompt) - cut]
        params = SamplingParams(max_new_tokens=request_length(i, new_tokens), stop_at_eos=False)
        req = pipeline.scheduler.add(prompt, params, spec, frozenset())
        start = last = time.perf_counter()
        prev = (0, 0)
        async for committed in pipeline.rounds(req):
            now, stats = time.perf_counter(), req.state.stats
            if now <= deadline:
                row.window_tokens += len(committed)
            elif clock is not None:
                clock.run(False)  # the streams are draining, a load no service sees: the switch neither times it ...
            if speculate:  # with speculation off there is no policy to run (the target's cost model still learns)
                # ... nor measures it, nor the streams' first requests: they all start at once, another transient
                if now <= deadline and i >= streams:
                    done = now - start if req.state.finished else None
                    drafted, accepted = stats.drafted - prev[0], stats.accepted - prev[1]
                    state.after_round(drafted, accepted, len(committed), now - last, done)
                state.apply(pipeline, cost_ratio, None)
            prev, last = (stats.drafted, stats.accepted), now
        row.tpots.append((time.perf_counter() - start) / max(1, len(req.state.generated)))
        return req.state.generated

    async def stream(s: int) -> None:
        r = 0
        while r == 0 or time.perf_counter() < deadline:
            row.outputs[s + streams * r] = await request(s + streams * r)
            r += 1

    t0 = time.perf_counter()
    deadline = t0 + pass_s
    await asyncio.gather(*(stream(s) for s in range(streams)))
    row.seconds = time.perf_counter() - t0
    await pipeline.drain_releases()
    for client in clients:
        await client.close()
    _finish_level(row, pipeline, pass_s, speculate)
    return row


def _pipeline(w, cost_ratio: float, costs: VerifyCostModel) -> tuple[Pipeline, list]:
    """A scheduler and its pipeline over fresh clients of the worker processes `w`; (pipeline, clients to close)."""
    drafts = {n: DraftClient(a, timeout_s=120) for n, a in w.draft_addresses.items()}
    targets = {n: TargetClient(a, timeout_s=120) for n, a in w.target_addresses.items()}
    scheduler = Scheduler(list(drafts), list(targets), cost_ratio=cost_ratio)
    # No drafting ahead (PEARL-style pre-drafts): both worker processes share this machine's cores, so a pre-draft
    # competes with the verification it overlaps (measured on 2 cores, 1 stream, k=4: 65 tok/s with, 93 without).
    pipeline = Pipeline(scheduler, drafts, targets, predraft=False, verify_costs=costs)
    return pipeline, [*drafts.values(), *targets.values()]


def _finish_level(row: LevelRow, pipeline: Pipeline, pass_s: float, speculate: bool) -> None:
    """Totals of a pass whose requests recorded their outputs, window tokens and seconds."""
    row.window_s = min(pass_s, row.seconds)
    row.requests = len(row.outputs)
    row.target_batch_mean = pipeline.mean_target_batch
    row.final_k_cap = pipeline.scheduler.auto_k_cap if speculate else None
    row.tokens = sum(len(o) for o in row.outputs.values())
    row.tokens_per_s = row.window_tokens / row.window_s if row.window_s > 0 else row.tokens / row.seconds


def _merge(segments: list[LevelRow]) -> LevelRow:
    """One mode's segments as one row: tokens and seconds summed, latencies pooled."""
    row = LevelRow(segments[0].streams, segments[0].speculation, new_tokens=segments[0].new_tokens)
    for seg in segments:
        row.tokens += seg.tokens
        row.seconds += seg.seconds
        row.window_tokens += seg.window_tokens
        row.window_s += seg.window_s
        row.requests += seg.requests
        row.tpots += seg.tpots
        row.outputs.update(seg.outputs)
        row.segment_tokens_per_s.append(seg.tokens_per_s)
    row.tokens_per_s = row.window_tokens / row.window_s
    row.tpot_ms_p50 = statistics.median(row.tpots) * 1e3
    row.tpot_ms_p99 = _percentile(row.tpots, 0.99) * 1e3
    row.target_batch_mean = statistics.fmean(seg.target_batch_mean for seg in segments)
    row.final_k_cap = segments[-1].final_k_cap
    return row


class _SegmentClock:
    """Monotonic time that advances only while running (the switch's clock: on segments only)."""

    def __init__(self):
        self._base, self._since = 0.0, None

    def __call__(self) -> float:
        return self._base + (time.monotonic() - self._since if self._since is not None else 0.0)

    def run(self, running: bool) -> None:
        if running and self._since is None:
            self._since = time.monotonic()
        elif not running and self._since is not None:
            self._base, self._since = self(), None


def concurrency_rows(
    target: ModelConfig,
    draft: ModelConfig,
    vocab: int,
    prompts: list[list[int]],
    new_tokens: int,
    cost_ratio: float,
    levels=LEVELS,
    progress: bool = True,
    settle_s: float = SETTLE_S,
    segment_s: float = SEGMENT_S,
    pairs: int = PAIRS,
) -> list[LevelRow]:
    from tqdm import tqdm

    rows: list[LevelRow] = []
    bar = tqdm(total=(1 + 2 * pairs) * len(levels), desc="concurrency sweep", disable=not progress)
    clock = _SegmentClock()
    state = SpeculationControl(switch=SpeculationSwitch(clock=clock))  # kept across levels, as in a service
    costs = VerifyCostModel()

    def run(streams: int, seconds: float, speculate: bool) -> LevelRow:
        clock.run(speculate)
        try:
            return asyncio.run(
                _level(w, prompts, streams, new_tokens, seconds, speculate, cost_ratio, state, costs, clock)
            )
        finally:
            clock.run(False)
            bar.update()

    with WorkerProcesses(target, draft, vocab, BatchingConfig(max_batch_size=max(levels))) as w:
        asyncio.run(_level(w, prompts, 2, 4, 0.0, True, cost_ratio, state, costs))  # warm-up: threads, gRPC, ...
        for streams in levels:
            # The policy settles at this load, unmeasured: its first probes here last a few request durations each
            # (longer while a mode's rate still moves), and turning speculation on waits for a window after the
            # probe; a pass of 15 s left them in the measured segments, 30 s did at 16 streams
            run(streams, settle_s, True)
            order = _segment_order(pairs)
            segments = [run(streams, segment_s, speculate) for speculate in order]
            off = _merge([seg for seg, spec in zip(segments, order, strict=True) if not spec])
            on = _merge([seg for seg, spec in zip(segments, order, strict=True) if spec])
            off.spread = (max(off.segment_tokens_per_s) - min(off.segment_tokens_per_s)) / off.tokens_per_s
            on.pair_ratios = [on_seg.tokens_per_s / off_seg.tokens_per_s for on_seg, off_seg in _pairs(segments, order)]
            on.ratio_ci95 = ratio_ci95(on.pair_ratios)
            common = on.outputs.keys() & off.outputs.keys()
            on.identical = bool(common) and all(on.outputs[i] == off.outputs[i] for i in common)
            rows += [off, on]
    bar.close()
    return rows


def _pairs(segments: list[LevelRow], order: list[bool]) -> list[tuple[LevelRow, LevelRow]]:
    """(on, off) segment of each back-to-back pair."""
    return [
        (segments[i], segments[i + 1]) if order[i] else (segments[i + 1], segments[i])
        for i in range(0, len(segments), 2)
    ]


def format_levels(rows: list[LevelRow]) -> str:
    head = ["streams", "requests", "speculation", "agg tok/s", "on/off", "95% CI", "spread", "TPOT p50 ms",
            "TPOT p99 ms", "target batch", "k cap", "identical"]  # fmt: skip
    lines = [head]
    off = {r.streams: r for r in rows if r.speculation == "off"}
    for r in rows:
        ratio = r.tokens_per_s / off[r.streams].tokens_per_s
        lines.append([
            str(r.streams), str(r.requests), r.speculation, f"{r.tokens_per_s:.1f}", f"{ratio:.2f}x",
            "-" if r.ratio_ci95 is None else f"{r.ratio_ci95[0]:.2f}-{r.ratio_ci95[1]:.2f}",
            "-" if r.spread is None else f"{r.spread:.0%}",
            f"{r.tpot_ms_p50:.1f}", f"{r.tpot_ms_p99:.1f}", f"{r.target_batch_mean:.1f}",
            "-" if r.final_k_cap is None else str(r.final_k_cap),
            "-" if r.identical is None else ("yes" if r.identical else "NO"),
        ])  # fmt: skip
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    out = ["| " + " | ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=True)) + " |" for line in lines]
    out.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(out)


def levels_json(rows: list[LevelRow]) -> list[dict]:
    out = []
    for r in rows:
        d = asdict(r)
        d.pop("outputs")
        d.pop("tpots")
        out.append(d)
    return out


def plot_levels(rows: list[LevelRow], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    for mode, style in (("off", "s--"), ("on (k=auto + policy)", "o-")):
        sel = [r for r in rows if r.speculation == mode]
        xs = [r.streams for r in sel]
        ax1.plot(xs, [r.tokens_per_s for r in sel], style, label=f"speculation {mode}")
        ax2.plot(xs, [r.tpot_ms_p50 for r in sel], style, label=f"{mode} p50")
        ax2.plot(xs, [r.tpot_ms_p99 for r in sel], style, alpha=0.4, label=f"{mode} p99")
    for ax in (ax1, ax2):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent streams")
        ax.legend()
    ax1.set_ylabel("aggregate tokens/s")
    ax2.set_ylabel("ms per output token")
    fig.suptitle("specserve bench: concurrency sweep (continuous batching, greedy)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
