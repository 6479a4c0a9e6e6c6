"""`specserve bench`: speculative decoding measured side by side with target-only decoding and Hugging Face assisted
generation, in one run, on the same held-out prompts, pair and machine. Speed claims are ratios from this run."""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch
from tqdm import tqdm

from specserve.workers.adaptive_k import fit_acceptance, leviathan_speedup
from specserve.workers.config import KVCacheConfig, SamplingParams, SpecParams
from specserve.workers.engine import SpecEngine
from specserve.workers.loading import LoadedModel
from specserve.workers.runner import ModelRunner


@dataclass
class BenchConfig:
    prompts: int = 6
    prompt_tokens: int = 96
    max_new_tokens: int = 128
    ks: tuple[int, ...] = (1, 2, 4, 6)
    temperature: float = 0.8
    seed: int = 1234
    hf_rows: bool = True


QUICK = BenchConfig(prompts=2, prompt_tokens=64, max_new_tokens=48, ks=(2, 4))


@dataclass
class Row:
    name: str
    method: str  # target-only | hf-generate | hf-assisted | draft | ngram
    k: float | str | None
    temperature: float
    tokens: int = 0
    seconds: float = 0.0
    tokens_per_s: float = 0.0
    speedup: float = 1.0
    acceptance_rate: float | None = None
    mean_accepted_length: float | None = None
    t_draft_ms: float | None = None
    t_target_ms: float | None = None
    t_verify_ms: float | None = None
    leviathan_bound: float | None = None
    bound: float | None = None
    ratio_to_bound: float | None = None
    identical: bool | None = None  # greedy rows: same tokens as target-only; sampling rows: None (compare laws)
    outputs: list[list[int]] = field(default_factory=list, repr=False)


@dataclass
class Costs:
    t_draft: float  # seconds per drafted token (draft model, cached, one token)
    t_target: float  # seconds per target token (cached, one token)
    t_verify: dict[int, float]  # seconds per target forward over k + 1 new positions


def held_out_prompts(tokenizer, paths: list[str], n: int, length: int) -> list[list[int]]:
    """The first `length` tokens of the first n held-out files long enough to continue."""
    prompts = []
    for path in paths:
        with open(path, encoding="utf-8", errors="replace") as f:
            ids = tokenizer(f.read(), add_special_tokens=False)["input_ids"]
        if len(ids) >= length * 3:
            prompts.append(ids[:length])
        if len(prompts) == n:
            break
    return prompts


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
    the rows, and `ratio_to_bound` compares like with like); `costs()` takes the medians of all samples."""

    def __init__(self, target: LoadedModel, draft: LoadedModel, ks, reps: int = 5):
        self.t_runner, self.d_runner = ModelRunner(target, KVCacheConfig()), ModelRunner(draft, KVCacheConfig())
        self.verify_ks = sorted(set(ks) | {1, 2, 4, 6, 8})
        self.reps = reps
        self.samples: dict[str, list[float]] = {}

    def warm_up(self, prompt: list[int]) -> None:
        _time_forward(self.t_runner, prompt, 5, self.reps)  # allocator and kernel caches
        _time_forward(self.d_runner, prompt, 1, self.reps)

    def sample(self, prompt: list[int]) -> None:
        add = lambda key, times: self.samples.setdefault(key, []).extend(times)  # noqa: E731
        add("draft", _time_forward(self.d_runner, prompt, 1, self.reps))
        add("target", _time_forward(self.t_runner, prompt, 1, self.reps))
        for k in self.verify_ks:
            add(f"verify{k}", _time_forward(self.t_runner, prompt, k + 1, self.reps))

    def costs(self) -> Costs:
        med = lambda key: statistics.median(self.samples[key])  # noqa: E731
        return Costs(t_draft=med("draft"), t_target=med("target"),
                     t_verify={k: med(f"verify{k}") for k in self.verify_ks})  # fmt: skip


def distinct_ngram_fraction(tokens: list[int], n: int = 4) -> float:
    grams = [tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1)]
    return len(set(grams)) / len(grams) if grams else 0.0


def _fill_bounds(row: Row, costs: Costs, k: float) -> None:
    """Leviathan's S(k) with a fitted a, and the cost-aware bound B(k) = E t_target / (k t_draft + t_verify(k+1))."""
    E = row.mean_accepted_length
    k_int = max(1, round(k))
    t_verify = costs.t_verify.get(k_int) or costs.t_verify[min(costs.t_verify, key=lambda x: abs(x - k_int))]
    t_draft = costs.t_draft if row.method == "draft" else 0.0
    c = t_draft / costs.t_target
    row.t_draft_ms, row.t_target_ms, row.t_verify_ms = t_draft * 1e3, costs.t_target * 1e3, t_verify * 1e3
    row.leviathan_bound = leviathan_speedup(fit_acceptance(E, k), k, c)
    row.bound = E * costs.t_target / (k * t_draft + t_verify)


