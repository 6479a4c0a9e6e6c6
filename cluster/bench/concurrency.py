"""The served load bench of `specserve bench --load` (alias --concurrency): the Serve application a user starts with
`specserve serve` (the bench's target, its default drafting and default k), driven through the public gRPC client by
closed-loop streams at 1, 2, 4, 8 and 16, the model's default speculation against speculation off
(`method: none`) on the same server, measured side by side in one run. Every figure at N streams is compared with
speculation off at N streams through the same path, never with one stream: plain decoding batches too (4 streams of
it ran at 2.7x one stream's rate on 2 cores), and dividing by one stream would count that batching as speculation.

A stream is a closed loop: it sends its next request when the last one finished. Requests ask for new_tokens on
average, each a different length between half and one and a half times that (fixed per request index, as is its
prompt, so every mode runs the same requests): with equal lengths, plain decoding's streams ran in lockstep, all
prefilling together and all decoding in one batch, a best case for it that independent arrivals never give (measured
at 16 streams: 0.89x that throughput once the same streams were out of step).

Each level first runs a `settle_s` pass of the default mode, unmeasured (the server's planner sees this load for a
while, as a service at that load has), then `pairs` pairs of an off and a default segment, `segment_s` seconds
apiece, in Thue-Morse order (off on, on off, on off, off on, ...: so that this machine's slow phases land on both
modes alike, and a steady drift of its speed, which ABAB order charges to the later mode, cancels out). At
`fixed_k_levels` each round of pairs also runs, for its first `fixed_k_pairs` rounds, a pair of off and the default
method at each fixed k, so the default can be judged against the best fixed k of the same run (`judge_k`: straight
from the two modes' segments of each round, not through off). A segment ends when
its streams finish the requests they started in time, but its throughput counts only the tokens that arrived within
its `segment_s` window, at steady load (not while the streams drain). The two segments of a pair ran back to back, so
their ratio is nearly free of the machine's slower swings: `ratio_ci95` is a 95% confidence interval of a mode's
ratio to off from its pairs' ratios (a t-interval of their logs), what "default >= off" can honestly be judged by on a
noisy machine. `spread` is how much the off segments' throughputs differ from each other (max - min over mean): the
noise floor of the ratios. `identical`: every request a mode and off both ran (same index) gave the same tokens,
every time (greedy)."""

from __future__ import annotations

import math
import random
import statistics
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field

from specserve.cluster.bench.burst import BurstRow
from specserve.cluster.bench.serve import MODEL as BENCH_MODEL
from specserve.cluster.bench.serve import round_accounting
from specserve.cluster.scheduling.round_times import per_round_ms

OFF, DEFAULT = "off", "default"
# Two-sided 95% quantiles of Student's t by degrees of freedom (1-15)
_T95 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131)


@dataclass(frozen=True)
class LoadConfig:
    levels: tuple[int, ...] = (1, 2, 4, 8, 16)  # concurrent streams
    fixed_k_levels: tuple[int, ...] = (1, 4)  # where the default method also runs at each of fixed_ks
    fixed_ks: tuple[int, ...] = (1, 2, 3, 4)
    pairs: int = 8  # off/default pairs per level (4 or 8: Thue-Morse order balances them)
    fixed_k_pairs: int = 4  # off/fixed-k pairs per level and k
    segment_s: float = 7.5
    settle_s: float = 10.0
    new_tokens: int = 32  # max_new_tokens per request, on average (see request_length)
    burst: int = 512  # then this many requests at once, new_tokens each (burst.py); 0: none


# For SmolLM2-135M on 2 cores the full run takes ~25-30 min (the drains at 16 streams are long), this one ~5 min.
QUICK_LOAD = LoadConfig(pairs=2, fixed_k_pairs=2, segment_s=4.0, settle_s=4.0, new_tokens=16, burst=256)


def _segment_order(pairs: int) -> list[bool]:
    """Off (False) and on (True) segments, pairs in Thue-Morse order (AB BA BA AB ...): with 4 or 8 pairs each
    mode's mean position is the same, so a linear drift of the machine's speed favours neither."""
    order: list[bool] = []
    for i in range(pairs):
        order += [False, True] if bin(i).count("1") % 2 == 0 else [True, False]
    return order


def ratio_ci95(ratios: list[float]) -> tuple[float, float] | None:
    """95% confidence interval of the on/off ratio from paired segments' ratios (a t-interval of their logs; None
    for fewer than 2 pairs, or a pair without an off token to divide by)."""
    if len(ratios) < 2 or not all(r > 0 for r in ratios):
        return None
    logs = [math.log(r) for r in ratios]
    half = _T95[min(len(logs) - 1, len(_T95)) - 1] * statistics.stdev(logs) / math.sqrt(len(logs))
    mean = statistics.fmean(logs)
    return math.exp(mean - half), math.exp(mean + half)


