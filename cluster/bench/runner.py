"""`specserve bench`: speculative decoding measured side by side with target-only decoding and Hugging Face's
generate (plain, prompt lookup, assisted), in one run, on the same held-out prompts, models and machine. Speed claims
are ratios from this run. Which rows run: cluster/bench/rows.py; how they are timed: cluster/bench/timing.py; the
table, JSON and plots: cluster/bench/report.py; the extra rows: distributed.py, serve.py, tp.py, concurrency.py."""

from __future__ import annotations

import json
import os
import statistics
import sys
from dataclasses import replace

from tqdm import tqdm

from specserve.cluster.bench.report import format_table, machine_info, plot, to_json
from specserve.cluster.bench.rows import (
    NGRAM_KS,
    QUICK,
    SPEC_METHODS,
    TARGET_FULL,
    TARGET_QUICK,
    TREE_KS,
    BenchConfig,
    Row,
    RowFn,
    bench_prompts,
    bench_questions,
    best_draft_k,
    compare_outputs,
    parse_ks,
    parse_methods,
    plan_rows,
    prompt_lookup_row,
)
from specserve.cluster.bench.spec_bench import (
    SPEC_BENCH_FULL,
    SPEC_BENCH_QUICK,
    Conversation,
    category_figures,
    converse,
    fill_categories,
    questions_for,
    spec_bench_meta,
    spec_bench_prompts,
)
from specserve.cluster.bench.structured import json_prompts, valid_outputs, warm_formats, with_formats
from specserve.cluster.bench.timing import Costs, CostSampler, distinct_ngram_fraction, fill_bounds, measure
from specserve.workers.config.request import ResponseFormat, SamplingParams
from specserve.workers.config.settings import ModelConfig
from specserve.workers.errors import InvalidRequestError
from specserve.workers.speculation.engine import SpecEngine
from specserve.workers.speculation.methods import HEAD_DEFAULT, LOOKUP_DEFAULT, MODEL_DEFAULT, TREE_METHODS

__all__ = ["BenchConfig", "Row", "format_table", "machine_info", "plot", "to_json", "main_bench", "run_bench"]


def run_bench(engine: SpecEngine, prompts: list[list[int]], cfg: BenchConfig, progress: bool = True,
              conversations: list[Conversation] | None = None,
              formats: list[ResponseFormat] | None = None):  # fmt: skip
    """Measure every row of `plan_rows(engine, cfg)` on `prompts`; returns (rows, meta). With `conversations`
    (Spec-Bench's, whose first turns the prompts are) every row answers whole conversations and gets figures per
    category; with `formats`, each prompt under its response_format (structured.py)."""
    plan = plan_rows(engine, cfg)
    if formats is not None:
        plan = [(row, with_formats(fn, prompts, formats)) for row, fn in plan]
        warm_formats(plan[0][1], prompts, formats)
    # The target suite adds, after the others, HF prompt lookup at the best n-gram k beside a target-only rerun.
    pl_best = cfg.suite == "target" and cfg.hf_rows and any(_fixed_ngram(r) for r, _ in plan)
    sampler = _warm_up(engine, plan, prompts, cfg)
    total = (len(plan) + (2 if pl_best else 0)) * len(prompts)
    bar = tqdm(total=total, desc="bench", unit="gen", disable=not progress, file=sys.stderr)
    if conversations is not None:
        plan = [(row, converse(engine.tokenizer, fn)) for row, fn in plan]
    counts = measure(plan, prompts, cfg, bar, sampler, conversations, cold=engine.forget_prefixes)
    costs = sampler.costs()
    if "eagle" in engine.drafters:
        head = engine.planner_costs().head  # measured in the warm-up, by the first k='auto' row
        costs.t_head = (head.fixed_s + HEAD_K * head.step_s) / HEAD_K
    rows = [r for r, _ in plan]
    _fill_speculation(rows, counts, costs)
    _fill_speedups(rows)
    served = HEAD_DEFAULT if "eagle" in engine.drafters else MODEL_DEFAULT if "draft" in engine.drafters else None
    for row in rows:
        row.default = row.method == (served or LOOKUP_DEFAULT) and row.k == "auto"
    if conversations is not None:
        rounds = {id(r): counts[id(r)].by_request for r in rows if r.method in SPECULATIVE}
        fill_categories(rows, rounds, [c.question.category for c in conversations])
    greedy_base = rows[0]
    meta = _best_prompt_lookup(engine, rows, plan[0][1], prompts, cfg, bar, conversations) if pl_best else {}
    bar.close()
    meta.update(_run_meta(engine, prompts, cfg, costs, greedy_base))
    return rows, meta


