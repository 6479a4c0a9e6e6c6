"""The concurrency sweep of `specserve bench`: 1, 4, 16, 32 concurrent greedy streams through the disaggregated
workers (a target and a draft worker process, each behind its gRPC server, continuous batching on both; this process
runs the scheduler), speculation on (k='auto' under the load-aware speculation policy, as the Serve app runs it) vs
off, measured side by side in one run.

The policy's state (acceptance, the target's fitted step cost, the measured switch) is kept across levels, as a
running service keeps it while its load changes, and each level first runs once unmeasured with the policy live:
the rows are what a service that has been at that load for a few seconds delivers. A stream is a closed loop: it
sends its next request (new_tokens long) when the last one finished, until the level has generated at least
`LEVEL_TOKENS_PER_NEW_TOKEN` x new_tokens tokens in all, so every level runs long enough for the switch's probes to be
a small part of it."""

from __future__ import annotations

import asyncio
import math
import statistics
import time
from dataclasses import asdict, dataclass, field

from specserve.cluster.pipeline import Pipeline
from specserve.cluster.policies import SpeculationControl, VerifyCostModel
from specserve.cluster.scheduler import Scheduler
from specserve.cluster.worker_clients import DraftClient, TargetClient
from specserve.cluster.worker_processes import WorkerProcesses
from specserve.workers.config import BatchingConfig, ModelConfig, SamplingParams, SpecParams

LEVELS = (1, 4, 16, 32)
LEVEL_TOKENS_PER_NEW_TOKEN = 32


@dataclass
class LevelRow:
    streams: int
    speculation: str  # "on (k=auto + policy)" | "off"
    requests: int = 0  # in all (each stream sends the next when its last one finished)
    tokens: int = 0
    seconds: float = 0.0
    tokens_per_s: float = 0.0  # aggregate over all streams
    tpot_ms_p50: float = 0.0  # per-token latency: a request's time over its generated tokens
    tpot_ms_p99: float = 0.0
    target_batch_mean: float = 0.0  # requests per target forward pass
    final_k_cap: int | None = None  # the policy's k at the end (0: speculation turned off)
    identical: bool | None = None  # spec-on rows: same tokens as spec-off
    outputs: list[list[int]] = field(default_factory=list, repr=False)


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def _level(
    w,
    prompts,
    streams,
    new_tokens,
    requests_per_stream,
    speculate,
    cost_ratio,
    state: SpeculationControl,
    costs: VerifyCostModel,
) -> LevelRow:
    row = LevelRow(streams, "on (k=auto + policy)" if speculate else "off", streams * requests_per_stream)
    drafts = {n: DraftClient(a, timeout_s=120) for n, a in w.draft_addresses.items()}
    targets = {n: TargetClient(a, timeout_s=120) for n, a in w.target_addresses.items()}
    scheduler = Scheduler(list(drafts), list(targets), cost_ratio=cost_ratio)
    # No drafting ahead (PEARL-style pre-drafts): both worker processes share this machine's cores, so a pre-draft
    # competes with the verification it overlaps (measured on 2 cores, 1 stream, k=4: 65 tok/s with, 93 without).
    pipeline = Pipeline(scheduler, drafts, targets, predraft=False, verify_costs=costs)
    params = SamplingParams(max_new_tokens=new_tokens, stop_at_eos=False)
    spec = SpecParams(method="draft", k="auto") if speculate else SpecParams(method="none")
    tpot: list[float] = []
    if speculate:  # the policy's current decision applies from the first round, as in a running service
        state.apply(pipeline, cost_ratio, None)

    async def request(i: int) -> list[int]:
        prompt = prompts[i % len(prompts)]
        prompt = prompt[: len(prompt) - i // len(prompts)]  # requests beyond the prompt count differ too
        req = pipeline.scheduler.add(prompt, params, spec, frozenset())
        start = last = time.perf_counter()
        prev, first = (0, 0), True
        async for committed in pipeline.rounds(req):
            now, stats = time.perf_counter(), req.state.stats
            if speculate:  # with speculation off there is no policy to run (the target's cost model still learns)
                state.after_round(stats.drafted - prev[0], stats.accepted - prev[1], len(committed), now - last,
                                  first)  # fmt: skip
                state.apply(pipeline, cost_ratio, None)
            prev, last, first = (stats.drafted, stats.accepted), now, False
        tpot.append((time.perf_counter() - start) / max(1, len(req.state.generated)))
        return req.state.generated

    async def stream(s: int) -> list[list[int]]:
        return [await request(s + streams * r) for r in range(requests_per_stream)]

    t0 = time.perf_counter()
    row.outputs = [out for outs in await asyncio.gather(*(stream(s) for s in range(streams))) for out in outs]
    row.seconds = time.perf_counter() - t0
    row.target_batch_mean = pipeline.mean_target_batch
    row.final_k_cap = pipeline.scheduler.auto_k_cap if speculate else None
    for client in (*drafts.values(), *targets.values()):
        await client.close()
    row.tokens = sum(len(o) for o in row.outputs)
    row.tokens_per_s = row.tokens / row.seconds
    row.tpot_ms_p50 = statistics.median(tpot) * 1e3
    row.tpot_ms_p99 = _percentile(tpot, 0.99) * 1e3
    return row


def concurrency_rows(
    target: ModelConfig,
    draft: ModelConfig,
    vocab: int,
    prompts: list[list[int]],
    new_tokens: int,
    cost_ratio: float,
    levels=LEVELS,
    progress: bool = True,
) -> list[LevelRow]:
    from tqdm import tqdm

    rows: list[LevelRow] = []
    bar = tqdm(total=3 * len(levels), desc="concurrency sweep", disable=not progress)
    state, costs = SpeculationControl(), VerifyCostModel()  # kept across levels, as in a running service
    with WorkerProcesses(target, draft, vocab, BatchingConfig(max_batch_size=max(levels))) as w:
        asyncio.run(_level(w, prompts, 2, 4, 1, True, cost_ratio, state, costs))  # warm-up: threads, allocator, gRPC
        for streams in levels:
            n = math.ceil(LEVEL_TOKENS_PER_NEW_TOKEN / streams)  # requests per stream
            asyncio.run(_level(w, prompts, streams, new_tokens, n, True, cost_ratio, state, costs))  # policy settles
            bar.update()
            off = asyncio.run(_level(w, prompts, streams, new_tokens, n, False, cost_ratio, state, costs))
            bar.update()
            on = asyncio.run(_level(w, prompts, streams, new_tokens, n, True, cost_ratio, state, costs))
            bar.update()
            on.identical = on.outputs == off.outputs
            rows += [off, on]
    bar.close()
    return rows


def format_levels(rows: list[LevelRow]) -> str:
    head = ["streams", "requests", "speculation", "agg tok/s", "on/off", "TPOT p50 ms", "TPOT p99 ms",
            "target batch", "k cap", "identical"]  # fmt: skip
    lines = [head]
    off = {r.streams: r for r in rows if r.speculation == "off"}
    for r in rows:
        ratio = r.tokens_per_s / off[r.streams].tokens_per_s
        lines.append([
            str(r.streams), str(r.requests), r.speculation, f"{r.tokens_per_s:.1f}", f"{ratio:.2f}x",
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
