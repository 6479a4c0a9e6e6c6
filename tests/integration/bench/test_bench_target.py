"""`specserve bench --target` without a draft model: n-gram and prompt-lookup rows, chat prompts, stops at EOS."""

import json
from types import SimpleNamespace

import pytest

from specserve.cluster.bench.rows import EAGLE_KS, NGRAM_KS, PROMPT_LOOKUP_N, TREE_KS, BenchConfig, Row
from specserve.cluster.bench.runner import format_table, run_bench
from specserve.cluster.cli.main import main
from specserve.cluster.serve.local_ray import init_ray
from specserve.workers.config.request import SamplingParams, SpecParams
from specserve.workers.config.settings import ModelConfig
from specserve.workers.runtime.loading import load_model
from specserve.workers.speculation.engine import SpecEngine
from tests.helpers.plots import saved_figures, series
from tests.helpers.workers import save_tiny_llama

PROMPTS = [[5, 6, 7, 8, 9, 5, 6, 7, 8], [20, 21, 22, 23, 20, 21, 22], [30, 31, 32, 30, 31]]
CFG = BenchConfig(prompts=3, max_new_tokens=24, ks=(2, 4), suite="target")


def _engine(target: str, draft: str | None = None, eos_after: int | None = None) -> SpecEngine:
    """An engine whose target also stops at the token it generates `eos_after` tokens into the first prompt, so
    that generations end early on EOS (a random tiny model rarely samples its tokenizer's EOS)."""
    loaded = load_model(ModelConfig(path=target, device="cpu"))
    engine = SpecEngine(loaded, load_model(ModelConfig(path=draft, device="cpu")) if draft else None)
    if eos_after is not None:
        plain = SamplingParams(max_new_tokens=CFG.max_new_tokens, stop_at_eos=False)
        tokens = engine.generate(PROMPTS[0], plain, SpecParams(method="none")).token_ids
        loaded.model.generation_config.eos_token_id = sorted(loaded.eos_token_ids | {tokens[eos_after]})
        engine.first_stop = tokens.index(tokens[eos_after]) + 1  # where the first prompt's generations end
    return engine


def test_without_a_draft_rows_are_prompt_lookup_and_ngram_and_greedy_rows_match(tiny_target):
    engine = _engine(tiny_target, eos_after=5)
    rows, meta = run_bench(engine, PROMPTS, CFG, progress=False)

    assert {r.method for r in rows} == {"target-only", "hf-generate", "hf-prompt-lookup", "ngram", "ngram-tree"}
    greedy = [r for r in rows if r.temperature == 0]
    assert [r.k for r in greedy if r.method == "ngram"] == [*NGRAM_KS, "auto"]
    assert [r.k for r in greedy if r.method == "ngram-tree"] == [*TREE_KS, "auto"]
    best = max((r for r in greedy if r.method == "ngram" and r.k != "auto"), key=lambda r: r.speedup).k
    assert [r.k for r in greedy if r.method == "hf-prompt-lookup"] == [PROMPT_LOOKUP_N, best]
    assert meta["prompt_lookup_best_k"]["n"] == best
    assert all(r.identical is True for r in greedy[1:])  # every greedy row: the target-only tokens exactly
    # EOS ends the first prompt's generations early in every row, HF's included
    assert all(len(r.outputs[0]) == engine.first_stop < CFG.max_new_tokens for r in greedy)
    assert meta["mean_new_tokens"] < CFG.max_new_tokens

    sampled = [(r.method, r.k) for r in rows if r.temperature > 0]
    assert sampled == [("target-only", None), ("ngram", 4), ("ngram", "auto")]
    assert all(r.identical is None for r in rows if r.temperature > 0)
    # the rows that run what a served model without a head or a draft model drafts with: prompt lookup, k='auto'
    assert [(r.method, r.k) for r in rows if r.default] == [("ngram", "auto")] * 2

    for method in ("ngram", "ngram-tree"):
        ngram = [r for r in rows if r.method == method]
        assert any(r.mean_accepted_length > 1 for r in ngram)  # prompt lookup did draft and get tokens accepted
        assert all(r.t_draft_ms == 0 and r.bound > 0 and r.acceptance_rate is not None for r in ngram)
    assert meta["cost_ratio_c"] == 0 and sorted(meta["t_verify_ms"]) == sorted({*NGRAM_KS, *TREE_KS})
    assert all(r.tokens == sum(len(o) for o in r.outputs) and r.tokens_per_s > 0 for r in rows)