def run_bench(
    engine: SpecEngine,
    prompts: list[list[int]],
    cfg: BenchConfig,
    progress: bool = True,
) -> tuple[list[Row], dict]:
    target = engine.target
    draft_runner = engine.drafters["draft"].runner
    draft = draft_runner.loaded
    greedy = SamplingParams(max_new_tokens=cfg.max_new_tokens)
    sampled = SamplingParams(max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature, seed=cfg.seed)

    plan: list[tuple[Row, Callable[[list[int], SamplingParams], tuple[list[int], dict | None]]]] = []

    def spec_fn(method: str, k):
        def run(prompt, params):
            r = engine.generate(prompt, params, SpecParams(method=method, k=k))
            return r.token_ids, r.stats

        return run

    def hf_fn(assistant_k: int | None, assisted: bool):
        def run(prompt, params):
            kwargs = dict(max_new_tokens=params.max_new_tokens, do_sample=not params.greedy)
            if not params.greedy:
                kwargs["temperature"] = params.temperature
                torch.manual_seed(params.seed or 0)
            if assisted:
                kwargs["assistant_model"] = draft.model
                gc = draft.model.generation_config
                saved = (getattr(gc, "num_assistant_tokens", None), getattr(gc, "num_assistant_tokens_schedule", None))
                if assistant_k is not None:
                    gc.num_assistant_tokens, gc.num_assistant_tokens_schedule = assistant_k, "constant"
            try:
                ids = torch.tensor([prompt], device=target.device)
                out = target.model.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
            finally:
                if assisted:
                    gc.num_assistant_tokens, gc.num_assistant_tokens_schedule = saved
            return out[0, len(prompt) :].tolist(), None

        return run

    best_k = 4 if 4 in cfg.ks else cfg.ks[-1]
    for temp in (0.0, cfg.temperature):
        tag = "greedy" if temp == 0 else f"T={temp}"
        plan.append((Row(f"target-only {tag}", "target-only", None, temp), spec_fn("none", 1)))
        if cfg.hf_rows:
            plan.append((Row(f"hf generate {tag}", "hf-generate", None, temp), hf_fn(None, False)))
            plan.append((Row(f"hf assisted default {tag}", "hf-assisted", "hf-default", temp), hf_fn(None, True)))
            plan.append((Row(f"hf assisted k={best_k} {tag}", "hf-assisted", best_k, temp), hf_fn(best_k, True)))
        for k in cfg.ks if temp == 0 else (best_k,):
            plan.append((Row(f"specserve k={k} {tag}", "draft", k, temp), spec_fn("draft", k)))
        plan.append((Row(f"specserve k=auto {tag}", "draft", "auto", temp), spec_fn("draft", "auto")))
        if temp == 0:
            plan.append((Row(f"specserve ngram k={best_k} {tag}", "ngram", best_k, temp), spec_fn("ngram", best_k)))

    # Warm up every code path once so the first measured row does not pay for lazy initialisation.
    for _, fn in {id(fn): (r, fn) for r, fn in plan}.values():
        fn(prompts[0][:16], greedy.model_copy(update={"max_new_tokens": 4}))
    sampler = CostSampler(target, draft, cfg.ks)
    sampler.warm_up(prompts[0])

    # Prompt by prompt, every row in turn (forwards, then backwards for the next prompt): this VM's speed drifts by
    # tens of percent over minutes, and row after row (each over all prompts) charged a slow spell to whichever rows
    # ran in it (one run measured T=0.8 speculation at 0.79x target-only, the next at 1.56x, same models).
    counts = {id(row): [0, 0, 0] for row, _ in plan}  # drafted, accepted, rounds
    bar = tqdm(total=len(plan) * len(prompts), desc="bench", unit="gen", disable=not progress, file=sys.stderr)
    for i, prompt in enumerate(prompts):
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
    bar.close()
    costs = sampler.costs()
    for row, _ in plan:
        row.tokens_per_s = row.tokens / row.seconds
        drafted, accepted, rounds = counts[id(row)]
        if row.method in ("draft", "ngram"):
            row.acceptance_rate = accepted / drafted if drafted else 0.0
            row.mean_accepted_length = 1 + accepted / rounds
            _fill_bounds(row, costs, drafted / rounds if row.k == "auto" else float(row.k))

    for temp in {r.temperature for r, _ in plan}:
        base = next(r for r, _ in plan if r.method == "target-only" and r.temperature == temp)
        for row, _ in plan:
            if row.temperature != temp:
                continue
            row.speedup = row.tokens_per_s / base.tokens_per_s
            if row.bound:
                row.ratio_to_bound = row.speedup / row.bound
            if temp == 0 and row is not base:
                row.identical = row.outputs == base.outputs
    rows = [r for r, _ in plan]
    greedy_base = rows[0]
    meta = {
        "distinct_4gram_target_greedy": sum(distinct_ngram_fraction(o) for o in greedy_base.outputs)
        / len(greedy_base.outputs),
        "cost_ratio_c": costs.t_draft / costs.t_target,
        "t_draft_ms": costs.t_draft * 1e3,
        "t_target_ms": costs.t_target * 1e3,
        "t_verify_ms": {k: v * 1e3 for k, v in costs.t_verify.items()},
        "device": str(target.device),
        "dtype": str(target.dtype).removeprefix("torch."),
        # whether each model ran without transformers' forward wrappers (workers/lean_forward.py)
        "lean_forward": {"target": engine.verifier.runner.lean, "draft": draft_runner.lean},
        "prompts": len(prompts),
        "prompt_tokens": cfg.prompt_tokens,
        "max_new_tokens": cfg.max_new_tokens,
    }
    return rows, meta


