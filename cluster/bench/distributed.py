"""The disaggregated rows of `specserve bench`: the same prompts through the Serve application (cluster/bench/serve.py),
placed next to the in-process row they compare with. With an EAGLE-3 head, its methods' rows: the head on its own
draft worker process, the target on another, this process scheduling (`add_eagle_distributed`; WorkerProcesses, which
goes when these rows move onto the Serve app: docs/architecture.md, one path per job)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from specserve.cluster.bench.rows import SAMPLED_NGRAM_K, BenchConfig, Row, best_draft_k
from specserve.cluster.bench.serve import serve_rows
from specserve.cluster.bench.timing import RoundCounts, finish_stream_rows
from specserve.cluster.scheduling.features import FeatureTraffic
from specserve.workers.config import BatchingConfig, ModelConfig, SamplingParams, SpecParams
from specserve.workers.speculation.methods import HEAD_CHAIN_METHODS, TREE_METHODS

EAGLE_STREAMS = 6  # a head's disaggregated rows: 1 stream, and this many at once (issue 36's comparison)


def add_distributed(rows: list[Row], meta: dict, target_path: str, draft_path: str | None, prompts: list[list[int]],
                    cfg: BenchConfig, device: str) -> None:  # fmt: skip
    """The disaggregated rows through the Serve app (cluster/bench/serve.py), next to the in-process row they compare
    with (draft k=4, or n-gram k=4): its draft and target pools over gRPC, driven by its scheduler replica."""
    method, k = ("draft", best_draft_k(cfg)) if draft_path else ("ngram", SAMPLED_NGRAM_K)
    in_process = next(r for r in rows if r.method == method and r.k == k and r.temperature == 0)
    # A Serve model whose draft is 'ngram' drafts by prompt lookup by default
    served, status = serve_rows(target_path, draft_path or "ngram", prompts, cfg, k, device, rows[0])
    if not draft_path:
        for row in served:
            row.name = row.name.replace(f"k={k}", f"ngram k={k}", 1)
    at = rows.index(in_process) + 1
    rows[at:at] = served
    meta["disaggregated"] = {
        "vs_in_process_1_stream": served[0].tokens_per_s / in_process.tokens_per_s,
        "vs_in_process_all_streams": served[1].tokens_per_s / in_process.tokens_per_s,
        "orchestration_ms_p50": status["orchestration_ms_p50"],
        "wire_bytes_per_round": status["wire_bytes_per_round"],
    }


@dataclass
class EagleTraffic:
    """What crossed the wire in one method's disaggregated head rows (warm-up excluded)."""

    rounds: int = 0
    wire_bytes: int = 0  # every call's request and reply, features included
    orchestration_ms_p50: float = 0.0
    features: FeatureTraffic = field(default_factory=FeatureTraffic)

    @property
    def feature_bytes_per_round(self) -> float:
        """Feature bytes a round moves: those its verify reply carries to the scheduler and its propose call on."""
        return (self.features.received_bytes + self.features.sent_bytes) / max(1, self.rounds)


@dataclass
class HeadRows:
    """One head method's disaggregated rows: one stream, and several at once."""

    method: str
    k: int
    one: Row
    many: Row
    traffic: EagleTraffic


def eagle_rows(target: ModelConfig, head_dir: str, vocab: int, prompts: list[list[int]], cfg: BenchConfig,
               ks: dict[str, int], base: Row, streams: int = EAGLE_STREAMS) -> list[HeadRows]:  # fmt: skip
    """Each head method at its k (`ks`: method -> k) with the head on its own draft worker process and the target on
    another (WorkerProcesses: gRPC servers, continuous batching on both), this process scheduling: one stream (the
    prompts one after another) and `streams` streams at once (closed loops taking the next prompt), greedy."""
    from specserve.cluster.pools.worker_processes import WorkerProcesses

    streams = min(streams, len(prompts))
    with WorkerProcesses(target, target, vocab, BatchingConfig(), eagle_head=head_dir) as w:
        return [
            asyncio.run(
                _head_streams(w, target.path, head_dir, prompts, cfg, SpecParams(method=method, k=k), streams, base)
            )
            for method, k in ks.items()
        ]


