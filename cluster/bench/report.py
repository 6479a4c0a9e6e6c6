"""`specserve bench`'s output: the table, the JSON file and the plots, and where the run happened."""

from __future__ import annotations

import os
import platform
import time
from dataclasses import asdict

import torch

from specserve.cluster.bench.rows import Row
from specserve.cluster.bench.spec_bench import format_categories
from specserve.workers.speculation.methods import METHODS

SPEC_METHODS = frozenset(METHODS) - {"none"}  # a row of one of these is specserve's speculation, not a peer's


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


def _disaggregated_lines(meta: dict) -> list[str]:
    """The footer of the disaggregated rows: the draft model's (or n-gram's) and an EAGLE-3 head's methods'."""
    lines = []
    if "disaggregated" in meta:
        d = meta["disaggregated"]
        lines.append(
            f"disaggregated vs in-process (same k): {d['vs_in_process_1_stream']:.2f}x with 1 stream, "
            f"{d['vs_in_process_all_streams']:.2f}x with all streams at once; scheduler overhead p50 "
            f"{d['orchestration_ms_p50']:.2f} ms per round; {d['wire_bytes_per_round']:.0f} bytes on the wire per round"
        )
    for method, e in meta.get("disaggregated_eagle", {}).items():
        where = "prompt lookup's tree built by the scheduler" if method == "ngram-tree" else (
            "the EAGLE-3 head in the Serve app's draft pool")  # fmt: skip
        features = "" if method == "ngram-tree" else (
            f"features {e['feature_bytes_per_round']:.0f} bytes per round ({e['feature_bytes_per_verify_reply']:.0f} "
            f"per verify reply, {e['feature_bytes_per_propose']:.0f} per propose call), ")  # fmt: skip
        lines.append(
            f"disaggregated {method} ({where}, k={e['k']}) vs in-process: {e['vs_in_process_1_stream']:.2f}x with 1 "
            f"stream, {e['vs_in_process_streams']:.2f}x with {e['streams']} streams at once; {features}"
            f"{e['wire_bytes_per_round']:.0f} bytes on the wire per round; scheduler overhead "
            f"{e['orchestration_ms_mean']:.2f} ms a round (mean)"
        )
    return lines


