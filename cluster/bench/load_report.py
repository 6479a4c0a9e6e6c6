"""The served load bench's report (cluster/bench/concurrency.py's rows): the line above its table, the table and
the plot (the rows' JSON is concurrency.py's `levels_json`)."""

from __future__ import annotations

from specserve.cluster.bench.concurrency import DEFAULT, OFF, LevelRow, request_lengths


def load_header(load: dict) -> str:
    """The line above the table: what ran (the JSON entry's `load`)."""
    lengths = "-".join(map(str, request_lengths(load["config"]["new_tokens"])))
    return (f"\nServed load bench (the Serve app over gRPC, drafting {load['drafting']!r}, its default k; greedy, "
            f"{lengths} new tokens a request, closed-loop streams; per level: the default settles, unmeasured, then "
            "off and each mode alternate in pairs; every ratio is to off at the same streams, but 'vs best k': the "
            "default over the fixed k it fares worst against, by their segments of each round):")  # fmt: skip


def _ms(round_ms: dict[str, float], *parts: str) -> str:
    return f"{sum(round_ms[p] for p in parts):.1f}" if round_ms else "-"


def _vs_best(r: LevelRow) -> str:
    if r.vs_best_fixed_k is None:
        return "-"
    ci = r.vs_best_fixed_k_ci95
    return f"{r.vs_best_fixed_k:.2f} ({r.best_fixed_k}" + (f", {ci[0]:.2f}-{ci[1]:.2f})" if ci else ")")


def format_levels(rows: list[LevelRow]) -> str:
    head = ["streams", "speculation", "requests", "agg tok/s", "vs off", "95% CI", "vs best k (95% CI)", "spread",
            "TTFT p50 ms", "TTFT p99 ms", "TPOT p50 ms", "TPOT p99 ms", "tok/round", "identical", "round ms: work",
            "overhead"]  # fmt: skip
    lines = [head]
    for r in rows:
        lines.append([
            str(r.streams), r.speculation, str(r.requests), f"{r.tokens_per_s:.1f}",
            "1.00x" if r.speculation == OFF else ("-" if r.vs_off is None else f"{r.vs_off:.2f}x"),
            "-" if r.ratio_ci95 is None else f"{r.ratio_ci95[0]:.2f}-{r.ratio_ci95[1]:.2f}", _vs_best(r),
            "-" if r.spread is None else f"{r.spread:.0%}",
            f"{r.ttft_ms_p50:.0f}", f"{r.ttft_ms_p99:.0f}", f"{r.tpot_ms_p50:.1f}", f"{r.tpot_ms_p99:.1f}",
            f"{r.tokens_per_round:.2f}",
            "-" if r.identical is None else ("yes" if r.identical else f"NO ({r.identical_share:.0%})"),
            _ms(r.round_ms, "draft_work", "verify_work"), _ms(r.round_ms, "overhead"),
        ])  # fmt: skip
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    out = ["| " + " | ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=True)) + " |" for line in lines]
    out.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(out)


def plot_levels(rows: list[LevelRow], path: str) -> None:
    """Left: each mode's ratio to off at the same streams, with its 95% CI; right: TTFT and TPOT, default vs off."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import ScalarFormatter

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for j, mode in enumerate(dict.fromkeys(r.speculation for r in rows if r.speculation != OFF)):
        sel = [r for r in rows if r.speculation == mode and r.vs_off is not None]
        errs = [(r.vs_off - r.ratio_ci95[0], r.ratio_ci95[1] - r.vs_off) if r.ratio_ci95 else (0, 0) for r in sel]
        xs = [r.streams * 2 ** (0.05 * j) for r in sel]  # the fixed k's beside the default, not on top of it
        ax1.errorbar(xs, [r.vs_off for r in sel], yerr=list(zip(*errs, strict=True)) or None,
                     fmt="o-" if mode == DEFAULT else "x", capsize=3, label=mode)  # fmt: skip
    ax1.axhline(1.0, color="black", linewidth=0.7)
    ax1.set_ylabel("tokens/s over speculation off, same streams")
    for mode, style in ((DEFAULT, "o-"), (OFF, "s--")):
        sel = [r for r in rows if r.speculation == mode]
        xs = [r.streams for r in sel]
        ax2.plot(xs, [r.ttft_ms_p50 for r in sel], style, color="tab:blue", label=f"TTFT p50, {mode}")
        ax2.plot(xs, [r.tpot_ms_p50 for r in sel], style, color="tab:orange", label=f"TPOT p50, {mode}")
        ax2.plot(xs, [r.tpot_ms_p99 for r in sel], style, color="tab:orange", alpha=0.35, label=f"TPOT p99, {mode}")
    ax2.set(yscale="log", ylabel="ms")
    for ax in (ax1, ax2):
        ax.set_xscale("log", base=2)
        ax.set(xticks=sorted({r.streams for r in rows}), xlabel="concurrent streams (closed loop)")
        ax.xaxis.set_major_formatter(ScalarFormatter())
        ax.legend(fontsize=7)
    ax2.yaxis.set_major_formatter(ScalarFormatter())
    fig.suptitle("specserve bench --load: the Serve app, default speculation vs off (greedy)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