async def _head_streams(w, target_path: str, head: str, prompts: list[list[int]], cfg: BenchConfig, spec: SpecParams,
                        streams: int, base: Row) -> HeadRows:  # fmt: skip
    from transformers import AutoTokenizer

    from specserve.cluster.scheduling.pipeline import build_pipeline
    from specserve.cluster.scheduling.worker_clients import DraftClient, TargetClient
    from specserve.workers.runtime.eos import directory_eos_ids

    eos = directory_eos_ids(target_path, AutoTokenizer.from_pretrained(target_path, local_files_only=True))
    drafts = {n: DraftClient(a, timeout_s=600) for n, a in w.draft_addresses.items()}
    targets = {n: TargetClient(a, timeout_s=600) for n, a in w.target_addresses.items()}
    try:
        warm_up = build_pipeline(drafts, targets, head)
        await warm_up.generate(prompts[0][:16], SamplingParams(max_new_tokens=4), spec, eos)
        await warm_up.drain_releases()
        wire0 = warm_up.wire_bytes()  # the clients count from their start
        pipeline = build_pipeline(drafts, targets, head)

        async def generate(prompt: list[int], counts: RoundCounts) -> list[int]:
            req = await pipeline.generate(prompt, SamplingParams(max_new_tokens=cfg.max_new_tokens), spec, eos)
            counts.add(req.state.stats)
            return req.state.generated

        name = f"disaggregated {spec.method} k={spec.k} greedy"
        one = Row(f"{name}, 1 stream", "disaggregated", spec.k, 0.0)
        many = Row(f"{name}, {streams} streams", "disaggregated", spec.k, 0.0, streams=streams)
        await _one_stream(generate, prompts, one)
        await _streams_at_once(generate, prompts, many, streams)
        await pipeline.drain_releases()
    finally:
        for client in (*drafts.values(), *targets.values()):
            await client.close()
    traffic = EagleTraffic(pipeline.times.rounds, pipeline.wire_bytes() - wire0, pipeline.times.p50_ms(),
                           pipeline.scheduler.feature_traffic)  # fmt: skip
    finish_stream_rows([one, many], base)
    return HeadRows(spec.method, spec.k, one, many, traffic)


async def _one_stream(generate, prompts: list[list[int]], row: Row) -> None:
    counts = RoundCounts()
    for prompt in prompts:
        t0 = time.perf_counter()
        row.outputs.append(await generate(prompt, counts))
        row.seconds += time.perf_counter() - t0
    _fill_acceptance(row, counts)


async def _streams_at_once(generate, prompts: list[list[int]], row: Row, streams: int) -> None:
    """`streams` closed loops, each sending the next prompt when its last request finished."""
    counts = RoundCounts()
    row.outputs = [[] for _ in prompts]
    waiting = list(range(len(prompts)))

    async def stream() -> None:
        while waiting:
            i = waiting.pop(0)
            row.outputs[i] = await generate(prompts[i], counts)

    t0 = time.perf_counter()
    await asyncio.gather(*(stream() for _ in range(streams)))
    row.seconds = time.perf_counter() - t0
    _fill_acceptance(row, counts)


def _fill_acceptance(row: Row, counts: RoundCounts) -> None:
    row.acceptance_rate = counts.accepted / counts.drafted if counts.drafted else 0.0
    row.mean_accepted_length = 1 + counts.accepted / max(1, counts.rounds)
    row.acceptance_by_position = counts.by_position()


def add_eagle_distributed(rows: list[Row], meta: dict, target: ModelConfig, head_dir: str, vocab: int,
                          prompts: list[list[int]], cfg: BenchConfig) -> None:  # fmt: skip
    """Each head method's disaggregated rows, after its in-process greedy row at the best fixed k (by tokens/s),
    which they compare with as the draft model's disaggregated rows do with theirs: the in-process engine runs one
    request at a time, so its rate is the same for 1 stream and for the streams' requests one after another."""
    in_process = {}
    for method in (*HEAD_CHAIN_METHODS, *TREE_METHODS):
        greedy = [r for r in rows if r.method == method and r.temperature == 0 and isinstance(r.k, int)]
        if greedy:
            in_process[method] = max(greedy, key=lambda r: r.tokens_per_s)
    runs = eagle_rows(target, head_dir, vocab, prompts, cfg, {m: r.k for m, r in in_process.items()}, rows[0])
    meta["disaggregated_eagle"] = {}
    for run in runs:
        beside = in_process[run.method]
        at = rows.index(beside) + 1
        rows[at:at] = [run.one, run.many]
        meta["disaggregated_eagle"][run.method] = {
            "k": run.k,
            "streams": min(EAGLE_STREAMS, len(prompts)),
            "vs_in_process_1_stream": run.one.tokens_per_s / beside.tokens_per_s,
            "vs_in_process_streams": run.many.tokens_per_s / beside.tokens_per_s,
            "orchestration_ms_p50": run.traffic.orchestration_ms_p50,
            "wire_bytes_per_round": run.traffic.wire_bytes / max(1, run.traffic.rounds),
            "feature_bytes_per_round": run.traffic.feature_bytes_per_round,
            **run.traffic.features.to_dict(),
        }
