"""The CLI contract: `specserve generate --local ... --json` prints one JSON object that other checks rely on."""

import json
import shutil
import subprocess
from types import SimpleNamespace

import pytest

from specserve.cluster.cli.main import main
from specserve.workers.config.request import SamplingParams, SpecParams
from specserve.workers.config.settings import ModelConfig
from specserve.workers.runtime.loading import load_model
from specserve.workers.speculation.engine import SpecEngine


@pytest.fixture
def run_cli(capsys):
    """Run the CLI in this process (the console script calls the same `main`)."""

    def run(*args: str) -> SimpleNamespace:
        code = main(list(args))
        out = capsys.readouterr()
        return SimpleNamespace(returncode=code, stdout=out.out, stderr=out.err)

    return run


@pytest.fixture(scope="module")
def reference(tiny_target):
    engine = SpecEngine(load_model(ModelConfig(path=tiny_target, device="cpu")))
    return engine.generate("def main():", SamplingParams(max_new_tokens=12), SpecParams(method="none"))


@pytest.mark.parametrize("mode", [["--draft", "DRAFT"], ["--draft", "ngram"], ["--no-spec"]])
def test_generate_json_contract_and_lossless(run_cli, tiny_target, tiny_draft, reference, mode):
    mode = [tiny_draft if m == "DRAFT" else m for m in mode]
    proc = run_cli("generate", "def main():", "--local", "--target", tiny_target, *mode, "--k", "3",
                   "--max-new-tokens", "12", "--json", "--device", "cpu")  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert set(out) == {"text", "token_ids", "finish_reason", "stats"}
    assert set(out["stats"]) == {"rounds", "drafted", "accepted", "acceptance_rate", "mean_accepted_length"}
    assert out["token_ids"] == reference.token_ids
    assert out["text"] == reference.text
    assert out["finish_reason"] in ("stop", "length")
    if "--no-spec" in mode:
        assert out["stats"]["drafted"] == 0


def test_generate_sampling_with_seed_is_reproducible(run_cli, tiny_target, tiny_draft):
    # A fixed k: with k='auto' the draft follows measured costs, and sampled tokens follow what was drafted.
    args = ["generate", "x = ", "--local", "--target", tiny_target, "--draft", tiny_draft, "--temperature", "0.9",
            "--top-p", "0.9", "--top-k", "50", "--seed", "7", "--max-new-tokens", "10", "--json",
            "--k", "3"]  # fmt: skip
    first, second = run_cli(*args), run_cli(*args)
    assert first.returncode == 0, first.stderr
    assert json.loads(first.stdout)["token_ids"] == json.loads(second.stdout)["token_ids"]


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--k", "0"], "invalid k:"),
        (["--k", "lots"], "invalid k:"),
        (["--temperature", "-1"], "invalid temperature:"),
        (["--top-p", "1.5"], "invalid top_p:"),
        (["--max-new-tokens", "100000"], "invalid max_new_tokens:"),
    ],
)
def test_generate_bad_input_exits_2_naming_the_field(run_cli, tiny_target, flags, message):
    proc = run_cli("generate", "hi", "--local", "--target", tiny_target, "--no-spec", *flags)
    assert proc.returncode == 2
    assert message in proc.stderr


def test_missing_model_path_is_a_clear_error(run_cli, tmp_path):
    proc = run_cli("generate", "hi", "--local", "--target", str(tmp_path / "missing"), "--no-spec")
    assert proc.returncode == 2
    assert str(tmp_path / "missing") in proc.stderr and "not a known name" in proc.stderr


def test_console_script_is_installed(tiny_target):
    exe = shutil.which("specserve")
    assert exe is not None, "the `specserve` console script is not on PATH; run pip install -e ."
    proc = subprocess.run([exe, "generate", "hi", "--local", "--target", tiny_target, "--no-spec", "--json",
                           "--max-new-tokens", "3"], capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert len(json.loads(proc.stdout)["token_ids"]) >= 1


def test_models_build_demo_installs_the_packaged_family_and_from_scratch_trains(run_cli, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECSERVE_HOME", str(tmp_path))
    from specserve.workers.training.demo_build import find_demo_family

    trained = []  # training stubbed out: it would take half an hour
    monkeypatch.setattr("specserve.workers.training.demo_build.build_demo_family",
                        lambda spec, **k: trained.append((spec, k)) or find_demo_family(spec))  # fmt: skip
    proc = run_cli("models", "build-demo")
    assert proc.returncode == 0 and not trained
    assert json.loads(proc.stdout)["target"].startswith(str(tmp_path)) and "packaged" in proc.stderr
    assert run_cli("models", "build-demo", "--from-scratch").returncode == 0 and len(trained) == 1
    assert trained[0][1]["device"] == "auto"
    assert run_cli("models", "build-demo", "--from-scratch", "--device", "cpu").returncode == 0
    assert trained[1][1]["device"] == "cpu"
