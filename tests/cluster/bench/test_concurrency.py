"""The served load bench (`specserve bench --load`): its segment order, on/off statistics, requests and report alone,
and one short run on the demo family through the Serve application (slow: it starts Ray)."""

import json
import math
import random

import pytest

from specserve.client import SpecServeClient
from specserve.cluster.bench.concurrency import (
    DEFAULT,
    OFF,
    LevelRow,
    LoadConfig,
    Request,
    Segment,
    _row,
    _segment_order,
    bench_app,
    compare,
    judge_k,
    load_meta,
    load_rows,
    mode_speculation,
    ratio_ci95,
    request_length,
    segment_count,
)
from specserve.cluster.bench.load_report import format_levels, load_header, plot_levels
from specserve.cluster.cli.main import build_parser
from tests.helpers.plots import error_bars, saved_figures, series


@pytest.mark.parametrize("pairs", [4, 8])
def test_segments_alternate_so_that_a_steady_drift_favours_neither_mode(pairs):
    order = _segment_order(pairs)
    assert order[:8] == [False, True, True, False, True, False, False, True]  # off on, on off, on off, off on
    assert all(order[i] != order[i + 1] for i in range(0, len(order), 2))  # every pair has one of each
    on = [i for i, spec in enumerate(order) if spec]
    off = [i for i, spec in enumerate(order) if not spec]
    assert len(on) == len(off) == pairs and sum(on) == sum(off)  # a linear drift in time cancels out
    abab = [spec for _ in range(pairs) for spec in (False, True)]
    assert sum(i for i, spec in enumerate(abab) if spec) > sum(i for i, spec in enumerate(abab) if not spec)


def test_ratio_interval_covers_the_true_ratio_about_95_percent_of_the_time():
    rng = random.Random(0)
    covered, trials = 0, 2000
    for _ in range(trials):  # each pair: the true ratio 0.9 times log-normal noise of 10%
        lo, hi = ratio_ci95([0.9 * math.exp(rng.gauss(0.0, 0.1)) for _ in range(8)])
        covered += lo <= 0.9 <= hi
    assert 0.93 <= covered / trials <= 0.97
    lo, hi = ratio_ci95([0.95, 1.05, 1.0, 1.0])
    assert lo < 1.0 < hi and math.sqrt(lo * hi) == pytest.approx((0.95 * 1.05) ** 0.25)  # around the geometric mean
    assert ratio_ci95([0.8, 0.82, 0.79, 0.81])[1] < 1.0  # consistently slower: the interval excludes a tie
    assert ratio_ci95([1.2]) is None  # one pair: no spread to judge by
    assert ratio_ci95([1.2, math.nan]) is None  # a pair whose off segment committed nothing in its window


def test_requests_differ_in_length_around_the_mean_and_each_mode_gets_the_same_ones():
    lengths = [request_length(i, 32) for i in range(2000)]
    assert min(lengths) == 16 and max(lengths) == 48  # half to one and a half times the mean, ends included
    assert abs(sum(lengths) / len(lengths) - 32) < 1
    assert len(set(lengths[:16])) >= 8  # the streams' first requests do not end together
    assert lengths == [request_length(i, 32) for i in range(2000)]  # fixed per request index
    assert request_length(5, 1) == 1


def test_each_mode_asks_the_server_for_its_speculation():
    default = SpecServeClient.request([1, 2], **mode_speculation(DEFAULT))
    assert not default.HasField("speculation")  # the model's default method and k
    off = SpecServeClient.request([1, 2], **mode_speculation(OFF))
    assert off.speculation.method == "none"
    fixed = SpecServeClient.request([1, 2], **mode_speculation("k=3"))
    assert fixed.speculation.method == "" and fixed.speculation.k == 3  # the default method at k = 3


def _seg(mode: str, window_tokens: list[int], outputs: dict[int, list[int]] | None = None) -> Segment:
    outputs = outputs or {}
    requests = [Request(i, outputs.get(i, [7] * (i + 2)), 0.1 * (i + 1), 0.01, n, 1)
                for i, n in enumerate(window_tokens)]  # fmt: skip
    return Segment(mode, 2.0, requests)