@pytest.mark.slow  # 8 s
def test_with_a_draft_the_draft_and_hf_assisted_rows_are_added(tiny_target, tmp_path):
    same_vocab_draft = save_tiny_llama(tmp_path / "draft", seed=1, layers=1, hidden=32)
    rows, _ = run_bench(_engine(tiny_target, same_vocab_draft), PROMPTS[:2], CFG, progress=False)
    draft = [(r.k, r.temperature) for r in rows if r.method == "draft"]
    assert draft == [(2, 0.0), (4, 0.0), ("auto", 0.0), (4, 0.8), ("auto", 0.8)]
    assert [r.k for r in rows if r.method == "hf-assisted"] == ["hf-default", 4]
    assert [(r.method, r.k) for r in rows if r.default] == [("draft", "auto")] * 2  # a draft model's served default
    assert all(r.identical is True for r in rows if r.temperature == 0 and r.method != "target-only")


@pytest.mark.slow  # 17 s: the fast loop must stay under 5 minutes; CI runs it
def test_with_a_head_the_eagle_rows_are_added_with_acceptance_by_position(tmp_path):
    from tests.helpers.eagle_heads import random_head

    deep_enough = save_tiny_llama(tmp_path / "target", seed=4, layers=8, hidden=32)  # feature layers 2, 4, 5
    loaded = load_model(ModelConfig(path=deep_enough, device="cpu"))
    engine = SpecEngine(loaded, eagle_head=random_head(loaded.model.config, 64, seed=2, std=0.3))
    rows, meta = run_bench(engine, PROMPTS[:2], CFG, progress=False)
    eagle = [(r.method, r.k, r.temperature) for r in rows if r.method.startswith("eagle")]
    greedy_ks = [*EAGLE_KS, "auto"]
    greedy = [(m, k, 0.0) for m in ("eagle", "eagle+ngram") for k in greedy_ks]
    greedy += [(m, k, 0.0) for m in ("eagle-tree", "eagle-tree+ngram") for k in (*TREE_KS, "auto")]
    sampled = [(m, k, 0.8) for m in ("eagle", "eagle+ngram") for k in (4, "auto")] + [("eagle-tree", 8, 0.8)]
    sampled += [("eagle-tree+ngram", "auto", 0.8)]
    assert eagle == greedy + sampled
    assert all(r.identical is True for r in rows if r.temperature == 0 and r.method != "target-only")
    for row in (r for r in rows if r.method.startswith("eagle")):
        positions = row.acceptance_by_position
        assert positions is not None and all(b <= a for a, b in zip(positions, positions[1:], strict=False))
        assert row.t_draft_ms > 0 and row.bound > 0
    head = meta["eagle_head"]
    assert head["path"] == "(in memory)" and head["step_ms"] >= 0 and len(head["verify_ms_by_width"]) == 9


@pytest.mark.slow  # 4 s
def test_hf_assisted_rows_are_skipped_with_a_reason_when_the_draft_vocabulary_is_padded(tiny_target, tiny_draft,
                                                                                        capsys):  # fmt: skip
    rows, _ = run_bench(_engine(tiny_target, tiny_draft), PROMPTS[:1], CFG, progress=False)
    assert "no HF assisted rows" in capsys.readouterr().err
    assert not [r for r in rows if r.method == "hf-assisted"]
    assert all(r.identical is True for r in rows if r.temperature == 0 and r.method != "target-only")


@pytest.mark.slow  # 11 s: as above
def test_cli_quick_bench_on_a_target_with_a_chat_prompts_file(tiny_target, tmp_path, capsys):
    questions = tmp_path / "questions.txt"
    questions.write_text("# questions\nWhat is two plus two?\n\nName a red fruit.\nHow do I sort a list?\n"
                         "Why is the sea salty?\nWhat is a cat?\n")  # fmt: skip
    out = tmp_path / "bench.json"
    args = ["bench", "--quick", "--target", tiny_target, "--no-distributed", "--no-concurrency", "--tensor-parallel",
            "0", "--json", str(out), "--chat-prompts", str(questions), "--device", "cpu"]  # fmt: skip
    code = main(args)
    printed = capsys.readouterr()
    assert code == 0, printed.err
    assert "no chat template" in printed.err  # the plain transcript fallback is said, once
    assert "warn" not in printed.err.lower() and "warn" not in printed.out.lower()
    assert "| specserve ngram k=8 greedy" in printed.out
    result = json.loads(out.read_text())
    assert result["meta"]["prompts"] == 4 and result["meta"]["prompts_kind"] == "chat"  # --quick: the first 4
    assert result["meta"]["max_new_tokens"] == 64
    methods = {r["method"] for r in result["rows"]}
    assert methods == {"target-only", "hf-generate", "hf-prompt-lookup", "ngram", "ngram-tree"}
    for row in result["rows"]:
        assert {"method", "k", "speedup", "tokens_per_s", "acceptance_rate", "identical"} <= set(row)
        assert row["identical"] is (True if row["temperature"] == 0 and row["name"] != "target-only greedy" else None)


