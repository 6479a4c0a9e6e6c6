"""`specserve bench --target NAME --json-schema`: the structured-output rows (chat questions asking for JSON, each
answered under its schema's response_format, speculation on vs off, every output checked), on a tiny model; the flag
refused beside the sections that take no response_format."""

import json

import pytest

from specserve.cluster.bench.structured import SCHEMAS, json_prompts, valid_outputs, with_formats
from specserve.cluster.cli.main import main
from specserve.workers.config.request import SamplingParams
from specserve.workers.config.settings import ModelConfig
from specserve.workers.runtime.loading import load_model


def test_cli_quick_json_schema_rows_answer_under_their_schemas(tiny_target, tmp_path, capsys):
    out = tmp_path / "bench.json"
    code = main(["bench", "--quick", "--target", tiny_target, "--json-schema", "--methods", "ngram", "--k", "4",
                 "--json", str(out), "--device", "cpu"])  # fmt: skip
    printed = capsys.readouterr()
    assert code == 0, printed.err
    result = json.loads(out.read_text())
    meta, rows = result["meta"], result["rows"]
    assert meta["prompts_kind"] == "json-schema" and meta["prompts"] == 4
    assert {r["method"] for r in rows} == {"target-only", "ngram"}  # no HF rows: generate takes no response_format
    assert all(r["identical"] for r in rows if r["temperature"] == 0 and r["name"] != "target-only greedy")
    valid = meta["json_schema_valid"]
    assert set(valid) == {r["name"] for r in rows} and all(0 <= v <= 4 for v in valid.values())
    assert "whole valid JSON outputs" in printed.out


def test_each_prompt_is_answered_under_its_format_and_outputs_are_checked_whole(tiny_target):
    loaded = load_model(ModelConfig(path=tiny_target, device="cpu"))
    tokenizer = loaded.tokenizer
    prompts, formats = json_prompts(tokenizer, 4)
    assert len({f.json_schema for f in formats}) == len(SCHEMAS) == 3 and formats[3] == formats[0]
    seen = []
    run = with_formats(lambda prompt, params: seen.append(params.response_format) or ([], None), prompts, formats)
    run(prompts[1], SamplingParams())
    run(prompts[1][:5], SamplingParams())  # a warm-up's prefix: as it comes
    assert seen == [formats[1], None]
    eos = sorted(loaded.eos_token_ids)
    weather = {"city": "Paris", "temperature_c": 21.5, "conditions": "sunny"}
    whole = tokenizer(json.dumps(weather), add_special_tokens=False)["input_ids"] + eos[:1]
    outputs = [whole, whole[:-1], whole[:-3] + eos[:1], [tokenizer("x")["input_ids"][-1]]]
    assert valid_outputs(tokenizer, loaded.vocab_size, set(eos), outputs, [formats[2]] * 4) == 1


@pytest.mark.parametrize("extra", [["--load"], ["--distributed"], ["--tensor-parallel", "2"]])
def test_json_schema_rows_refuse_the_sections_without_a_response_format(tiny_target, capsys, extra):
    code = main(["bench", "--quick", "--target", tiny_target, "--json-schema", *extra])
    err = capsys.readouterr().err
    assert code == 2 and "json_schema" in err and extra[0] in err