def test_a_mode_is_compared_with_the_off_segments_paired_with_it():
    pairs = [(_seg(DEFAULT, [30, 30]), _seg(OFF, [20, 20])), (_seg(DEFAULT, [24, 24]), _seg(OFF, [24, 24]))]
    other_off = _seg(OFF, [100, 100])  # another mode's pair partner: part of off's row, not of this mode's ratio
    off = _row(2, OFF, [o for _, o in pairs] + [other_off])
    row = _row(2, DEFAULT, [m for m, _ in pairs])
    compare(row, pairs, off)
    assert row.tokens_per_s == pytest.approx(108 / 4.0) and off.tokens_per_s == pytest.approx(288 / 6.0)
    assert row.vs_off == pytest.approx(108 / 88)  # window tokens over the paired off segments' window tokens
    assert row.pair_ratios == pytest.approx([1.5, 1.0])
    lo, hi = row.ratio_ci95
    assert lo < row.vs_off < hi
    assert row.identical is True and row.requests == 4 and row.tokens_per_round == pytest.approx(10 / 4)
    assert row.ttft_ms_p50 == pytest.approx(150.0) and row.tpot_ms_p99 == pytest.approx(10.0)
    one = [(_seg("k=2", [30, 30], {1: [1, 2, 3]}), _seg(OFF, [20, 20], {1: [1, 2, 4]}))]
    fixed = _row(2, "k=2", [one[0][0]])
    compare(fixed, one, _row(2, OFF, [one[0][1]]))
    assert fixed.identical is False and fixed.ratio_ci95 is None  # request 1 differs; one pair: no interval
    assert fixed.identical_share == pytest.approx(0.5) and row.identical_share == 1.0  # of requests 0 and 1


def test_the_default_is_judged_against_each_fixed_k_by_their_segments_of_the_same_round():
    def pair(mode, tokens):  # (mode, off): off's segments differ wildly and must not enter the comparison
        return _seg(mode, [tokens]), _seg(OFF, [tokens * (1 + 3 * len(mode) % 5)])

    pairs = {DEFAULT: [pair(DEFAULT, t) for t in (40, 30, 44, 33, 50)],  # 5 rounds: the fixed k's ran in the first 3
             "k=4": [pair("k=4", t) for t in (40, 30, 44)],
             "k=8": [pair("k=8", t) for t in (50, 30, 40)]}  # fmt: skip
    default = _row(1, DEFAULT, [m for m, _ in pairs[DEFAULT]])
    judge_k(default, pairs)
    # default / k=8 by round: 0.8, 1.0, 1.1 -> geometric mean (0.88)^(1/3); default / k=4: 1.0 each round
    assert default.best_fixed_k == "k=8"
    assert default.vs_best_fixed_k == pytest.approx((0.8 * 1.0 * 1.1) ** (1 / 3))
    lo, hi = default.vs_best_fixed_k_ci95
    assert lo < default.vs_best_fixed_k < hi
    alone = _row(1, DEFAULT, [m for m, _ in pairs[DEFAULT]])
    judge_k(alone, {DEFAULT: pairs[DEFAULT]})  # no fixed k at this level
    assert alone.vs_best_fixed_k is None and alone.best_fixed_k is None
    assert "0.96 (k=8, " in format_levels([default]) and format_levels([alone]).count(" - ") >= 1


def _rows() -> list[LevelRow]:
    rows = []
    for streams in (1, 2):
        pairs = [(_seg(DEFAULT, [30] * streams), _seg(OFF, [20] * streams)),
                 (_seg(DEFAULT, [28] * streams), _seg(OFF, [21] * streams))]  # fmt: skip
        off = _row(streams, OFF, [o for _, o in pairs])
        off.spread = 0.05
        row = _row(streams, DEFAULT, [m for m, _ in pairs])
        compare(row, pairs, off)
        rows += [off, row]
    return rows


def assert_plot_draws(path, figures: list, rows: list[LevelRow]) -> None:
    """plot_levels drew every mode's ratio to off at its streams with its CI, and default's and off's latencies."""
    assert path.is_file() and len(figures) == 1
    ratio_ax, latency_ax = figures[0].axes
    drawn, bars = series(ratio_ax), error_bars(ratio_ax)
    modes = list(dict.fromkeys(r.speculation for r in rows if r.speculation != OFF))
    assert set(drawn) == set(modes)
    for mode in modes:
        sel = [r for r in rows if r.speculation == mode and r.vs_off is not None]
        assert [y for _, y in drawn[mode]] == pytest.approx([r.vs_off for r in sel]), mode
        assert [round(math.log2(x)) for x, _ in drawn[mode]] == [round(math.log2(r.streams)) for r in sel], mode
        ends = [r.ratio_ci95 or (r.vs_off, r.vs_off) for r in sel]
        assert [v for b in bars[mode] for v in b] == pytest.approx([v for e in ends for v in e]), mode
    latency = series(latency_ax)
    for mode in (DEFAULT, OFF):
        sel = [r for r in rows if r.speculation == mode]
        for name, field in (("TTFT p50", "ttft_ms_p50"), ("TPOT p50", "tpot_ms_p50"), ("TPOT p99", "tpot_ms_p99")):
            points = latency[f"{name}, {mode}"]
            assert [x for x, _ in points] == [r.streams for r in sel]
            assert [y for _, y in points] == pytest.approx([getattr(r, field) for r in sel]), (name, mode)


