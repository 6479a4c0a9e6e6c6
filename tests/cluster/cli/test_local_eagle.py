"""`specserve generate --local` with an EAGLE-3 head: --draft HEAD_DIR or 'eagle' (the target's packaged head), and
the packaged head by default; method eagle+ngram in process. Greedy output identical to --no-spec. (The head on its own
draft worker: tests/integration/disaggregated/test_eagle.py, through the Serve app.)"""

import json
from types import SimpleNamespace

import pytest
import torch

from specserve.cluster.cli import local
from specserve.cluster.cli.main import main
from specserve.workers.config.settings import ModelConfig
from specserve.workers.models import packaged_heads
from specserve.workers.runtime.loading import load_model
from specserve.workers.speculation.eagle.checkpoint import save_head
from tests.helpers.eagle_heads import random_head
from tests.helpers.workers import save_tiny_llama

PROMPT = "def add(a, b):\n    return a + b\n\ndef add(a, b):"


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> SimpleNamespace:
    """An 8-layer target (the head reads the features of layers 2, 4, 5) and a random head saved beside it."""
    root = tmp_path_factory.mktemp("cli_eagle")
    target = save_tiny_llama(root / "target", seed=4, layers=8, hidden=32)
    config = load_model(ModelConfig(path=target, device="cpu")).model.config
    head = save_head(random_head(config, 64, seed=2, std=0.3), root / "head", torch.float32)
    return SimpleNamespace(target=target, head=str(head))


def generate(capsys, target: str, *flags: str) -> dict:
    code = main(["generate", PROMPT, "--local", "--target", target, "--max-new-tokens", "16", "--k", "3", "--json",
                 "--device", "cpu", *flags])  # fmt: skip
    out = capsys.readouterr()
    assert code == 0, out.err
    return json.loads(out.out)


@pytest.fixture(scope="module")
def no_spec(pair) -> list[int]:
    args = SimpleNamespace(prompt=PROMPT, target=pair.target, draft=None, no_spec=True, temperature=0.0, top_p=1.0,
                           top_k=0, max_new_tokens=16, seed=None, k=3, dtype="float32", device="cpu", chat=False,
                           system=None)  # fmt: skip
    return local.generate_local(args).token_ids


@pytest.fixture
def engines(monkeypatch) -> list[SimpleNamespace]:
    """Every SpecEngine the CLI builds: its draft model and head."""
    made = []
    engine_class = local.SpecEngine

    def spy(target, draft=None, eagle_head=None):
        made.append(SimpleNamespace(draft=draft, eagle_head=eagle_head))
        return engine_class(target, draft, eagle_head=eagle_head)

    monkeypatch.setattr(local, "SpecEngine", spy)
    return made


def test_a_head_directory_drafts_in_process_and_greedy_output_is_identical(pair, no_spec, engines, capsys):
    out = generate(capsys, pair.target, "--draft", pair.head)
    assert out["token_ids"] == no_spec and out["stats"]["drafted"] > 0
    assert [e.eagle_head for e in engines] == [pair.head] and engines[0].draft is None


def test_the_packaged_head_drafts_for_draft_eagle_and_by_default(pair, no_spec, engines, capsys, monkeypatch):
    monkeypatch.setattr(
        packaged_heads, "packaged_head_for", lambda target: pair.head if target == pair.target else None
    )
    named = generate(capsys, pair.target, "--draft", "eagle")
    default = generate(capsys, pair.target)
    assert named["token_ids"] == default["token_ids"] == no_spec
    assert [str(e.eagle_head) for e in engines] == [pair.head, pair.head]
    assert named["stats"]["drafted"] > 0 and default["stats"]["drafted"] > 0


def test_without_a_packaged_head_the_default_stays_prompt_lookup_and_eagle_is_a_clear_error(pair, engines, capsys):
    generate(capsys, pair.target)
    assert [(e.draft, e.eagle_head) for e in engines] == [(None, None)]
    code = main(["generate", PROMPT, "--local", "--target", pair.target, "--draft", "eagle", "--device", "cpu"])
    assert code == 2 and "no EAGLE-3 head is packaged" in capsys.readouterr().err


def test_the_head_drafts_with_its_default_method_unless_no_spec(pair):
    flags = SimpleNamespace(temperature=0.0, top_p=1.0, top_k=0, max_new_tokens=8, seed=None, k="auto", no_spec=False)
    models = local.LocalModels(pair.target, eagle_head=pair.head)
    assert local.request_params(flags, models)[1].method == "eagle-tree+ngram"
    assert local.request_params(flags, local.LocalModels(pair.target))[1].method == "ngram"
    flags.no_spec = True
    assert local.request_params(flags, models)[1].method == "none"


def test_a_missing_model_path_names_its_flag(pair, tmp_path, capsys):
    missing = str(tmp_path / "nonexistent" / "model")
    code = main(["generate", PROMPT, "--local", "--target", missing, "--device", "cpu"])
    err = capsys.readouterr().err
    assert code == 2 and f"--target: no such local path {missing!r}" in err, err
    code = main(["generate", PROMPT, "--local", "--target", pair.target, "--draft", missing, "--device", "cpu"])
    err = capsys.readouterr().err
    assert code == 2 and f"--draft: no such local path {missing!r}" in err, err