def request_lengths(new_tokens: int) -> tuple[int, int]:
    """(shortest, longest) max_new_tokens of the bench's requests: half to one and a half times the mean."""
    return max(1, new_tokens // 2), max(1, new_tokens * 3 // 2)


def request_length(i: int, new_tokens: int) -> int:
    """Request i's max_new_tokens: uniform over request_lengths(new_tokens), seeded by i."""
    return random.Random(i).randint(*request_lengths(new_tokens))


def mode_speculation(mode: str) -> dict:
    """The client's speculation arguments of a mode: none for the default (the request leaves speculation unset, so
    the model's default method and k apply), method 'none' for off, k alone (the default method) for 'k=N'."""
    if mode == DEFAULT:
        return {}
    if mode == OFF:
        return {"method": "none"}
    return {"k": int(mode.removeprefix("k="))}


@dataclass
class Request:
    index: int
    token_ids: list[int]
    ttft_s: float  # until the first chunk with tokens
    tpot_s: float | None  # (end - first token) / (tokens - 1); None for one token
    window_tokens: int  # tokens that arrived within the segment's window
    rounds: int


@dataclass
class Segment:
    mode: str
    window_s: float
    requests: list[Request]
    accounting: tuple[dict, dict] | None = None  # the scheduler's round accounting before and after it

    @property
    def tokens_per_s(self) -> float:
        return sum(r.window_tokens for r in self.requests) / self.window_s


@dataclass
class LevelRow:
    streams: int
    speculation: str  # "off" | "default" | "k=N"
    requests: int = 0  # in all (each stream sends the next when its last one finished)
    tokens: int = 0  # every request's tokens, those finishing after the windows included
    window_tokens: int = 0  # tokens that arrived within the measured windows
    window_s: float = 0.0
    tokens_per_s: float = 0.0  # aggregate over all streams, within the windows (steady load, no drain)
    vs_off: float | None = None  # tokens_per_s over that of the off segments paired with this mode's, same streams
    pair_ratios: list[float] = field(default_factory=list)  # this mode / off of each back-to-back pair
    ratio_ci95: tuple[float, float] | None = None  # 95% confidence interval of vs_off, from the pairs
    spread: float | None = None  # off rows: (max - min) / mean of the off segments' tokens/s
    # The default row, where fixed k's ran: default / the fixed k it fares worst against, paired by round (judge_k)
    vs_best_fixed_k: float | None = None
    vs_best_fixed_k_ci95: tuple[float, float] | None = None
    best_fixed_k: str | None = None
    ttft_ms_p50: float = 0.0
    ttft_ms_p99: float = 0.0
    tpot_ms_p50: float = 0.0
    tpot_ms_p99: float = 0.0
    tokens_per_round: float = 0.0  # tokens committed per verify round (1.0: nothing drafted was accepted)
    round_ms: dict[str, float] = field(default_factory=dict)  # each part's mean a round (round_times.py)
    identical: bool | None = None  # speculative rows: every request off ran too gave off's tokens
    identical_share: float | None = None  # of those requests, the share that did (bf16 on a GPU: near-ties flip)
    segment_tokens_per_s: list[float] = field(default_factory=list)
    outputs: dict[int, set[tuple[int, ...]]] = field(default_factory=dict, repr=False)  # request index -> outputs


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def _row(streams: int, mode: str, segments: list[Segment]) -> LevelRow:
    """One mode's segments as one row: window tokens and seconds summed, latencies pooled."""
    row = LevelRow(streams, mode, segment_tokens_per_s=[s.tokens_per_s for s in segments])
    row.round_ms = per_round_ms([s.accounting for s in segments if s.accounting is not None])
    requests = [r for s in segments for r in s.requests]
    row.requests = len(requests)
    row.tokens = sum(len(r.token_ids) for r in requests)
    row.window_tokens = sum(r.window_tokens for r in requests)
    row.window_s = sum(s.window_s for s in segments)
    row.tokens_per_s = row.window_tokens / row.window_s
    ttfts, tpots = [r.ttft_s for r in requests], [r.tpot_s for r in requests if r.tpot_s is not None]
    row.ttft_ms_p50, row.ttft_ms_p99 = statistics.median(ttfts) * 1e3, _percentile(ttfts, 0.99) * 1e3
    row.tpot_ms_p50 = statistics.median(tpots) * 1e3 if tpots else 0.0
    row.tpot_ms_p99 = _percentile(tpots, 0.99) * 1e3
    row.tokens_per_round = row.tokens / max(1, sum(r.rounds for r in requests))
    for r in requests:
        row.outputs.setdefault(r.index, set()).add(tuple(r.token_ids))
    return row


def compare(row: LevelRow, pairs: list[tuple[Segment, Segment]], off: LevelRow) -> None:
    """Fill a speculative row's comparison with off at its streams: `pairs` are its (mode, off) segment pairs, `off`
    all the level's off segments (whose outputs it is checked against)."""
    paired_off = _row(row.streams, OFF, [o for _, o in pairs])
    row.vs_off = row.tokens_per_s / paired_off.tokens_per_s if paired_off.tokens_per_s > 0 else None
    row.pair_ratios = [m.tokens_per_s / o.tokens_per_s if o.tokens_per_s > 0 else math.nan for m, o in pairs]
    row.ratio_ci95 = ratio_ci95(row.pair_ratios)
    same = [len(row.outputs[i] | off.outputs[i]) == 1 for i in row.outputs.keys() & off.outputs.keys()]
    row.identical = bool(same) and all(same)
    row.identical_share = sum(same) / len(same) if same else None


def judge_k(default: LevelRow, pairs: dict[str, list[tuple[Segment, Segment]]]) -> None:
    """The default against each fixed k straight from their own segments, not through off: round i of pairs runs
    the default's pair and then each k's, so the default's segment of round i and a k's are minutes apart at most,
    and their ratio carries neither off segment's noise (a ratio of two modes' ratios to off carried both: at one
    stream the default ran 13.6 tok/s to k = 8's 13.0, yet 0.91 of it by the ratios, off's segments 46% apart).
    Per k the geometric mean of default / k over the rounds both ran; the row keeps the k it fares worst against,
    with that ratio's 95% CI (ratio_ci95 of the rounds' ratios)."""
    worst = None
    for mode, runs in pairs.items():
        if mode == DEFAULT:
            continue
        ratios = [d.tokens_per_s / k.tokens_per_s for (d, _), (k, _) in zip(pairs[DEFAULT], runs, strict=False)
                  if d.tokens_per_s > 0 and k.tokens_per_s > 0]  # fmt: skip
        if not ratios:
            continue
        mean = math.exp(statistics.fmean(math.log(r) for r in ratios))
        if worst is None or mean < worst[1]:
            worst = (mode, mean, ratio_ci95(ratios))
    if worst is not None:
        default.best_fixed_k, default.vs_best_fixed_k, default.vs_best_fixed_k_ci95 = worst


def _request(client, prompts: list[list[int]], i: int, mode: str, new_tokens: int, deadline: float) -> Request:
    """Request i, streamed: its prompt and length fixed by i, greedy."""
    tokens: list[int] = []
    window, first, rounds = 0, None, 0
    start = time.perf_counter()
    chunks = client.generate_stream(prompts[i % len(prompts)], max_new_tokens=request_length(i, new_tokens),
                                    temperature=0.0, **mode_speculation(mode))  # fmt: skip
    for chunk in chunks:
        now = time.perf_counter()
        if chunk["token_ids"] and first is None:
            first = now
        tokens += chunk["token_ids"]
        window += len(chunk["token_ids"]) if now <= deadline else 0
        rounds = chunk["stats"]["rounds"]
    end = time.perf_counter()
    first = end if first is None else first
    tpot = (end - first) / (len(tokens) - 1) if len(tokens) > 1 else None
    return Request(i, tokens, first - start, tpot, window, rounds)


def _segment(client, prompts: list[list[int]], streams: int, mode: str, seconds: float, new_tokens: int) -> Segment:
    """`streams` closed loops for `seconds` (and the requests they started in time): request s + streams * r is
    stream s's r-th, so every segment of every mode runs the same requests."""
    deadline = time.perf_counter() + seconds

    def stream(s: int) -> list[Request]:
        done: list[Request] = []
        while not done or time.perf_counter() < deadline:
            done.append(_request(client, prompts, s + streams * len(done), mode, new_tokens, deadline))
        return done

    with ThreadPoolExecutor(streams) as pool:
        requests = [r for done in pool.map(stream, range(streams)) for r in done]
    return Segment(mode, seconds, requests)


def _modes(cfg: LoadConfig, streams: int) -> list[str]:
    return [DEFAULT] + ([f"k={k}" for k in cfg.fixed_ks] if streams in cfg.fixed_k_levels else [])


def segment_count(cfg: LoadConfig) -> int:
    """Segments of a run, the settle passes included (the progress bar's total)."""
    fixed = min(cfg.pairs, cfg.fixed_k_pairs) * len(cfg.fixed_ks) * sum(s in cfg.fixed_k_levels for s in cfg.levels)
    return len(cfg.levels) * (1 + 2 * cfg.pairs) + 2 * fixed


def _level(client, prompts: list[list[int]], streams: int, cfg: LoadConfig, bar) -> list[LevelRow]:
    """The rows of one level: off, the default, and the fixed k's where they run."""

    def run(mode: str, seconds: float) -> Segment:
        before = round_accounting()
        seg = _segment(client, prompts, streams, mode, seconds, cfg.new_tokens)
        seg.accounting = (before, round_accounting()) if before is not None else None
        bar.update()
        return seg

    run(DEFAULT, cfg.settle_s)
    order = _segment_order(cfg.pairs)
    pairs: dict[str, list[tuple[Segment, Segment]]] = {mode: [] for mode in _modes(cfg, streams)}
    for i in range(cfg.pairs):
        for mode in pairs if i < cfg.fixed_k_pairs else [DEFAULT]:
            first, second = (mode, OFF) if order[2 * i] else (OFF, mode)
            a, b = run(first, cfg.segment_s), run(second, cfg.segment_s)
            pairs[mode].append((a, b) if first == mode else (b, a))
    off = _row(streams, OFF, [o for runs in pairs.values() for _, o in runs])
    off.spread = (max(off.segment_tokens_per_s) - min(off.segment_tokens_per_s)) / off.tokens_per_s
    rows = [off]
    for mode, runs in pairs.items():
        rows.append(_row(streams, mode, [m for m, _ in runs]))
        compare(rows[-1], runs, off)
    judge_k(rows[1], pairs)
    return rows


def bench_app(target: str, draft: str | None, device: str, dtype: str, **fields) -> dict:
    """The Serve config of the bench: `target` with `draft` (None: the model's default drafting, as `specserve
    serve` has it), its default k and `fields` (enforce_eager ...); small CPU reservations, so it starts on 2 cores."""
    from specserve.cluster.app_config import AppConfig, serve_config
    from specserve.workers.service.local_processes import free_port

    pool = {"num_cpus": 0.5}
    model = {"name": BENCH_MODEL, "target": target, "device": device, "dtype": dtype, "target_pool": pool,
             "draft_pool": pool, **({"draft": draft} if draft else {}), **fields}  # fmt: skip
    app = AppConfig.model_validate({"models": [model], "scheduler": {"num_cpus": 0.5}, "auth": {"api_key_env": None}})
    return serve_config(app, grpc_port=free_port(), http_port=free_port())


def load_rows(
    target: str,
    draft: str | None,
    prompts: list[list[int]],
    cfg: LoadConfig = LoadConfig(),
    device: str = "auto",
    dtype: str = "float32",
    progress: bool = True,
    then: Callable[..., None] | None = None,
    fields: dict | None = None,  # more of the model's settings (bench_app)
) -> tuple[list[LevelRow], str, BurstRow | None]:
    """Start the Serve application (and a Ray, unless one is connected), run every level, then the burst (and
    `then`, with the client, while the app still runs), stop them; returns (rows, the drafting the model was served
    with, the burst's row or None)."""
    from tqdm import tqdm

    from specserve.client import SpecServeClient
    from specserve.cluster.bench.burst import run_burst
    from specserve.cluster.serve.server import start, stop

    config = bench_app(target, draft, device, dtype, **(fields or {}))
    drafting = config["applications"][0]["args"]["models"][0]["draft"]
    info = start(config, ready_timeout_s=1800)
    try:
        with SpecServeClient(info["grpc"], timeout_s=600) as client:
            for mode in dict.fromkeys(m for s in cfg.levels for m in (OFF, *_modes(cfg, s))):  # first calls: warm-up
                _request(client, prompts, 0, mode, 4, math.inf)
            with tqdm(total=segment_count(cfg), desc="load bench", unit="segment", disable=not progress,
                      file=sys.stderr) as bar:  # fmt: skip
                rows = [row for streams in cfg.levels for row in _level(client, prompts, streams, cfg, bar)]
            burst = run_burst(info["grpc"], info["http"], prompts, cfg.burst, cfg.new_tokens) if cfg.burst else None
            if then is not None:
                then(client)
    finally:
        stop(info)
    return rows, drafting, burst


def load_meta(rows: list[LevelRow], cfg: LoadConfig, drafting: str, tax: dict | None = None,
              burst: BurstRow | None = None) -> dict:  # fmt: skip
    """The bench's JSON entry: the run's settings, the levels, and the orchestration tax (cluster/bench/
    orchestration.py: served speculation-off at one stream beside in-process target-only decoding) when measured."""
    off_1 = next((r.tokens_per_s for r in rows if r.streams == 1 and r.speculation == OFF), None)
    return {
        "drafting": drafting,
        "config": asdict(cfg),
        "served_off_1_stream_tok_s": off_1,
        "orchestration": tax,
        "levels": levels_json(rows),
        "burst": burst.to_dict() if burst is not None else None,
    }


def levels_json(rows: list[LevelRow]) -> list[dict]:
    out = []
    for r in rows:
        d = asdict(r)
        d.pop("outputs")
        d["pair_ratios"] = [None if math.isnan(x) else x for x in r.pair_ratios]  # JSON has no NaN
        out.append(d)
    return out