def test_the_report_table_json_and_plot(tmp_path, monkeypatch):
    rows = _rows()
    table = format_levels(rows)
    assert table.count("\n") == 1 + len(rows) and "| 2       | default" in table and "1.00x" in table
    meta = load_meta(rows, LoadConfig(), "ngram", tax={"vs_same_threads": 0.9})
    assert meta["served_off_1_stream_tok_s"] == pytest.approx(41 / 4.0)
    assert meta["orchestration"] == {"vs_same_threads": 0.9}
    assert "drafting 'ngram'" in load_header(meta) and "16-48 new tokens a request" in load_header(meta)
    levels = json.loads(json.dumps(meta))["levels"]
    assert [(r["streams"], r["speculation"]) for r in levels] == [(1, OFF), (1, DEFAULT), (2, OFF), (2, DEFAULT)]
    assert "outputs" not in levels[0] and len(levels[1]["ratio_ci95"]) == 2
    figures = saved_figures(monkeypatch)
    plot_levels(rows, str(tmp_path / "load.png"))
    assert_plot_draws(tmp_path / "load.png", figures, rows)


def test_run_length_and_the_flags():
    cfg = LoadConfig()
    assert segment_count(cfg) == 5 * (1 + 16) + 2 * 4 * 4 * 2  # settles, off/default pairs, off/fixed-k pairs
    parser = build_parser()
    assert parser.parse_args(["bench", "--load"]).load == "chat"
    assert parser.parse_args(["bench", "--concurrency"]).load == "chat"  # the old flag's name
    assert parser.parse_args(["bench", "--load", "multi-turn"]).load == "multi-turn"
    assert parser.parse_args(["bench", "--no-load"]).load is False
    assert parser.parse_args(["bench", "--no-concurrency"]).load is False
    assert parser.parse_args(["bench"]).load is None  # decided by the run (on for the demo family's full run)


def test_the_bench_serves_the_model_as_specserve_serve_does():
    model = bench_app("demo", "demo", "cpu", "float32")["applications"][0]["args"]["models"][0]
    assert model["target"] == model["draft"] == "demo"
    from specserve.cluster.app_config import ModelPairConfig

    assert model["k"] == ModelPairConfig.model_fields["k"].default  # the model's default k: the bench sets none
    assert bench_app("demo", None, "cpu", "float32")["applications"][0]["args"]["models"][0]["draft"] == "ngram"
    assert model["enforce_eager"] is False
    eager = bench_app("demo", "demo", "cuda", "bfloat16", enforce_eager=True)["applications"][0]["args"]["models"][0]
    assert eager["enforce_eager"] is True  # both pools' workers run every pass eagerly (ModelPairConfig)
    assert model["decode_steps"] == ModelPairConfig.model_fields["decode_steps"].default
    steps = bench_app("demo", "demo", "cpu", "float32", decode_steps=1)["applications"][0]["args"]["models"][0]
    assert steps["decode_steps"] == 1  # --num-scheduler-steps: speculation off a call a step


