"""`specserve draft train` rebuilds a head from nothing but its target (data, then training, both resumable) and
`specserve draft eval` measures it on held-out chat questions, recording its acceptance for the k policy."""

import json

import pytest

from specserve.cluster.cli.main import main
from specserve.workers.speculation.eagle.config import config_from_json


@pytest.mark.slow
def test_draft_train_then_eval_records_acceptance(chatty_target, tmp_path, capsys):
    head, data = tmp_path / "head", tmp_path / "data"
    args = ["draft", "train", "--target", chatty_target, "--out", str(head), "--data", str(data),
            "--answer-tokens", "50", "--steps", "6", "--ttt-steps", "2", "--draft-vocab-size", "64"]  # fmt: skip
    assert main(args) == 0
    out = capsys.readouterr().out
    assert f"head saved to {head}" in out and "after 6 steps" in out
    manifest = json.loads((data / "manifest.json").read_text())
    assert manifest["shards"] and (head / "model.safetensors").is_file()

    assert main(args[:-6] + ["--steps", "8", "--ttt-steps", "2", "--draft-vocab-size", "64"]) == 0  # resumes: 2 more
    assert "after 8 steps" in capsys.readouterr().out
    assert json.loads((data / "manifest.json").read_text())["shards"] == manifest["shards"]  # data was enough

    code = main(["draft", "eval", "--target", chatty_target, "--head", str(head), "-k", "3", "--questions", "2",
                 "--max-new-tokens", "12", "--record"])  # fmt: skip
    assert code == 0
    table = capsys.readouterr().out
    for method in ("ngram", "eagle", "eagle+ngram"):
        assert any(line.startswith(method + " ") for line in table.splitlines()), table
    acceptance = config_from_json(json.loads((head / "config.json").read_text()), head).acceptance
    assert acceptance is not None and len(acceptance) == 3 and all(0.0 <= a <= 1.0 for a in acceptance)


def test_draft_eval_without_a_packaged_head_says_how_to_get_one(chatty_target, capsys):  # noqa: F811
    assert main(["draft", "eval", "--target", chatty_target]) == 2
    err = capsys.readouterr().err
    assert "no EAGLE-3 head is packaged" in err and "specserve draft train" in err