def distributed_rows(target_path: str, draft_path: str, prompts: list[list[int]], cfg: BenchConfig, k: int,
                     device: str, base: Row) -> tuple[list[Row], dict]:  # fmt: skip
    """The disaggregated path on a local Ray cluster: a draft worker actor and a target worker actor over gRPC,
    driven by the scheduler actor. One stream (within-request pipelining only) and all prompts at once."""
    import ray

    from specserve.cluster.builders import deploy
    from specserve.cluster.config import local_config

    started = not ray.is_initialized()
    if started:
        ray.init(include_dashboard=False, log_to_driver=False, configure_logging=False)
    deployment = deploy(local_config(target_path, draft_path, device=device))
    sampling, spec = {"max_new_tokens": cfg.max_new_tokens}, {"method": "draft", "k": k}
    try:
        ray.get(deployment.scheduler.generate.remote(prompts[0][:16], {"max_new_tokens": 4}, spec))  # warm-up
        one = Row(f"disaggregated k={k} greedy, 1 stream", "disaggregated", k, 0.0)
        for prompt in prompts:
            t0 = time.perf_counter()
            out = ray.get(deployment.scheduler.generate.remote(prompt, sampling, spec))
            one.seconds += time.perf_counter() - t0
            one.outputs.append(out["token_ids"])
        many = Row(f"disaggregated k={k} greedy, {len(prompts)} streams", "disaggregated", k, 0.0)
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