def format_table(rows: list[Row], meta: dict) -> str:
    head = ["row", "tok/s", "speedup", "accept", "E[tok/round]", "t_draft ms", "t_verify ms", "S(k)", "bound B(k)",
            "ratio/bound", "identical", "accepted by position"]  # fmt: skip
    lines = [head]
    for r in rows:
        by_position = " ".join(f"{a:.2f}" for a in r.acceptance_by_position[:8]) if r.acceptance_by_position else "-"
        lines.append([
            r.name + (" *" if r.default else ""), _fmt(r.tokens_per_s, ".1f"),
            "-" if r.speedup is None else _fmt(r.speedup) + "x",
            _fmt(r.acceptance_rate),
            _fmt(r.mean_accepted_length), _fmt(r.t_draft_ms), _fmt(r.t_verify_ms), _fmt(r.leviathan_bound),
            _fmt(r.bound), _fmt(r.ratio_to_bound), _fmt(r.identical) if r.temperature == 0 else "n/a (sampled)",
            by_position,
        ])  # fmt: skip
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    out = ["| " + " | ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=True)) + " |" for line in lines]
    out.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    out.append("")
    if any(r.default for r in rows):
        out.append("*: what the served model drafts with unless a request names a method (its default, k: auto)")
    out += _disaggregated_lines(meta)
    if "tensor_parallel" in meta:
        t = meta["tensor_parallel"]
        out.append(
            f"TP={t['world_size']} decode step: {t['ms_per_step']:.2f} ms, collectives {t['communication_share']:.0%} "
            f"of it (rank 0 profile)"
        )
    if "prompt_lookup_best_k" in meta:
        p = meta["prompt_lookup_best_k"]
        out.append(
            f"hf prompt-lookup N={p['n']} (the best n-gram k) ran after the other rows, beside a target-only rerun "
            f"({p['paired_target_only_tokens_per_s']:.1f} tok/s): its speedup is over that rerun"
        )
    if "eagle_head" in meta:
        h = meta["eagle_head"]
        widths = " ".join(f"{t:.0f}" for t in h["verify_ms_by_width"])
        out.append(
            f"EAGLE-3 head {h['path']}: {h['fixed_ms']:.1f} ms per round + {h['step_ms']:.1f} ms per drafted token "
            f"({h['step_to_target_step']:.3f} of a target step; t_draft = {h['t_head_ms']:.1f} ms a token at k=4); "
            f"verify ms by width 1..{len(h['verify_ms_by_width'])} (what k=auto weighs): {widths}"
        )
    if any(r.acceptance_by_position for r in rows):
        out.append("accepted by position j: the fraction of rounds drafting j or more tokens whose first j drafts were "
                   "all accepted")  # fmt: skip
    if any(r.method == "ngram" for r in rows):
        out.append("n-gram rows: t_draft = 0; their bounds take the tokens drafted per round, which prompt lookup "
                   "cuts short when it finds no match")  # fmt: skip
    kind = {"chat": "held-out chat questions", "text": "held-out prompts",
            "spec-bench": "Spec-Bench questions",
            "json-schema": "chat questions asking for JSON, each under its response_format"}[
        meta.get("prompts_kind", "text")]  # fmt: skip
    per = (" a turn", " a question") if kind == "Spec-Bench questions" else ("", "")
    out.append(
        f"c = t_draft/t_target = {meta['cost_ratio_c']:.3f} (t_draft {meta['t_draft_ms']:.2f} ms, t_target "
        f"{meta['t_target_ms']:.2f} ms); target greedy distinct 4-grams: {meta['distinct_4gram_target_greedy']:.0%}; "
        f"{meta['prompts']} {kind} x up to {meta['max_new_tokens']} new tokens{per[0]} (mean "
        f"{meta['mean_new_tokens']:.0f}{per[1]}, stopping at EOS); {meta['device']}, {meta['dtype']}"
    )
    categories = format_categories(rows, meta)
    return "\n".join(out + ([""] + categories if categories else []))


def to_json(rows: list[Row], meta: dict, machine: dict) -> dict:
    out_rows = []
    for r in rows:
        d = asdict(r)
        d.pop("outputs")
        d.pop("seconds_by_prompt")
        out_rows.append(d)
    return {"machine": machine, "meta": meta, "rows": out_rows}


def _plotted_method(rows: list[Row]) -> str:
    """A draft model's rows when there are some, else the speculative method with the most greedy rows at a fixed k
    (n-gram's sweep, or the method `--methods` asked for)."""
    counts: dict[str, int] = {}
    for r in rows:
        if isinstance(r.k, int) and r.temperature == 0 and r.method in SPEC_METHODS:
            counts[r.method] = counts.get(r.method, 0) + 1
    if not counts:
        return "ngram"
    return "draft" if "draft" in counts else max(counts, key=lambda m: (counts[m], m == "ngram"))


def plot(rows: list[Row], meta: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    method = _plotted_method(rows)
    spec_rows = [r for r in rows if r.method == method and isinstance(r.k, int) and r.temperature == 0]
    ks = [r.k for r in spec_rows]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    ax1.plot(ks, [r.speedup for r in spec_rows], "o-", label="measured speedup")
    ax1.plot(ks, [r.bound for r in spec_rows], "s--", label="bound B(k)")
    ax1.plot(ks, [r.leviathan_bound for r in spec_rows], "^:", label="Leviathan S(k)")
    for r in rows:
        if r.method in ("hf-assisted", "hf-prompt-lookup") and r.temperature == 0 and isinstance(r.k, int):
            label = "HF assisted" if r.method == "hf-assisted" else "HF prompt lookup"
            ax1.axhline(r.speedup, color="gray", linestyle="-.", label=f"{label} k={r.k}")
    ax1.axhline(1.0, color="black", linewidth=0.5)
    ax1.set_xlabel("k (drafted tokens per round)")
    ax1.set_ylabel("speedup over target-only greedy")
    ax1.legend()
    ax2.plot(ks, [r.acceptance_rate for r in spec_rows], "o-", label="acceptance rate")
    ax2.plot(ks, [r.mean_accepted_length for r in spec_rows], "s-", label="tokens per round")
    ax2.set_xlabel("k")
    ax2.legend()
    what = {"draft": "draft model", "ngram": "n-gram drafting"}.get(method, f"method {method}")
    prompts = "held-out chat questions" if meta.get("prompts_kind") == "chat" else "held-out prompts"
    fig.suptitle(f"specserve bench ({what}, greedy, {prompts})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
