"""`specserve bench`: speculative decoding measured side by side with target-only decoding and Hugging Face's
generate (plain, prompt lookup, assisted), in one run, on the same held-out prompts, models and machine. Speed claims
are ratios from this run. Which rows run: cluster/bench/rows.py; the table, JSON and plots: cluster/bench/report.py."""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from dataclasses import dataclass

from tqdm import tqdm

from specserve.cluster.bench.report import format_table, machine_info, plot, to_json
from specserve.cluster.bench.rows import (
    NGRAM_KS,
    QUICK,
    SAMPLED_NGRAM_K,
    TARGET_FULL,
    TARGET_QUICK,
    BenchConfig,
    Row,
    RowFn,
    bench_prompts,
    bench_questions,
    best_draft_k,
    plan_rows,
    prompt_lookup_row,
)
from specserve.workers.speculation.adaptive_k import fit_acceptance, leviathan_speedup
from specserve.workers.config import KVCacheConfig, SamplingParams
from specserve.workers.speculation.engine import SpecEngine
from specserve.workers.errors import InvalidRequestError
from specserve.workers.runtime.loading import LoadedModel
from specserve.workers.runtime.runner import ModelRunner

__all__ = ["BenchConfig", "Row", "format_table", "machine_info", "plot", "to_json", "main_bench", "run_bench"]


@dataclass
class Costs:
    t_draft: float  # seconds per drafted token (draft model, cached, one token); 0 without a draft model
    t_target: float  # seconds per target token (cached, one token)
    t_verify: dict[int, float]  # seconds per target forward over k + 1 new positions


def _time_forward(runner: ModelRunner, prompt: list[int], new: int, reps: int) -> list[float]:
    """Seconds of `reps` cached forwards over `new` fresh positions after `prompt`."""
    times = []
    for i in range(reps):
        runner.logits_for("cost", prompt, 1)
        seq = prompt + [(7 * i + j) % 200 + 3 for j in range(new)]
        t0 = time.perf_counter()
        runner.logits_for("cost", seq, new)
        times.append(time.perf_counter() - t0)
    runner.release("cost")
    return times


class CostSampler:
    """Per-token costs, sampled a few times per prompt between the rows (so the VM's drift lands on the costs as on
    the rows, and `ratio_to_bound` compares like with like); `costs()` takes the medians of all samples. Without a
    draft model (n-gram drafting costs next to nothing) t_draft is 0 and the verify costs are what matter."""

    def __init__(self, target: LoadedModel, draft: LoadedModel | None, ks, reps: int = 5):
        self.t_runner = ModelRunner(target, KVCacheConfig())
        self.d_runner = ModelRunner(draft, KVCacheConfig()) if draft is not None else None
        self.verify_ks = sorted(set(ks) | {1, 2, 4, 6, 8})
        self.reps = reps
        self.samples: dict[str, list[float]] = {}

    def warm_up(self, prompt: list[int]) -> None:
        _time_forward(self.t_runner, prompt, 5, self.reps)  # allocator and kernel caches
        if self.d_runner is not None:
            _time_forward(self.d_runner, prompt, 1, self.reps)

    def sample(self, prompt: list[int]) -> None:
        add = lambda key, times: self.samples.setdefault(key, []).extend(times)  # noqa: E731
        if self.d_runner is not None:
            add("draft", _time_forward(self.d_runner, prompt, 1, self.reps))
        add("target", _time_forward(self.t_runner, prompt, 1, self.reps))
        for k in self.verify_ks:
            add(f"verify{k}", _time_forward(self.t_runner, prompt, k + 1, self.reps))

    def costs(self) -> Costs:
        med = lambda key: statistics.median(self.samples[key])  # noqa: E731
        return Costs(t_draft=med("draft") if "draft" in self.samples else 0.0, t_target=med("target"),
                     t_verify={k: med(f"verify{k}") for k in self.verify_ks})  # fmt: skip


