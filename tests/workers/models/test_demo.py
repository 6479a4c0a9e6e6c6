"""The demo family builds end to end (at a tiny size), reproducibly, and loads like any user model."""

import json

import pytest
import torch

from specserve.workers.config.request import SamplingParams, SpecParams
from specserve.workers.config.settings import ModelConfig
from specserve.workers.errors import ModelLoadError
from specserve.workers.models import demo
from specserve.workers.models.demo import TINY_SPEC, DemoSpec, find_demo_family, stdlib_root
from specserve.workers.runtime.loading import load_model
from specserve.workers.speculation.engine import SpecEngine
from specserve.workers.training.demo_build import build_demo_family, install_or_build_demo_family
from specserve.workers.training.demo_corpus import stdlib_corpus


@pytest.fixture(scope="module")
def tiny_family(tmp_path_factory):
    home = tmp_path_factory.mktemp("specserve_home")
    mp = pytest.MonkeyPatch()
    mp.setenv("SPECSERVE_HOME", str(home))
    family = build_demo_family(TINY_SPEC, progress=False)
    yield family
    mp.undo()


def test_corpus_split_is_stable_and_disjoint():
    a, b = stdlib_corpus(), stdlib_corpus()
    assert a.train == b.train and a.held_out == b.held_out
    assert a.train and a.held_out
    assert not set(a.train) & set(a.held_out)
    assert all("/test/" not in p.as_posix() for p in a.train)


def test_tiny_build_end_to_end(tiny_family):
    manifest = tiny_family.manifest
    assert manifest["spec"]["name"] == "tiny"
    assert manifest["train_tokens"] > 1000
    assert manifest["target_final_unlikelihood"] is not None  # the unlikelihood and on-policy stages ran
    assert [d.name for d in tiny_family.root.parent.iterdir()] == [tiny_family.root.name]  # log-probs file removed
    target = load_model(ModelConfig(path=tiny_family.target, device="cpu"))
    draft = load_model(ModelConfig(path=tiny_family.draft, device="cpu"))
    assert target.tokenizer.get_vocab() == draft.tokenizer.get_vocab()
    assert target.model.config.num_hidden_layers == TINY_SPEC.target_layers
    engine = SpecEngine(target, draft)
    spec = engine.generate("def f(x):", SamplingParams(max_new_tokens=16), SpecParams(k=3))
    plain = engine.generate("def f(x):", SamplingParams(max_new_tokens=16), SpecParams(method="none"))
    assert spec.token_ids == plain.token_ids


def test_cached_family_is_found_not_rebuilt(tiny_family, monkeypatch):
    monkeypatch.setenv("SPECSERVE_HOME", str(tiny_family.root.parent.parent))
    assert find_demo_family(TINY_SPEC) == tiny_family
    monkeypatch.setattr(
        "specserve.workers.training.demo_build.build_demo_family", lambda *a, **k: pytest.fail("rebuilt")
    )
    assert install_or_build_demo_family(TINY_SPEC) == tiny_family