def _warm_up(engine: SpecEngine, plan: list[tuple[Row, RowFn]], prompts: list[list[int]], cfg: BenchConfig):
    """Run every code path once, so the first measured row does not pay for lazy initialisation; returns the cost
    sampler, warmed up too."""
    warm = SamplingParams(max_new_tokens=4)
    for _, fn in {id(fn): (r, fn) for r, fn in plan}.values():
        fn(prompts[0][:16], warm)
    draft_runner = _draft_runner(engine)
    trees = TREE_KS if cfg.suite != "demo" else ()
    ks = cfg.ks if cfg.suite == "demo" else tuple(sorted({*NGRAM_KS, *(cfg.ks if draft_runner else ()), *trees}))
    sampler = CostSampler(engine.target, draft_runner.loaded if draft_runner else None, ks)
    sampler.warm_up(prompts[0])
    return sampler


def _draft_runner(engine: SpecEngine):
    return engine.drafters["draft"].runner if "draft" in engine.drafters else None


def _fill_speculation(rows: list[Row], counts: dict, costs: Costs) -> None:
    """Acceptance, tokens per round and bounds of the speculative rows, from their summed round counts."""
    for row in rows:
        c = counts[id(row)]
        if row.method in SPECULATIVE:
            row.acceptance_rate = c.accepted / c.drafted if c.drafted else 0.0
            row.mean_accepted_length = 1 + c.accepted / c.rounds
            row.acceptance_by_position = c.by_position()
            # n-gram rounds draft fewer tokens than k (none) when the lookup finds no (long enough) match, and a
            # head drafts nothing in a request's first round
            fixed = row.method == "draft" and row.k != "auto"
            depth = sum(c.reached_by_position) / c.rounds  # a tree drafts as many steps as it is deep
            fill_bounds(row, costs, float(row.k) if fixed else c.drafted / c.rounds,
                        steps=depth if row.method in TREE_METHODS else None)  # fmt: skip


SPECULATIVE = SPEC_METHODS  # every drafting method the registry lists
HEAD_K = 4  # a head's cost per drafted token is quoted at this k


def _fill_speedups(rows: list[Row]) -> None:
    """Speedup over the target-only row of the same temperature; greedy rows: the identical check against it."""
    for temp in {r.temperature for r in rows}:
        base = next(r for r in rows if r.method == "target-only" and r.temperature == temp)
        for row in rows:
            if row.temperature != temp:
                continue
            row.speedup = row.tokens_per_s / base.tokens_per_s
            if row.bound:
                row.ratio_to_bound = row.speedup / row.bound
            if temp == 0 and row is not base:
                compare_outputs(row, base)


def _fixed_ngram(row: Row) -> bool:
    return row.method == "ngram" and row.temperature == 0 and isinstance(row.k, int)


def _best_prompt_lookup(engine: SpecEngine, rows: list[Row], target_only: RowFn, prompts: list[list[int]],
                        cfg: BenchConfig, bar, conversations: list[Conversation] | None) -> dict:  # fmt: skip
    """HF prompt lookup at the best n-gram k, measured beside a target-only rerun and inserted after the other
    prompt-lookup row (its figures per category, with conversations, against the rerun's); returns its meta entry."""
    greedy_base = rows[0]
    best = max((r for r in rows if _fixed_ngram(r)), key=lambda r: r.speedup).k
    rerun = Row("target-only greedy (rerun)", "target-only", None, 0.0)
    row, fn = prompt_lookup_row(engine, best, " (best ngram k)")
    fn = fn if conversations is None else converse(engine.tokenizer, fn)
    measure([(rerun, target_only), (row, fn)], prompts, cfg, bar, items=conversations, cold=engine.forget_prefixes)
    row.speedup = row.tokens_per_s / rerun.tokens_per_s
    compare_outputs(row, greedy_base)
    if conversations is not None:
        row.categories = category_figures(row, rerun, [c.question.category for c in conversations])
    at = next(i for i, r in enumerate(rows) if r.method == "hf-prompt-lookup") + 1
    rows.insert(at, row)
    return {"prompt_lookup_best_k": {"n": best, "paired_target_only_tokens_per_s": rerun.tokens_per_s}}