@pytest.mark.parametrize("content, message", [("\n# nothing\n", "holds no questions"), (None, "cannot read")])
def test_cli_bad_chat_prompts_file_exits_2_before_loading_models(tmp_path, capsys, content, message):
    path = tmp_path / "questions.txt"
    if content is not None:
        path.write_text(content)
    # the target does not exist: the file is checked first
    code = main(["bench", "--target", str(tmp_path / "no-model"), "--chat-prompts", str(path)])
    err = capsys.readouterr().err
    assert code == 2
    assert "chat_prompts" in err and message in err and "questions.txt" in err


def test_the_demo_suite_keeps_its_rows(tiny_target, tmp_path):
    same_vocab_draft = save_tiny_llama(tmp_path / "draft", seed=1, layers=1, hidden=32)
    cfg = BenchConfig(prompts=1, max_new_tokens=8, ks=(2, 4))
    rows, meta = run_bench(_engine(tiny_target, same_vocab_draft), PROMPTS[:1], cfg, progress=False)
    assert [r.name for r in rows] == [
        "target-only greedy", "hf generate greedy", "hf assisted default greedy", "hf assisted k=4 greedy",
        "specserve k=2 greedy", "specserve k=4 greedy", "specserve k=auto greedy", "specserve ngram k=4 greedy",
        "target-only T=0.8", "hf generate T=0.8", "hf assisted default T=0.8", "hf assisted k=4 T=0.8",
        "specserve k=4 T=0.8", "specserve k=auto T=0.8",
    ]  # fmt: skip
    assert "prompt_lookup_best_k" not in meta and meta["cost_ratio_c"] > 0


@pytest.mark.slow
def test_disaggregated_rows_without_a_draft_model_draft_by_prompt_lookup(tiny_target):
    """Through the Serve app (about a minute on 2 cores), next to the in-process n-gram row, with its footer."""
    import ray

    from specserve.cluster.bench.distributed import add_distributed

    engine = _engine(tiny_target)
    greedy = SamplingParams(max_new_tokens=12)
    base = Row("target-only greedy", "target-only", None, 0.0, tokens_per_s=100.0)
    base.outputs = [engine.generate(p, greedy, SpecParams(method="none")).token_ids for p in PROMPTS]
    init_ray(num_cpus=4, include_dashboard=False, configure_logging=False, log_to_driver=False)
    try:
        cfg = BenchConfig(prompts=3, max_new_tokens=12, suite="target")
        ngram = Row("specserve ngram k=4 greedy", "ngram", 4, 0.0, tokens_per_s=100.0)
        rows, meta = [base, ngram], {}
        add_distributed(rows, meta, tiny_target, None, PROMPTS, cfg, "cpu")
    finally:
        ray.shutdown()
    assert [r.name for r in rows[2:]] == ["serve gRPC e2e ngram k=4 greedy, 1 stream",
                                          "serve gRPC e2e ngram k=4 greedy, 3 streams"]  # fmt: skip
    assert [r.identical for r in rows[2:]] == [True, True]
    d = meta["disaggregated"]
    assert d["vs_in_process_1_stream"] > 0 and d["wire_bytes_per_round"] > 0 and d["orchestration_ms_p50"] > 0