def machine_info(device: torch.device, dtype: torch.dtype) -> dict:
    """Where the bench ran: the host, and the device and dtype the models ran in."""
    info = {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "dtype": str(dtype).removeprefix("torch."),
        "date": time.strftime("%Y-%m-%d"),
    }
    try:
        with open("/proc/cpuinfo") as f:
            info["cpu_model"] = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return info


def _fmt(v, spec=".2f") -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "NO"
    if isinstance(v, float):
        return format(v, spec)
    return str(v)


def format_table(rows: list[Row], meta: dict) -> str:
    head = ["row", "tok/s", "speedup", "accept", "E[tok/round]", "t_draft ms", "t_verify ms", "S(k)", "bound B(k)",
            "ratio/bound", "identical"]  # fmt: skip
    lines = [head]
    for r in rows:
        lines.append([
            r.name, _fmt(r.tokens_per_s, ".1f"), _fmt(r.speedup) + "x", _fmt(r.acceptance_rate),
            _fmt(r.mean_accepted_length), _fmt(r.t_draft_ms), _fmt(r.t_verify_ms), _fmt(r.leviathan_bound),
            _fmt(r.bound), _fmt(r.ratio_to_bound), _fmt(r.identical) if r.temperature == 0 else "n/a (sampled)",
        ])  # fmt: skip
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    out = ["| " + " | ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=True)) + " |" for line in lines]
    out.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    out.append("")
    if "disaggregated" in meta:
        d = meta["disaggregated"]
        out.append(
            f"disaggregated vs in-process (same k): {d['vs_in_process_1_stream']:.2f}x with 1 stream, "
            f"{d['vs_in_process_all_streams']:.2f}x with all streams at once; scheduler overhead p50 "
            f"{d['orchestration_ms_p50']:.2f} ms per round; {d['wire_bytes_per_round']:.0f} bytes on the wire per round"
        )
    if "tensor_parallel" in meta:
        t = meta["tensor_parallel"]
        out.append(
            f"TP={t['world_size']} decode step: {t['ms_per_step']:.2f} ms, collectives {t['communication_share']:.0%} "
            f"of it (rank 0 profile)"
        )
    out.append(
        f"c = t_draft/t_target = {meta['cost_ratio_c']:.3f} (t_draft {meta['t_draft_ms']:.2f} ms, t_target "
        f"{meta['t_target_ms']:.2f} ms); target greedy distinct 4-grams: {meta['distinct_4gram_target_greedy']:.0%}; "
        f"{meta['prompts']} held-out prompts x {meta['max_new_tokens']} new tokens; {meta['device']}, {meta['dtype']}"
    )
    return "\n".join(out)


def to_json(rows: list[Row], meta: dict, machine: dict) -> dict:
    out_rows = []
    for r in rows:
        d = asdict(r)
        d.pop("outputs")
        out_rows.append(d)
    return {"machine": machine, "meta": meta, "rows": out_rows}


def plot(rows: list[Row], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    spec_rows = [r for r in rows if r.method == "draft" and isinstance(r.k, int) and r.temperature == 0]
    ks = [r.k for r in spec_rows]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    ax1.plot(ks, [r.speedup for r in spec_rows], "o-", label="measured speedup")
    ax1.plot(ks, [r.bound for r in spec_rows], "s--", label="bound B(k)")
    ax1.plot(ks, [r.leviathan_bound for r in spec_rows], "^:", label="Leviathan S(k)")
    for r in rows:
        if r.method == "hf-assisted" and r.temperature == 0 and isinstance(r.k, int):
            ax1.axhline(r.speedup, color="gray", linestyle="-.", label=f"HF assisted k={r.k}")
    ax1.axhline(1.0, color="black", linewidth=0.5)
    ax1.set_xlabel("k (drafted tokens per round)")
    ax1.set_ylabel("speedup over target-only greedy")
    ax1.legend()
    ax2.plot(ks, [r.acceptance_rate for r in spec_rows], "o-", label="acceptance rate")
    ax2.plot(ks, [r.mean_accepted_length for r in spec_rows], "s-", label="tokens per round")
    ax2.set_xlabel("k")
    ax2.legend()
    fig.suptitle("specserve bench (greedy, held-out code)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main_bench(args) -> int:
    from specserve.workers.config import ModelConfig, validate
    from specserve.workers.demo import ensure_demo_family
    from specserve.workers.loading import load_model

    cfg = QUICK if args.quick else BenchConfig()
    if args.distributed is None:
        args.distributed = not args.quick
    if args.target:
        target_path, draft_path = args.target, args.draft
        held_out = args.prompts_from or []
    else:
        family = ensure_demo_family()
        target_path, draft_path = family.target, family.draft
        root = family.manifest["corpus_root"]
        held_out = [os.path.join(root, p) for p in family.manifest["held_out_files"]]
    if not draft_path:
        raise SystemExit("specserve bench: --draft is required with --target")
    target_cfg = validate(ModelConfig, {"path": target_path, "device": args.device, "dtype": args.dtype})
    draft_cfg = validate(ModelConfig, {"path": draft_path, "device": args.device, "dtype": args.dtype})
    target, draft = load_model(target_cfg), load_model(draft_cfg)
    engine = SpecEngine(target, draft)
    prompts = held_out_prompts(target.tokenizer, held_out, cfg.prompts, cfg.prompt_tokens)
    if not prompts:
        raise SystemExit("specserve bench: no held-out prompts found (give --prompts-from FILES)")
    rows, meta = run_bench(engine, prompts, cfg)
    if args.distributed:
        k = 4 if 4 in cfg.ks else cfg.ks[-1]
        in_process = next(r for r in rows if r.method == "draft" and r.k == k and r.temperature == 0)
        extra, status = distributed_rows(target_path, draft_path, prompts, cfg, k, args.device, rows[0])
        rows[rows.index(in_process) + 1 : rows.index(in_process) + 1] = extra
        meta["disaggregated"] = {
            "vs_in_process_1_stream": extra[0].tokens_per_s / in_process.tokens_per_s,
            "vs_in_process_all_streams": extra[1].tokens_per_s / in_process.tokens_per_s,
            "orchestration_ms_p50": status["orchestration_ms_p50"],
            "wire_bytes_per_round": status["wire_bytes_per_round"],
        }
        from specserve.cluster.bench_serve import serve_rows

        served = serve_rows(target_path, draft_path, prompts, cfg, k, args.device, rows[0])
        at = rows.index(extra[-1]) + 1
        rows[at:at] = served
        meta["disaggregated"]["serve_vs_in_process_1_stream"] = served[0].tokens_per_s / in_process.tokens_per_s
    tp_n = args.tensor_parallel if args.tensor_parallel is not None else (0 if args.quick else 2)
    if tp_n > 1:
        from specserve.cluster.bench_tp import tp_rows

        k = 4 if 4 in cfg.ks else cfg.ks[-1]
        extra, profile = tp_rows(
            target_cfg,
            draft_cfg,
            target.vocab_size,
            prompts,
            cfg.max_new_tokens,
            k,
            rows[0],
            tp_n,
        )
        rows += extra
        meta["tensor_parallel"] = {"world_size": tp_n, **profile}
    levels = []
    if args.concurrency:
        from specserve.cluster.bench_concurrency import concurrency_rows, format_levels, levels_json, request_lengths

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
        plot(rows, args.plot)
        if levels:
            from specserve.cluster.bench_concurrency import plot_levels

            root, ext = os.path.splitext(args.plot)
            plot_levels(levels, f"{root}-concurrency{ext or '.png'}")
    return 0