@pytest.mark.slow
def test_load_bench_on_the_demo_family(tmp_path, monkeypatch):
    from transformers import AutoTokenizer

    from specserve.cluster.bench.orchestration import measure_tax
    from specserve.cluster.bench.rows import QUICK, bench_prompts
    from specserve.workers.config.settings import ModelConfig
    from specserve.workers.models.demo import ensure_demo_family
    from specserve.workers.runtime.loading import load_model
    from specserve.workers.speculation.engine import SpecEngine

    family = ensure_demo_family(progress=False)
    root = family.manifest["corpus_root"]
    held_out = [f"{root}/{p}" for p in family.manifest["held_out_files"]]
    prompts, _ = bench_prompts(AutoTokenizer.from_pretrained(family.target), QUICK, None, held_out)
    cfg = LoadConfig(levels=(1, 2), fixed_k_levels=(1,), fixed_ks=(1, 2), pairs=2, fixed_k_pairs=1, segment_s=1.5,
                     settle_s=0.5, new_tokens=8, burst=24)  # fmt: skip
    engine = SpecEngine(load_model(ModelConfig(path=family.target, device="cpu")))
    taxes = []

    def tax_of(client):
        taxes.append(measure_tax(client, engine, prompts, 8, 1, all_cores_tok_s=50.0))

    rows, drafting, burst = load_rows("demo", "demo", prompts, cfg, device="cpu", progress=False, then=tax_of)
    assert drafting == "demo"
    # the burst: every request answered, none refused or lost; the server's queue-time percentiles from its histogram
    assert burst.requests == burst.answered == 24 and burst.refused == {} and burst.lost == 0
    assert 0 < burst.most_running <= 24 and burst.ttft_s["p99"] >= burst.ttft_s["p50"] > 0
    assert burst.queue_s["p99"] >= burst.queue_s["p50"] >= 0 and "24 requests at once: 24 answered" in burst.line()
    (tax,) = taxes  # measured while the app ran: served off at one stream, greedy, gives in-process's tokens
    assert tax.identical and tax.served_threads == 1 and tax.served_off_tok_s > 0
    assert tax.vs_same_threads == pytest.approx(tax.served_off_tok_s / tax.in_process_same_threads_tok_s)
    assert tax.vs_all_cores == pytest.approx(tax.served_off_tok_s / 50.0)
    assert "served speculation off, 1 stream, 8 tokens" in tax.line() and "vs_all_cores" in tax.to_dict()
    by = {(r.streams, r.speculation): r for r in rows}
    assert list(by) == [(1, OFF), (1, DEFAULT), (1, "k=1"), (1, "k=2"), (2, OFF), (2, DEFAULT)]
    for (streams, mode), r in by.items():
        assert r.requests >= streams and r.tokens_per_s > 0 and r.ttft_ms_p99 >= r.ttft_ms_p50 > 0
        assert r.requests <= r.tokens <= 12 * r.requests  # up to 4-12 new tokens per request (or to EOS)
        if mode == OFF:
            assert r.identical is None and r.vs_off is None and len(r.segment_tokens_per_s) == 2 + (streams == 1) * 2
            continue
        assert r.identical is True  # greedy: every request both modes ran gave off's tokens
        off = by[(streams, OFF)]  # each pair's ratio is to an off segment of the same streams
        for ratio, tok_s in zip(r.pair_ratios, r.segment_tokens_per_s, strict=True):
            assert any(ratio == pytest.approx(tok_s / o) for o in off.segment_tokens_per_s)
        assert min(r.pair_ratios) <= r.vs_off <= max(r.pair_ratios)
        assert (r.ratio_ci95 is not None) == (len(r.pair_ratios) >= 2)  # 2 default pairs, 1 fixed-k pair
    # one round with fixed k's: the default over the k it fares worst against, from that round's segments
    one = by[(1, DEFAULT)]
    k = by[(1, one.best_fixed_k)]
    assert one.vs_best_fixed_k == pytest.approx(one.segment_tokens_per_s[0] / k.segment_tokens_per_s[0])
    assert one.vs_best_fixed_k <= one.segment_tokens_per_s[0] / by[(1, "k=1")].segment_tokens_per_s[0] + 1e-9
    assert by[(2, DEFAULT)].vs_best_fixed_k is None  # no fixed k at 2 streams
    meta = load_meta(rows, cfg, drafting, burst=burst)
    assert meta["burst"]["answered"] == 24
    (tmp_path / "load.json").write_text(json.dumps(meta))
    assert json.loads((tmp_path / "load.json").read_text())["served_off_1_stream_tok_s"] == by[(1, OFF)].tokens_per_s
    figures = saved_figures(monkeypatch)
    plot_levels(rows, str(tmp_path / "load.png"))
    assert_plot_draws(tmp_path / "load.png", figures, rows)
    assert "k=2" in format_levels(rows)


def test_the_bursts_queue_time_percentiles_interpolate_within_the_servers_buckets():
    from specserve.cluster.bench.burst import histogram_quantile

    cumulative = {"0.5": 2, "1.0": 6, "2.0": 10, "inf": 10}  # 2 at or below 0.5 s, 4 in (0.5, 1], 4 in (1, 2]
    assert histogram_quantile(0.5, cumulative) == pytest.approx(0.875)  # rank 5: 3 of the 4 in (0.5, 1]
    assert histogram_quantile(0.9, cumulative) == pytest.approx(1.75)
    assert histogram_quantile(0.1, cumulative) == pytest.approx(0.25)
    assert histogram_quantile(0.99, {"1.0": 1, "inf": 2}) == 1.0  # in the +inf bucket: its last finite bound
    assert histogram_quantile(0.5, {"1.0": 0, "inf": 0}) == 0.0
    # what none can exceed caps the bucket it falls in: 9 of 10 in (300, 600], the burst lasted 378 s
    wide = {"300.0": 1, "600.0": 10, "inf": 10}
    assert histogram_quantile(0.99, wide) == pytest.approx(300 + 300 * 8.9 / 9)  # past the burst, uncapped
    assert histogram_quantile(0.99, wide, upper=378.0) == pytest.approx(300 + 78 * 8.9 / 9)  # within the burst
    assert histogram_quantile(0.5, wide, upper=378.0) == pytest.approx(300 + 78 * 4 / 9)
    assert histogram_quantile(0.99, {"1.0": 1, "inf": 2}, upper=0.5) == 0.5
    assert histogram_quantile(0.1, cumulative, upper=5.0) == pytest.approx(0.25)  # a cap past the bucket: unchanged
