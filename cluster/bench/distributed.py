"""The disaggregated rows of `specserve bench`: the same prompts through the Serve application (cluster/bench/serve.py),
placed next to the in-process row they compare with. With an EAGLE-3 head, its methods' rows (`add_eagle_distributed`):
the head in the draft pool, the target's features captured in the target pool."""

from __future__ import annotations

from dataclasses import dataclass, field

from specserve.cluster.bench.rows import SAMPLED_NGRAM_K, BenchConfig, Row, best_draft_k
from specserve.cluster.bench.serve import serve_rows, served_model
from specserve.cluster.bench.timing import finish_stream_rows
from specserve.cluster.scheduling.features import FeatureTraffic
from specserve.workers.config.settings import ModelConfig
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
    orchestration_s: float = 0.0  # the scheduler's own time in those rounds (not awaiting workers)
    features: FeatureTraffic = field(default_factory=FeatureTraffic)

    @classmethod
    def between(cls, before: dict, after: dict) -> EagleTraffic:
        """From two readings of the scheduler replica's status."""
        minus = lambda key: after[key] - before[key]  # noqa: E731
        features = FeatureTraffic(minus("feature_bytes_received"), minus("feature_verify_replies"),
                                  minus("feature_bytes_sent"), minus("feature_proposes"))  # fmt: skip
        return cls(minus("rounds"), minus("wire_bytes"), minus("orchestration_s"), features)

    @property
    def orchestration_ms_mean(self) -> float:
        return 1e3 * self.orchestration_s / max(1, self.rounds)

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


def eagle_rows(target: ModelConfig, head_dir: str, prompts: list[list[int]], cfg: BenchConfig, ks: dict[str, int],
               base: Row, streams: int = EAGLE_STREAMS) -> list[HeadRows]:  # fmt: skip
    """Each head method at its k (`ks`: method -> k) through the Serve app whose draft pool runs the head and whose
    target pool captures its features: one stream (the prompts one after another) and `streams` closed loops at
    once, greedy."""
    streams = min(streams, len(prompts))
    runs = []
    with served_model(target.path, head_dir, target.device, cfg.max_new_tokens, dtype=target.dtype) as served:
        for method, k in ks.items():
            served.generate(prompts[0][:16], method, k, new_tokens=4)  # warm-up
            before = served.status()
            name = f"disaggregated {method} k={k} greedy"
            one = served.one_stream(f"{name}, 1 stream", "disaggregated", prompts, method, k)
            many = served.streams(f"{name}, {streams} streams", "disaggregated", prompts, streams, method, k)
            traffic = EagleTraffic.between(before, served.status())
            runs.append(HeadRows(method, k, *finish_stream_rows([one, many], base), traffic))
    return runs


def add_eagle_distributed(rows: list[Row], meta: dict, target: ModelConfig, head_dir: str, prompts: list[list[int]],
                          cfg: BenchConfig) -> None:  # fmt: skip
    """Each head method's disaggregated rows, after its in-process greedy row at the best fixed k (by tokens/s),
    which they compare with as the draft model's disaggregated rows do with theirs: the in-process engine runs one
    request at a time, so its rate is the same for 1 stream and for the streams' requests one after another."""
    in_process = {}
    for method in (*HEAD_CHAIN_METHODS, *TREE_METHODS):
        greedy = [r for r in rows if r.method == method and r.temperature == 0 and isinstance(r.k, int)]
        if greedy:
            in_process[method] = max(greedy, key=lambda r: r.tokens_per_s)
    runs = eagle_rows(target, head_dir, prompts, cfg, {m: r.k for m, r in in_process.items()}, rows[0])
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
            "orchestration_ms_mean": run.traffic.orchestration_ms_mean,
            "wire_bytes_per_round": run.traffic.wire_bytes / max(1, run.traffic.rounds),
            "feature_bytes_per_round": run.traffic.feature_bytes_per_round,
            **run.traffic.features.to_dict(),
        }