def _run_meta(engine: SpecEngine, prompts: list[list[int]], cfg: BenchConfig, costs: Costs, greedy_base: Row) -> dict:
    target, draft_runner = engine.target, _draft_runner(engine)
    return {
        "suite": cfg.suite,
        "distinct_4gram_target_greedy": statistics.fmean(distinct_ngram_fraction(o) for o in greedy_base.outputs),
        "cost_ratio_c": costs.t_draft / costs.t_target,
        "t_draft_ms": costs.t_draft * 1e3,
        "t_target_ms": costs.t_target * 1e3,
        "t_verify_ms": {k: v * 1e3 for k, v in costs.verify_s.items()},
        "device": str(target.device),
        "dtype": str(target.dtype).removeprefix("torch."),
        # whether each model ran without transformers' forward wrappers (workers/runtime/lean_forward.py)
        "lean_forward": {"target": engine.verifier.runner.lean, "draft": draft_runner.lean if draft_runner else None},
        "prompts": len(prompts),
        "prompt_tokens": round(statistics.fmean(len(p) for p in prompts)),
        "max_new_tokens": cfg.max_new_tokens,
        "mean_new_tokens": greedy_base.tokens / len(prompts),
        **_head_meta(engine, costs),
    }  # fmt: skip


def _head_meta(engine: SpecEngine, costs: Costs) -> dict:
    """The head's costs: per chained step, per round, per drafted token at HEAD_K, and the verify cost per width that
    k='auto' weighs."""
    if "eagle" not in engine.drafters:
        return {}
    planner = engine.planner_costs()
    return {"eagle_head": {
        "path": engine.eagle_source,
        "step_ms": planner.head.step_s * 1e3,
        "fixed_ms": planner.head.fixed_s * 1e3,
        "t_head_ms": costs.t_head * 1e3,
        "step_to_target_step": planner.head.step_s / costs.t_target,
        "verify_ms_by_width": [t * 1e3 for t in planner.verify.verify_s],
    }}  # fmt: skip


def _models(args) -> tuple[str, str | None, BenchConfig, list[str]]:
    """(target directory, draft directory or None, config, held-out files) of this run: --target's, or the demo
    family's (installed from the packaged copy when missing)."""
    if args.target:
        from specserve.workers.models.catalog import resolve_model

        draft_path = resolve_model(args.draft) if args.draft else None
        if getattr(args, "spec_bench", None):
            cfg = SPEC_BENCH_QUICK if args.quick else SPEC_BENCH_FULL
        else:
            cfg = TARGET_QUICK if args.quick else TARGET_FULL
        return resolve_model(args.target), draft_path, cfg, args.prompts_from or []
    from specserve.workers.models.demo import ensure_demo_family

    if args.draft:
        raise InvalidRequestError("draft", "--draft applies with --target (the demo family has its own draft)")
    family = ensure_demo_family()
    root = family.manifest["corpus_root"]
    held_out = args.prompts_from or [os.path.join(root, p) for p in family.manifest["held_out_files"]]
    return family.target, family.draft, QUICK if args.quick else BenchConfig(), held_out


def _row_selection(args) -> tuple[tuple[str, ...] | None, tuple[int | str, ...] | None]:
    """--methods and --k, parsed (None: not given); they select the rows of a --target run."""
    methods, ks = parse_methods(getattr(args, "methods", None)), parse_ks(getattr(args, "k", None))
    if not args.target and (methods or ks):
        raise InvalidRequestError("methods" if methods else "k", "applies with --target (the demo family's rows are "
                                  "fixed)")  # fmt: skip
    return methods, ks