def test_build_is_reproducible(tiny_family, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECSERVE_HOME", str(tmp_path))
    again = build_demo_family(TINY_SPEC, progress=False)
    for name in ("target", "draft"):
        a = (tiny_family.root / name / "model.safetensors").read_bytes()
        b = (again.root / name / "model.safetensors").read_bytes()
        assert a == b, f"{name} weights differ between two builds of the same spec"


def test_a_draft_only_recipe_change_reuses_the_target_and_builds_what_a_fresh_build_does(tiny_family, tmp_path,
                                                                                        monkeypatch):  # fmt: skip
    from specserve.workers.training import demo_build

    other_draft = TINY_SPEC.model_copy(update={"draft_onpolicy_steps": 3, "onpolicy_lr": 1e-3})
    assert other_draft.target_recipe() == TINY_SPEC.target_recipe() and other_draft.key() != TINY_SPEC.key()
    fresh_home = tmp_path / "fresh"
    monkeypatch.setenv("SPECSERVE_HOME", str(fresh_home))
    fresh = build_demo_family(other_draft, progress=False)

    monkeypatch.setenv("SPECSERVE_HOME", str(tiny_family.root.parent.parent))  # holds the tiny target's checkpoint
    trained = []
    real_train = demo_build._train
    monkeypatch.setattr(demo_build, "_train", lambda name, *a, **k: trained.append(name) or real_train(name, *a, **k))
    monkeypatch.setattr(demo_build, "_unlikelihood", lambda *a, **k: pytest.fail("the target was fine-tuned again"))
    reused = build_demo_family(other_draft, progress=False)
    assert "target" not in trained and "draft on target text" in trained
    for name in ("target", "draft"):
        files = sorted(p.name for p in (fresh.root / name).iterdir())
        assert files == sorted(p.name for p in (reused.root / name).iterdir()) and "model.safetensors" in files
        for file in files:
            a, b = (fresh.root / name / file).read_bytes(), (reused.root / name / file).read_bytes()
            assert a == b, f"{name}/{file} differs between a fresh build and one from the target checkpoint"
    assert reused.manifest["target_final_loss"] == fresh.manifest["target_final_loss"]


def test_training_device_is_chosen_and_checked():
    from specserve.workers.runtime.loading import resolve_device  # what build_demo_family trains on
    from specserve.workers.training.demo_train import use_bf16

    assert resolve_device("cpu") == torch.device("cpu") and not use_bf16(torch.device("cpu"))  # a fixed fp32 recipe
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    if not torch.cuda.is_available():
        with pytest.raises(ModelLoadError, match="no CUDA device"):
            resolve_device("cuda")


@pytest.mark.slow  # 52 s: a whole quick bench, the load levels on the Serve app included
def test_bench_quick_runs_on_tiny_family(tiny_family, tmp_path, capsys, monkeypatch):
    from specserve.cluster.cli.main import main
    from tests.helpers.plots import saved_figures, series

    figures = saved_figures(monkeypatch)

    corpus = stdlib_corpus(max_files=TINY_SPEC.max_files)
    files = [str(p) for p in corpus.train[:4]]
    out_json, out_png = tmp_path / "bench.json", tmp_path / "bench.png"
    code = main(["bench", "--quick", "--target", tiny_family.target, "--draft", tiny_family.draft, "--device", "cpu",
                 "--prompts-from", *files, "--json", str(out_json), "--plot", str(out_png),
                 "--tensor-parallel", "2"])  # fmt: skip
    assert code == 0
    table = capsys.readouterr().out
    assert "target-only greedy" in table and "specserve draft k=4 greedy" in table and "ngram k=8" in table
    report = json.loads(out_json.read_text())
    assert {"machine", "rows"} <= set(report)
    assert report["machine"]["device"] == "cpu" and report["machine"]["dtype"] == "float32"  # where it really ran
    rows = {r["name"]: r for r in report["rows"]}
    required = {"name", "method", "k", "tokens_per_s", "speedup", "acceptance_rate", "mean_accepted_length", "bound",
                "ratio_to_bound", "identical"}  # fmt: skip
    assert all(required <= set(r) for r in rows.values())
    assert any("hf" in name for name in rows)
    for row in rows.values():
        if row["temperature"] == 0 and row["method"] != "target-only":
            assert row["identical"] is True, row["name"]  # lossless, and HF assisted agrees too
        if row["method"] == "draft":
            assert row["bound"] > 0 and 0 <= row["acceptance_rate"] <= 1
    assert rows["target-only greedy"]["speedup"] == 1.0
    # The plot draws the run's rows: the draft model's fixed-k sweep (a load plot, where levels ran: test_bench_
    # concurrency.py).
    swept = sorted(((r["k"], r) for r in rows.values() if r["method"] == "draft" and isinstance(r["k"], int)
                    and r["temperature"] == 0 and r["name"].startswith("specserve")), key=lambda kr: kr[0])  # fmt: skip
    assert out_png.is_file() and len(figures) == 1 + ("load" in report["meta"])
    speed, accept = (series(ax) for ax in figures[0].axes)
    assert [x for x, _ in speed["measured speedup"]] == [k for k, _ in swept] and swept
    assert [y for _, y in speed["measured speedup"]] == pytest.approx([r["speedup"] for _, r in swept])
    assert [y for _, y in accept["acceptance rate"]] == pytest.approx([r["acceptance_rate"] for _, r in swept])
    # Tensor-parallel rows: lossless through a TP=2 replica, and the collectives' share of a sharded step.
    assert rows["TP=2 target-only greedy"]["identical"] is True and rows["TP=2 target k=4 greedy"]["identical"] is True
    tp = report["meta"]["tensor_parallel"]
    assert tp["world_size"] == 2 and tp["ms_per_step"] > 0 and 0 < tp["communication_share"] < 1


def test_the_packaged_family_installs_without_training_and_matches_the_default_recipe(tmp_path, monkeypatch):
    assert demo.packaged_spec() == DemoSpec(), "the packaged weights are not the default recipe's: regenerate them"
    size = sum(p.stat().st_size for p in demo.PACKAGED.rglob("*") if p.is_file())
    assert size <= 20 * 2**20, f"packaged family is {size / 2**20:.1f} MB (limit 20)"
    monkeypatch.setenv("SPECSERVE_HOME", str(tmp_path))
    family = demo.ensure_demo_family(progress=False)  # what serving calls: it cannot train
    assert family.root.parent.parent == tmp_path and find_demo_family() == family
    manifest = family.manifest
    assert manifest["corpus_root"] == str(stdlib_root()) and manifest["held_out_files"]
    # fp16 on disk, fp32 as configured; unpacked, to count every weight (packed layers keep only their packed copy)
    target = load_model(ModelConfig(path=family.target, device="cpu", packed_linears=False))
    draft = load_model(ModelConfig(path=family.draft, device="cpu"))
    assert next(target.model.parameters()).dtype == torch.float32
    assert target.model.config.num_hidden_layers == DemoSpec().target_layers
    assert sum(p.numel() for p in target.model.parameters()) == manifest["target_params"]
    engine = SpecEngine(target, draft)
    prompt = "import os\n\n\ndef main():\n"
    spec = engine.generate(prompt, SamplingParams(max_new_tokens=24), SpecParams(k=4))
    plain = engine.generate(prompt, SamplingParams(max_new_tokens=24), SpecParams(method="none"))
    assert spec.token_ids == plain.token_ids and spec.stats.accepted > 0


def test_serving_never_trains_a_family_that_is_neither_cached_nor_packaged(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECSERVE_HOME", str(tmp_path))
    with pytest.raises(ModelLoadError, match=r"specserve models build-demo --tiny") as err:
        demo.ensure_demo_family(TINY_SPEC, progress=False)
    assert str(demo.family_dir(TINY_SPEC)) in str(err.value)
    assert not (tmp_path / "models").exists() or not any((tmp_path / "models").iterdir())
    assert demo.install_packaged(TINY_SPEC, progress=False) is None  # the packaged copy is DemoSpec()'s
    assert demo.install_packaged(DemoSpec(), progress=False, root=tmp_path / "absent") is None


def test_build_demo_trains_what_is_neither_cached_nor_packaged(tmp_path, monkeypatch):
    from specserve.workers.training import demo_build

    monkeypatch.setenv("SPECSERVE_HOME", str(tmp_path))
    built = []
    monkeypatch.setattr(demo_build, "build_demo_family", lambda spec, **k: built.append(spec) or "built")
    assert install_or_build_demo_family(TINY_SPEC, progress=False) == "built" and built == [TINY_SPEC]


def test_a_packaged_family_installs_as_it_was_built(tiny_family, tmp_path, monkeypatch):
    from specserve.workers.training.demo_package import package_family

    package_family(tiny_family, dest=tmp_path / "packaged")
    assert demo.packaged_spec(tmp_path / "packaged") == TINY_SPEC
    monkeypatch.setenv("SPECSERVE_HOME", str(tmp_path / "home"))
    family = demo.install_packaged(TINY_SPEC, progress=False, root=tmp_path / "packaged")
    assert family == find_demo_family(TINY_SPEC) and family.root.parent.parent == tmp_path / "home"
    manifest = family.manifest
    assert manifest["weights_dtype"] == "float16" and manifest["corpus_root"] == str(stdlib_root())
    assert manifest["held_out_files"] == tiny_family.manifest["held_out_files"]
    target = load_model(ModelConfig(path=family.target, device="cpu", packed_linears=False))  # every weight, as stored
    built = load_model(ModelConfig(path=tiny_family.target, device="cpu", packed_linears=False))
    for a, b in zip(target.model.parameters(), built.model.parameters(), strict=True):
        assert torch.equal(a, b.half().float())  # the built weights, rounded to fp16