def distinct_ngram_fraction(tokens: list[int], n: int = 4) -> float:
    grams = [tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1)]
    return len(set(grams)) / len(grams) if grams else 0.0


def verify_cost(costs: Costs, k: float) -> float:
    """Seconds of a target forward over k + 1 positions: the sampled cost, interpolated between sampled widths for a
    fractional k (a mean over rounds; k = 0 is a plain one-token step)."""
    points = sorted({0: costs.t_target, **costs.t_verify}.items())
    if k >= points[-1][0]:
        return points[-1][1]
    for (k0, t0), (k1, t1) in zip(points, points[1:], strict=False):
        if k0 <= k <= k1:
            return t0 + (t1 - t0) * (k - k0) / (k1 - k0)
    return points[0][1]


def _fill_bounds(row: Row, costs: Costs, k: float) -> None:
    """Leviathan's S(k) with a fitted a, and the cost-aware bound B(k) = E t_target / (k t_draft + t_verify(k+1))."""
    E = row.mean_accepted_length
    t_verify = verify_cost(costs, k)
    t_draft = costs.t_draft if row.method == "draft" else 0.0
    c = t_draft / costs.t_target
    row.t_draft_ms, row.t_target_ms, row.t_verify_ms = t_draft * 1e3, costs.t_target * 1e3, t_verify * 1e3
    row.leviathan_bound = leviathan_speedup(fit_acceptance(E, k), k, c)
    row.bound = E * costs.t_target / (k * t_draft + t_verify)


def _measure(plan: list[tuple[Row, RowFn]], prompts, cfg: BenchConfig, bar, sampler: CostSampler | None = None):
    """Prompt by prompt, every row in turn (forwards, then backwards for the next prompt): this VM's speed drifts by
    tens of percent over minutes, and row after row (each over all prompts) charged a slow spell to whichever rows
    ran in it (one run measured T=0.8 speculation at 0.79x target-only, the next at 1.56x, same models).
    Returns {id(row): [drafted, accepted, rounds]}."""
    greedy = SamplingParams(max_new_tokens=cfg.max_new_tokens)
    sampled = SamplingParams(max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature, seed=cfg.seed)
    counts = {id(row): [0, 0, 0] for row, _ in plan}
    for i, prompt in enumerate(prompts):
        if sampler is not None:
            sampler.sample(prompt)
        for row, fn in plan if i % 2 == 0 else plan[::-1]:
            t0 = time.perf_counter()
            tokens, stats = fn(prompt, params_for(row, greedy, sampled))
            row.seconds += time.perf_counter() - t0
            row.tokens += len(tokens)
            row.outputs.append(tokens)
            if stats is not None:
                c = counts[id(row)]
                c[0], c[1], c[2] = c[0] + stats.drafted, c[1] + stats.accepted, c[2] + stats.rounds
            bar.update(1)
    for row, _ in plan:
        row.tokens_per_s = row.tokens / row.seconds
    return counts