def _extras(args, draft_path: str | None) -> int:
    """Settle which extra sections run (args.distributed, args.load; returns the TP world size, 0 for none), saying
    before the long run starts which ones need a draft model and have none."""
    if args.distributed is None:
        args.distributed = not args.quick
    if args.load is None:
        args.load = not args.target and not args.quick
    tp_n = args.tensor_parallel if args.tensor_parallel is not None else (0 if args.quick or args.target else 2)
    if tp_n > 1 and not draft_path:
        print("specserve bench: skipping the tensor-parallel rows: they pair the TP target with a draft worker, and "
              "there is no draft model (give --draft)")  # fmt: skip
        tp_n = 0
    return tp_n


def _structured(args, spec_bench: bool) -> bool:
    """--json-schema: the structured-output rows, in process only (refused beside the sections that take none)."""
    if not getattr(args, "json_schema", False):
        return False
    if not args.target:
        raise InvalidRequestError("json_schema", "applies with --target")
    sections = {"--spec-bench": spec_bench, "--distributed": args.distributed, "--load": args.load,
                "--tensor-parallel": args.tensor_parallel}  # fmt: skip
    clash = [flag for flag, on in sections.items() if on]
    if clash:
        raise InvalidRequestError("json_schema", f"runs in-process rows only: not with {clash[0]}")
    args.distributed, args.load, args.tensor_parallel = False, False, 0
    return True


def _eagle_head(args, target_path: str):
    """The head for the eagle rows: --eagle-head's directory, none for 'none', else the one packaged for the target."""
    from specserve.workers.models.packaged_heads import packaged_head_for, resolve_head

    choice = getattr(args, "eagle_head", None)
    if choice == "none" or not args.target:
        return None
    return resolve_head(choice, target_path) if choice else packaged_head_for(target_path)


WORKLOADS = ("multi-turn", "long-prompt")  # served traffic workloads that run alone (workloads.py)


def main_bench(args) -> int:
    from specserve.workers.config.strict import validate
    from specserve.workers.runtime.loading import load_model

    spec = questions_for(args)  # bad files and flags fail before any model loads
    questions = None if spec else bench_questions(args)
    methods, ks = _row_selection(args)
    target_path, draft_path, cfg, held_out = _models(args)
    if args.load in WORKLOADS:
        from specserve.cluster.bench.workloads import main_workload

        return main_workload(args, target_path)
    cfg = replace(cfg, methods=methods, only_ks=ks)
    structured = _structured(args, bool(spec))
    cfg = replace(cfg, hf_rows=False) if structured else cfg  # transformers' generate takes no response_format
    tp_n = _extras(args, draft_path)
    model = {"device": args.device, "dtype": args.dtype, "enforce_eager": getattr(args, "enforce_eager", False)}
    target_cfg = validate(ModelConfig, {"path": target_path, **model})
    draft_cfg = validate(ModelConfig, {"path": draft_path, **model}) if draft_path else None
    target = load_model(target_cfg)
    head = _eagle_head(args, target_path)
    engine = SpecEngine(target, load_model(draft_cfg) if draft_cfg else None, eagle_head=head)
    conversations = formats = None
    if structured:
        prompts, formats = json_prompts(target.tokenizer, cfg.prompts)
        kind = "json-schema"
    elif spec:
        prompts, conversations = spec_bench_prompts(target.tokenizer, spec[0], cfg.max_new_tokens, target.max_positions)
        kind = "spec-bench"
    else:
        prompts, kind = bench_prompts(target.tokenizer, cfg, questions, held_out)
    rows, meta = run_bench(engine, prompts, cfg, conversations=conversations, formats=formats)
    meta["prompts_kind"] = kind
    if formats is not None:
        eos = set(target.eos_token_ids)
        meta["json_schema_valid"] = {r.name: valid_outputs(target.tokenizer, engine.verifier.vocab_size, eos,
                                                           r.outputs, formats) for r in rows}  # fmt: skip
        print(f"specserve bench: whole valid JSON outputs (of {len(prompts)} a row): {meta['json_schema_valid']}")
    if spec:
        meta["spec_bench"] = spec_bench_meta(args.spec_bench, spec[1], conversations)
    if args.distributed:
        from specserve.cluster.bench.distributed import add_distributed, add_eagle_distributed

        add_distributed(rows, meta, target_path, draft_path, prompts, cfg, args.device)
        if head is not None:
            add_eagle_distributed(rows, meta, target_cfg, str(head), prompts, cfg)
    if tp_n > 1:
        from specserve.cluster.bench.tp import tp_rows

        extra, profile = tp_rows(target_cfg, draft_cfg, prompts, cfg.max_new_tokens, best_draft_k(cfg), rows[0], tp_n)
        rows += extra
        meta["tensor_parallel"] = {"world_size": tp_n, **profile}
    levels = _load(args, target_path, prompts, meta, engine, cfg.max_new_tokens, rows[0]) if args.load else []
    _report(args, rows, meta, levels, machine_info(target.device, target.dtype))
    return 0