@pytest.mark.slow
def test_with_a_head_the_disaggregated_eagle_rows_are_identical_and_report_feature_bytes(tmp_path):
    """Through the Serve app, the head in the draft pool (about a minute on 2 cores): each head method at 1 stream
    and 6 at once (7 prompts: one stream sends two), beside its in-process row at the best k; greedy identical to
    target-only; acceptance by position and the feature bytes per round in the meta and the footer."""
    import ray
    import torch

    from specserve.cluster.bench.distributed import add_eagle_distributed
    from specserve.cluster.bench.rows import spec_fn
    from specserve.cluster.bench.timing import measure
    from specserve.workers.speculation.eagle.checkpoint import save_head
    from tests.helpers.eagle_heads import random_head

    target_cfg = ModelConfig(path=save_tiny_llama(tmp_path / "target", seed=4, layers=8, hidden=32), device="cpu")
    loaded = load_model(target_cfg)
    head_dir = str(save_head(random_head(loaded.model.config, 64, seed=2, std=0.3), tmp_path / "head", torch.float32))
    engine = SpecEngine(loaded, eagle_head=head_dir)
    prompts = [*PROMPTS, *(p[::-1] for p in PROMPTS), [40, 41, 42, 40, 41]]
    cfg = BenchConfig(prompts=len(prompts), max_new_tokens=16, suite="target")
    plan = [(Row("target-only greedy", "target-only", None, 0.0), spec_fn(engine, "none", 1))]
    for method in ("eagle", "eagle+ngram"):
        plan += [(Row(f"specserve {method} k={k} greedy", method, k, 0.0), spec_fn(engine, method, k)) for k in (2, 4)]
    measure(plan, prompts, cfg, SimpleNamespace(update=lambda n: None))
    rows, meta = [row for row, _ in plan], {}

    init_ray(num_cpus=4, include_dashboard=False, configure_logging=False, log_to_driver=False)
    try:
        add_eagle_distributed(rows, meta, target_cfg, head_dir, prompts, cfg)
    finally:
        ray.shutdown()

    assert len(rows) == 9 and list(meta["disaggregated_eagle"]) == ["eagle", "eagle+ngram"]
    position_bytes = 3 * 32 * 2  # three float16 hidden states a position
    table = format_table(rows, {**meta, **FOOTER_META})
    for method, d in meta["disaggregated_eagle"].items():
        best = max((r for r in rows if r.method == method), key=lambda r: r.tokens_per_s)
        disaggregated = rows[rows.index(best) + 1 : rows.index(best) + 3]
        assert [r.name for r in disaggregated] == [f"disaggregated {method} k={best.k} greedy, 1 stream",
                                                   f"disaggregated {method} k={best.k} greedy, 6 streams"]  # fmt: skip
        assert [r.identical for r in disaggregated] == [True, True]
        assert all(r.acceptance_by_position and r.tokens_per_s > 0 for r in disaggregated)  # they drafted
        assert (d["k"], d["streams"]) == (best.k, 6) and d["vs_in_process_1_stream"] > 0 < d["vs_in_process_streams"]
        assert min(d["feature_bytes_per_verify_reply"], d["feature_bytes_per_propose"]) >= position_bytes
        assert d["wire_bytes_per_round"] > d["feature_bytes_per_round"] > 0 and d["orchestration_ms_mean"] > 0
        assert f"disaggregated {method} (the EAGLE-3 head" in table
        assert f"features {d['feature_bytes_per_round']:.0f} bytes per round" in table


# What format_table's last line reads from a run's meta
FOOTER_META = {"cost_ratio_c": 0.0, "t_draft_ms": 0.0, "t_target_ms": 1.0, "distinct_4gram_target_greedy": 1.0,
               "prompts": 7, "max_new_tokens": 16, "mean_new_tokens": 16.0, "device": "cpu",
               "dtype": "float32"}  # fmt: skip


def test_the_plot_shows_the_methods_rows_asked_for(tmp_path, monkeypatch):
    """`--methods eagle+ngram --k 3,5` rows are what the plot draws (it drew n-gram's, none there: an empty figure);
    a draft model's sweep when there is one; n-gram's otherwise. Checked by the figure's series, point by point."""
    from specserve.cluster.bench.report import _plotted_method, plot

    def row(method, k, speedup=1.5):
        n = k if isinstance(k, int) else 4
        return Row(f"{method} k={k}", method, k, 0.0, speedup=speedup, acceptance_rate=0.4 * n / 3,
                   mean_accepted_length=2.0 + n / 10, bound=speedup + 0.1, leviathan_bound=speedup + 0.2)  # fmt: skip

    asked = [Row("target-only greedy", "target-only", None, 0.0), row("hf-prompt-lookup", 10, 1.02),
             row("eagle+ngram", 3), row("eagle+ngram", 5, 1.4), row("eagle+ngram", "auto", 1.45)]  # fmt: skip
    assert _plotted_method(asked) == "eagle+ngram"
    assert _plotted_method([*asked, row("draft", 2)]) == "draft"
    assert _plotted_method([row("ngram", 2), row("eagle", 3), row("ngram", 4)]) == "ngram"
    figures = saved_figures(monkeypatch)
    plot(asked, {"prompts_kind": "chat"}, str(tmp_path / "p.png"))
    assert (tmp_path / "p.png").is_file() and len(figures) == 1
    speed, accept = (series(ax) for ax in figures[0].axes)
    assert speed["measured speedup"] == [(3, 1.5), (5, 1.4)]  # the fixed k's rows of the method asked for
    assert speed["bound B(k)"] == [(3, 1.6), (5, pytest.approx(1.5))]
    assert speed["Leviathan S(k)"] == [(3, 1.7), (5, pytest.approx(1.6))]
    assert {y for _, y in speed["HF prompt lookup k=10"]} == {1.02}  # a level line
    assert accept["acceptance rate"] == [(3, pytest.approx(0.4)), (5, pytest.approx(2 / 3))]
    assert accept["tokens per round"] == [(3, 2.3), (5, 2.5)]
    assert "method eagle+ngram" in figures[0].get_suptitle()