def run_bench(engine: SpecEngine, prompts: list[list[int]], cfg: BenchConfig, progress: bool = True):
    """Measure every row of `plan_rows(engine, cfg)` on `prompts`; returns (rows, meta)."""
    target = engine.target
    draft_runner = engine.drafters["draft"].runner if "draft" in engine.drafters else None
    plan = plan_rows(engine, cfg)
    # The target suite adds, after the others, HF prompt lookup at the best n-gram k beside a target-only rerun.
    pl_best = cfg.suite == "target" and cfg.hf_rows

    # Warm up every code path once so the first measured row does not pay for lazy initialisation.
    warm = SamplingParams(max_new_tokens=4)
    for _, fn in {id(fn): (r, fn) for r, fn in plan}.values():
        fn(prompts[0][:16], warm)
    ks = cfg.ks if cfg.suite == "demo" else (*NGRAM_KS, *(cfg.ks if draft_runner else ()))
    sampler = CostSampler(target, draft_runner.loaded if draft_runner else None, ks)
    sampler.warm_up(prompts[0])

    total = (len(plan) + (2 if pl_best else 0)) * len(prompts)
    bar = tqdm(total=total, desc="bench", unit="gen", disable=not progress, file=sys.stderr)
    counts = _measure(plan, prompts, cfg, bar, sampler)
    costs = sampler.costs()
    for row, _ in plan:
        drafted, accepted, rounds = counts[id(row)]
        if row.method in ("draft", "ngram"):
            row.acceptance_rate = accepted / drafted if drafted else 0.0
            row.mean_accepted_length = 1 + accepted / rounds
            # n-gram rounds draft fewer tokens than k (none) when the lookup finds no (long enough) match
            fixed = row.method == "draft" and row.k != "auto"
            _fill_bounds(row, costs, float(row.k) if fixed else drafted / rounds)
    rows = [r for r, _ in plan]
    for temp in {r.temperature for r in rows}:
        base = next(r for r in rows if r.method == "target-only" and r.temperature == temp)
        for row in rows:
            if row.temperature != temp:
                continue
            row.speedup = row.tokens_per_s / base.tokens_per_s
            if row.bound:
                row.ratio_to_bound = row.speedup / row.bound
            if temp == 0 and row is not base:
                row.identical = row.outputs == base.outputs
    greedy_base = rows[0]
    meta = {}
    if pl_best:
        ngram = [r for r in rows if r.method == "ngram" and r.temperature == 0 and isinstance(r.k, int)]
        best = max(ngram, key=lambda r: r.speedup).k
        rerun = Row("target-only greedy (rerun)", "target-only", None, 0.0)
        row, fn = prompt_lookup_row(engine, best, " (best ngram k)")
        _measure([(rerun, plan[0][1]), (row, fn)], prompts, cfg, bar)
        row.speedup = row.tokens_per_s / rerun.tokens_per_s
        row.identical = row.outputs == greedy_base.outputs
        at = next(i for i, r in enumerate(rows) if r.method == "hf-prompt-lookup") + 1
        rows.insert(at, row)
        meta["prompt_lookup_best_k"] = {"n": best, "paired_target_only_tokens_per_s": rerun.tokens_per_s}
    bar.close()
    meta.update({
        "suite": cfg.suite,
        "distinct_4gram_target_greedy": statistics.fmean(distinct_ngram_fraction(o) for o in greedy_base.outputs),
        "cost_ratio_c": costs.t_draft / costs.t_target,
        "t_draft_ms": costs.t_draft * 1e3,
        "t_target_ms": costs.t_target * 1e3,
        "t_verify_ms": {k: v * 1e3 for k, v in costs.t_verify.items()},
        "device": str(target.device),
        "dtype": str(target.dtype).removeprefix("torch."),
        # whether each model ran without transformers' forward wrappers (workers/runtime/lean_forward.py)
        "lean_forward": {"target": engine.verifier.runner.lean, "draft": draft_runner.lean if draft_runner else None},
        "prompts": len(prompts),
        "prompt_tokens": round(statistics.fmean(len(p) for p in prompts)),
        "max_new_tokens": cfg.max_new_tokens,
        "mean_new_tokens": greedy_base.tokens / len(prompts),
    })  # fmt: skip
    return rows, meta