def _load(args, target_path: str, prompts: list[list[int]], meta: dict, engine: SpecEngine, max_new_tokens: int,
          target_only: Row):  # fmt: skip
    """The served load bench (concurrency.py) on the bench's target with its default drafting (the demo's: its draft
    model), the same prompts, then the orchestration tax (orchestration.py); its JSON entry goes to meta['load']."""
    from specserve.cluster.app_config import DEMO
    from specserve.cluster.bench.concurrency import QUICK_LOAD, LoadConfig, bench_app, load_meta, load_rows
    from specserve.cluster.bench.orchestration import measure_tax
    from specserve.workers.runtime.threads import worker_threads

    target, draft = (target_path, None) if args.target else (DEMO, DEMO)
    cfg = _load_config(args, QUICK_LOAD if args.quick else LoadConfig())
    pool = bench_app(target, draft, args.device, args.dtype)["applications"][0]["args"]["models"][0]["target_pool"]
    threads = worker_threads("auto", "target", engine.target.device.type, pool["num_cpus"], 1)
    tax = []

    def tax_of(client) -> None:
        tax.append(measure_tax(client, engine, prompts, max_new_tokens, threads, target_only.tokens_per_s))

    steps = getattr(args, "num_scheduler_steps", None)  # the app's model settings beyond its defaults, then:
    fields = {"enforce_eager": getattr(args, "enforce_eager", False)} | ({"decode_steps": steps} if steps else {})
    levels, drafting, burst = load_rows(target, draft, prompts, cfg, args.device, args.dtype, then=tax_of,
                                        fields=fields)  # fmt: skip
    meta["load"] = load_meta(levels, cfg, drafting, tax[0].to_dict() if tax else None, burst) | {
        "fields": fields, "orchestration_line": tax[0].line() if tax else None,
        "burst_line": burst.line() if burst else None}  # fmt: skip
    return levels


def _load_config(args, cfg):
    """--streams and --load-fixed-k (parsed by the CLI) over the load bench's config."""
    if getattr(args, "streams", None):
        cfg = replace(cfg, levels=args.streams)
    if (fixed := getattr(args, "load_fixed_k", None)) is not None:
        cfg = replace(cfg, fixed_ks=fixed, fixed_k_levels=cfg.fixed_k_levels if fixed else ())
    return cfg


def _report(args, rows: list[Row], meta: dict, levels: list, machine: dict) -> None:
    """The table (and the load bench's) on stdout; the JSON file and plots when asked for."""
    print(format_table(rows, meta))
    if levels:
        from specserve.cluster.bench.load_report import format_levels, load_header

        load = meta["load"]
        print(load_header(load))
        print(format_levels(levels))
        for line in (load["orchestration_line"], load["burst_line"]):
            if line:
                print(line)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(to_json(rows, meta, machine), f, indent=2)
    if args.plot:
        plot(rows, meta, args.plot)
        if levels:
            from specserve.cluster.bench.load_report import plot_levels

            root, ext = os.path.splitext(args.plot)
            plot_levels(levels, f"{root}-load{ext or '.png'}")
