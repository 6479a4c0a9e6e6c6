"""The GPU check's driver (cluster/bench/gpu_check.py): steps under time limits and a budget, what it keeps when a
step fails or outruns it, and the summary of the issue's figures from the benches' JSON."""

import json
import sys

import torch

from specserve.cluster.bench.gpu_check import Check, Step, summarize


def _py(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def test_a_step_that_outruns_its_limit_is_stopped_and_the_check_goes_on(tmp_path):
    check = Check(tmp_path, budget_s=60)
    slow = check.run(Step("slow", _py("import time; time.sleep(30)"), timeout_s=1.5))
    assert slow.rc == 124 and slow.seconds < 20
    done = check.run(Step("next", _py("print('fine')"), timeout_s=30))
    assert done.rc == 0
    saved = json.loads((tmp_path / "gpu-check.json").read_text())
    assert [s["name"] for s in saved["steps"]] == ["slow", "next"]
    assert [s["rc"] for s in saved["steps"]] == [124, 0]
    assert "== slow: rc 124" in (tmp_path / "gpu-check.log").read_text()


def test_steps_are_skipped_once_the_budget_is_spent_and_a_failure_keeps_its_output(tmp_path):
    check = Check(tmp_path, budget_s=1.0)
    step = check.run(Step("late", _py("print('never')"), timeout_s=30))
    assert step.rc is None and "budget" in step.skipped
    (tmp_path / "b").mkdir()
    check = Check(tmp_path / "b", budget_s=60)
    failed = check.run(Step("fails", _py("import sys; print('why it failed'); sys.exit(3)"), timeout_s=30))
    assert failed.rc == 3
    assert "why it failed" in (tmp_path / "b" / "gpu-check.log").read_text()


def test_only_runs_the_named_steps(tmp_path):
    check = Check(tmp_path, budget_s=60, only=("b",))
    a = check.run(Step("a", _py("pass"), timeout_s=30))
    b = check.run(Step("b", _py("pass"), timeout_s=30))
    assert (a.rc, a.skipped, b.rc) == (None, "not in --only", 0)


def _bench(rows: list[dict], load: dict | None = None) -> dict:
    return {"machine": {}, "meta": {"load": load} if load else {}, "rows": rows}


def test_the_summary_names_the_issues_figures(tmp_path):
    base = {
        "name": "target-only greedy",
        "method": "target-only",
        "temperature": 0,
        "tokens_per_s": 100.0,
        "identical": None,
    }
    hf = {
        "name": "hf generate greedy",
        "method": "hf-generate",
        "temperature": 0,
        "tokens_per_s": 50.0,
        "identical": True,
    }
    eagle = {
        "name": "specserve eagle-tree k=auto greedy",
        "method": "eagle-tree",
        "temperature": 0,
        "tokens_per_s": 180.0,
        "identical": False,
    }
    load = {
        "served_off_1_stream_tok_s": 60.0,  # the load level: short requests, each with its prefill
        "orchestration": {"vs_same_threads": 0.8, "vs_all_cores": 0.7},
        "levels": [
            {"streams": 1, "speculation": "off", "vs_off": None, "identical": None},
            {"streams": 1, "speculation": "default", "vs_off": 1.6, "identical": True},
            {"streams": 64, "speculation": "default", "vs_off": 0.9, "identical": False, "identical_share": 0.75},
        ],
    }
    (tmp_path / "served.json").write_text(json.dumps(_bench([base, hf], load)))
    (tmp_path / "bf16.json").write_text(json.dumps(_bench([base, hf, eagle])))
    (tmp_path / "hf-static.json").write_text(
        json.dumps({"eager": {"tokens_per_s": 40.0}, "static": {"tokens_per_s": 120.0}})
    )
    summary = summarize(tmp_path)
    assert summary["served"]["served_off_1_stream_vs_in_process"] == 0.8
    assert summary["served"]["served_off_1_stream_vs_in_process_all_cores"] == 0.7
    assert summary["served"]["served_default_vs_off"] == {"1": 1.6, "64": 0.9}
    assert summary["served"]["served_identical"] is False
    assert summary["served"]["served_identical_share"]["64"] == 0.75
    assert summary["bf16"]["target_only_vs_hf_generate"] == 2.0
    assert summary["bf16"]["greedy_rows_identical"] == "1/2"
    assert summary["hf_static_vs_eager"] == 3.0
    assert "fp32" not in summary  # a step that wrote nothing


def test_the_tests_and_fp32_run_before_the_served_step_and_the_rows_take_the_methods_asked_for(tmp_path):
    import argparse

    from specserve.cluster.bench.gpu_check import main_gpu_check

    args = argparse.Namespace(out=str(tmp_path), budget_s=60.0, device="cpu", model_wheel=None, streams="1,16",
                              k="auto", methods="eagle-tree+ngram", skip_tests=False, only="none")  # fmt: skip
    main_gpu_check(args)
    steps = json.loads((tmp_path / "gpu-check.json").read_text())["steps"]
    assert [s["name"] for s in steps] == [
        "environment",
        "model",
        "tests",
        "tp",
        "head-profile",
        "fp32",
        "served",
        "bf16",
        "bf16-eager",
        "hf-static",
    ]
    assert all(s["skipped"] == "not in --only" for s in steps)
    fp32 = next(s for s in steps if s["name"] == "fp32")["argv"]
    assert fp32[fp32.index("--methods") + 1] == "eagle-tree+ngram" and fp32[fp32.index("--k") + 1] == "auto"
    served = next(s for s in steps if s["name"] == "served")["argv"]
    assert served[served.index("--streams") + 1] == "1,16"


def test_the_head_profile_times_and_profiles_a_heads_chain_and_tree(models_dir, device):
    """The check's head-profile step on a real head (a random one on the tiny target): the planner's fitted cost, a
    chain's and a tree's time, and the operators that took it."""
    from specserve.cluster.bench.head_profile import placement, profile_drafter
    from specserve.workers.config.settings import ModelConfig
    from specserve.workers.runtime.loading import load_model
    from specserve.workers.speculation.eagle.loading import load_eagle_drafter
    from tests.helpers.eagle_heads import random_head
    from tests.helpers.workers import save_tiny_llama

    path = save_tiny_llama(models_dir / "eagle_target", seed=4, layers=8, hidden=32)
    target = load_model(ModelConfig(path=path, device=device))
    drafter = load_eagle_drafter(target, random_head(target.model.config, 64, seed=1, std=0.3))
    result = profile_drafter(drafter, device, k=4, reps=2)
    assert result["chain_ms"] > 0 and result["tree_ms"] > 0 and result["step_ms"] >= 0
    ops = [entry["op"] for entry in result["tree_top"]]
    assert ops and any("mm" in op or "linear" in op or "matmul" in op for op in ops)
    assert not drafter.drafting._requests  # the profile's request is gone
    assert f"{torch.device(device)} {target.dtype}" in "".join(placement(drafter))


def test_the_served_eager_step_runs_only_when_named(tmp_path):
    import argparse

    from specserve.cluster.bench.gpu_check import main_gpu_check

    def names(only: str) -> list[str]:
        args = argparse.Namespace(out=str(tmp_path / only), budget_s=0.0, device="cpu", model_wheel=None,
                                  streams="1", k="auto", methods=None, skip_tests=True, only=only)  # fmt: skip
        main_gpu_check(args)
        return [s["name"] for s in json.loads((tmp_path / only / "gpu-check.json").read_text())["steps"]]

    assert "served-eager" not in names("served")
    assert "served-eager" in names("served-eager")  # listed (the zero budget skips running it)
    argv = next(s for s in json.loads((tmp_path / "served-eager" / "gpu-check.json").read_text())["steps"]
                if s["name"] == "served-eager")["argv"]  # fmt: skip
    assert "--enforce-eager" in argv and argv[argv.index("--streams") + 1] == "1"
    assert "served-unary" not in names("served") and "served-unary" in names("served-unary")
    steps = json.loads((tmp_path / "served-unary" / "gpu-check.json").read_text())["steps"]
    unary = next(s["argv"] for s in steps if s["name"] == "served-unary")
    assert unary[unary.index("--num-scheduler-steps") + 1] == "1" and "--enforce-eager" not in unary