def distributed_rows(target_path: str, draft_path: str | None, prompts: list[list[int]], cfg: BenchConfig, k: int,
                     device: str, base: Row, method: str = "draft") -> tuple[list[Row], dict]:  # fmt: skip
    """The disaggregated path on a local Ray cluster: a draft worker actor (none for n-gram drafting, which runs in
    the scheduler) and a target worker actor over gRPC, driven by the scheduler actor. One stream (within-request
    pipelining only) and all prompts at once."""
    import ray

    from specserve.cluster.pools.builders import deploy
    from specserve.cluster.config import local_config

    started = not ray.is_initialized()
    if started:
        ray.init(include_dashboard=False, log_to_driver=False, configure_logging=False)
    deployment = deploy(local_config(target_path, draft_path, device=device))
    sampling, spec = {"max_new_tokens": cfg.max_new_tokens}, {"method": method, "k": k}
    what = f"{'ngram ' if method == 'ngram' else ''}k={k}"
    try:
        ray.get(deployment.scheduler.generate.remote(prompts[0][:16], {"max_new_tokens": 4}, spec))  # warm-up
        one = Row(f"disaggregated {what} greedy, 1 stream", "disaggregated", k, 0.0)
        for prompt in prompts:
            t0 = time.perf_counter()
            out = ray.get(deployment.scheduler.generate.remote(prompt, sampling, spec))
            one.seconds += time.perf_counter() - t0
            one.outputs.append(out["token_ids"])
        many = Row(f"disaggregated {what} greedy, {len(prompts)} streams", "disaggregated", k, 0.0)
        t0 = time.perf_counter()
        outs = ray.get([deployment.scheduler.generate.remote(p, sampling, spec) for p in prompts])
        many.seconds = time.perf_counter() - t0
        many.outputs = [o["token_ids"] for o in outs]
        status = ray.get(deployment.scheduler.status.remote())
    finally:
        deployment.shutdown()
        if started:
            ray.shutdown()
    return finish_stream_rows([one, many], base), status


def finish_stream_rows(rows: list[Row], base: Row) -> list[Row]:
    """Fill in throughput, speedup over `base` and the identical check of rows that recorded outputs and seconds."""
    for row in rows:
        row.tokens = sum(len(o) for o in row.outputs)
        row.tokens_per_s = row.tokens / row.seconds
        row.speedup = row.tokens_per_s / base.tokens_per_s
        row.identical = row.outputs == base.outputs
    return rows


def params_for(row: Row, greedy: SamplingParams, sampled: SamplingParams) -> SamplingParams:
    return greedy if row.temperature == 0 else sampled


def _add_distributed(rows, meta, target_path, draft_path, prompts, cfg, device) -> None:
    """The disaggregated and Serve rows, next to the in-process row they compare with (draft k=4, or n-gram k=4)."""
    from specserve.cluster.bench.serve import serve_rows

    method, k = ("draft", best_draft_k(cfg)) if draft_path else ("ngram", SAMPLED_NGRAM_K)
    in_process = next(r for r in rows if r.method == method and r.k == k and r.temperature == 0)
    extra, status = distributed_rows(target_path, draft_path, prompts, cfg, k, device, rows[0], method)
    rows[rows.index(in_process) + 1 : rows.index(in_process) + 1] = extra
    meta["disaggregated"] = {
        "vs_in_process_1_stream": extra[0].tokens_per_s / in_process.tokens_per_s,
        "vs_in_process_all_streams": extra[1].tokens_per_s / in_process.tokens_per_s,
        "orchestration_ms_p50": status["orchestration_ms_p50"],
        "wire_bytes_per_round": status["wire_bytes_per_round"],
    }
    # A Serve model whose draft is 'ngram' drafts by prompt lookup by default
    served = serve_rows(target_path, draft_path or "ngram", prompts, cfg, k, device, rows[0])
    if not draft_path:
        for row in served:
            row.name = row.name.replace(f"k={k}", f"ngram k={k}", 1)
    at = rows.index(extra[-1]) + 1
    rows[at:at] = served
    meta["disaggregated"]["serve_vs_in_process_1_stream"] = served[0].tokens_per_s / in_process.tokens_per_s


def main_bench(args) -> int:
    from specserve.workers.config import ModelConfig, validate
    from specserve.workers.runtime.loading import load_model

    questions = bench_questions(args)  # a bad file fails before any model loads
    if args.target:
        from specserve.workers.models.catalog import resolve_model

        target_path = resolve_model(args.target)
        draft_path = resolve_model(args.draft) if args.draft else None
        cfg = TARGET_QUICK if args.quick else TARGET_FULL
        held_out = args.prompts_from or []
    else:
        from specserve.workers.training.demo_build import ensure_demo_family

        if args.draft:
            raise InvalidRequestError("draft", "--draft applies with --target (the demo family has its own draft)")
        family = ensure_demo_family()
        target_path, draft_path = family.target, family.draft
        cfg = QUICK if args.quick else BenchConfig()
        root = family.manifest["corpus_root"]
        held_out = args.prompts_from or [os.path.join(root, p) for p in family.manifest["held_out_files"]]
    if args.distributed is None:
        args.distributed = not args.quick
    if args.concurrency is None:
        args.concurrency = not args.target
    tp_n = args.tensor_parallel if args.tensor_parallel is not None else (0 if args.quick or args.target else 2)
    # Said before the long run starts: extras that need a draft model, asked for without one
    if tp_n > 1 and not draft_path:
        print("specserve bench: skipping the tensor-parallel rows: they pair the TP target with a draft worker, and "
              "there is no draft model (give --draft)")  # fmt: skip
        tp_n = 0
    if args.concurrency and not draft_path:
        print("specserve bench: skipping the concurrency sweep: it measures a draft model's speculation under the "
              "load-aware policy, and there is no draft model (give --draft)")  # fmt: skip
        args.concurrency = False
    target_cfg = validate(ModelConfig, {"path": target_path, "device": args.device, "dtype": args.dtype})
    draft_cfg = None
    if draft_path:
        draft_cfg = validate(ModelConfig, {"path": draft_path, "device": args.device, "dtype": args.dtype})
    target = load_model(target_cfg)
    engine = SpecEngine(target, load_model(draft_cfg) if draft_cfg else None)
    prompts, kind = bench_prompts(target.tokenizer, cfg, questions, held_out)
    rows, meta = run_bench(engine, prompts, cfg)
    meta["prompts_kind"] = kind
    if args.distributed:
        _add_distributed(rows, meta, target_path, draft_path, prompts, cfg, args.device)
    if tp_n > 1:
        from specserve.cluster.bench.tp import tp_rows

        extra, profile = tp_rows(target_cfg, draft_cfg, target.vocab_size, prompts, cfg.max_new_tokens,
                                 best_draft_k(cfg), rows[0], tp_n)  # fmt: skip
        rows += extra
        meta["tensor_parallel"] = {"world_size": tp_n, **profile}
    levels = []
    if args.concurrency:
        from specserve.cluster.bench.concurrency import concurrency_rows, format_levels, levels_json, request_lengths

        new_tokens = 16 if args.quick else 32
        levels = concurrency_rows(
            target_cfg,
            draft_cfg,
            target.vocab_size,
            prompts,
            new_tokens,
            meta["cost_ratio_c"],
            **(dict(settle_s=1.5, segment_s=0.5, pairs=4) if args.quick else {}),  # a smoke run
        )
        meta["concurrency"] = levels_json(levels)
    print(format_table(rows, meta))
    if levels:
        lengths = "-".join(map(str, request_lengths(new_tokens)))
        print(f"\nConcurrency sweep (greedy, {lengths} new tokens per request, closed-loop streams, disaggregated "
              "over gRPC; per level: the policy settles, unmeasured, then off and on segments alternate):")  # fmt: skip
        print(format_levels(levels))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(to_json(rows, meta, machine_info(target.device, target.dtype)), f, indent=2)
    if args.plot:
        plot(rows, meta, args.plot)
        if levels:
            from specserve.cluster.bench.concurrency import plot_levels

            root, ext = os.path.splitext(args.plot)
            plot_levels(levels, f"{root}-concurrency{ext or '.png'}")
    return 0
