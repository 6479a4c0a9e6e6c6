"""GGUF model sources: converted once into a cached Hugging Face directory that decodes like the GGUF itself."""

import gc
import hashlib
import json
import logging
import shutil
import socket
import subprocess
import threading
import warnings

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

from specserve.workers.config.request import SamplingParams, SpecParams
from specserve.workers.config.settings import ModelConfig
from specserve.workers.errors import ModelLoadError
from specserve.workers.models import gguf_store
from specserve.workers.models.gguf_store import MARKER, converted_dir, file_sha256, is_gguf_file
from specserve.workers.runtime.loading import load_model
from specserve.workers.speculation.engine import SpecEngine
from tests.helpers.gguf_files import CHATML_TEMPLATE, write_tiny_gguf

PROMPTS = ["the cat sat on the mat", "Once upon a time, in a land far away", "def f(x):\n    return"]
TEXTS = ["Hello, world!", " the quick brown fox\n\tjumps", "naïve café – 日本語 🙂", "<|im_start|>user\nhi<|im_end|>"]


@pytest.fixture(autouse=True)
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECSERVE_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


@pytest.fixture(scope="module")
def ggufs(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf")
    return {
        "Q4_1": write_tiny_gguf(root / "tiny-q4_1.gguf", seed=0, quant="Q4_1"),
        "Q8_0-untied": write_tiny_gguf(root / "tiny-q8_0.gguf", seed=1, quant="Q8_0", tied=False),
        "F32": write_tiny_gguf(root / "tiny-f32.gguf", seed=2, quant="F32"),
    }


def load_direct(path):
    """The GGUF loaded by transformers itself, no specserve code in between."""
    model = AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32, local_files_only=True
    ).eval()
    return model, AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name, local_files_only=True)


@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0-untied", "F32"])
def test_converted_model_decodes_like_the_gguf(ggufs, kind):
    path = ggufs[kind]
    # unpacked: its weights as converted (packed layers keep only their packed copy), compared with the GGUF's
    target = load_model(ModelConfig(path=str(converted_dir(path, progress=False)), device="cpu", packed_linears=False))
    direct, tokenizer = load_direct(path)
    ours = target.model.state_dict()
    assert ours.keys() == direct.state_dict().keys()
    assert all(torch.equal(ours[k], v) for k, v in direct.state_dict().items())
    assert target.model.config.tie_word_embeddings == (kind != "Q8_0-untied")

    packed = load_model(ModelConfig(path=str(converted_dir(path, progress=False)), device="cpu"))  # as served
    lengths = []
    for prompt in PROMPTS:
        ids = tokenizer(prompt)["input_ids"]
        with torch.no_grad():
            want = direct.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False)[0, len(ids) :]
        for engine in (SpecEngine(target), SpecEngine(packed)):
            got = engine.generate(ids, SamplingParams(max_new_tokens=16), SpecParams(method="none")).token_ids
            assert list(got) == want.tolist(), prompt
        lengths.append(len(got))
    assert max(lengths) == 16  # not a trivial early EOS on every prompt


def test_converted_tokenizer_round_trips_and_keeps_the_chat_template(ggufs):
    path = ggufs["Q4_1"]
    out = converted_dir(path, progress=False)
    ours = load_model(ModelConfig(path=str(out), device="cpu")).tokenizer
    _, direct = load_direct(path)
    for text in TEXTS:
        ids = ours(text)["input_ids"]
        assert ids == direct(text)["input_ids"], text
        assert ours.decode(ids) == text
    assert ours("<|im_end|>")["input_ids"] == [2]  # control tokens stay whole
    assert (ours.bos_token, ours.eos_token, ours.eos_token_id) == ("<|im_start|>", "<|im_end|>", 2)
    assert ours.chat_template == CHATML_TEMPLATE
    assert json.loads((out / "tokenizer_config.json").read_text())["chat_template"] == CHATML_TEMPLATE
    chat = [{"role": "user", "content": "hi there"}]
    rendered = ours.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert rendered == direct.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert rendered.endswith("<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n")


def test_converted_directory_is_plain_fp32_with_a_source_marker(ggufs):
    path = ggufs["Q4_1"]
    out = converted_dir(path, progress=False)
    data = path.read_bytes()
    assert out.name == hashlib.sha256(data).hexdigest() == file_sha256(path, progress=False)
    assert out.parent.name == "converted"
    source = json.loads((out / MARKER).read_text())
    assert source["file"] == path.name and source["sha256"] == out.name and source["bytes"] == len(data)
    assert source["transformers"]
    for name in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json"):
        assert (out / name).is_file(), name
    assert "quantization_config" not in json.loads((out / "config.json").read_text())  # loads as a plain model
    with safe_open(out / "model.safetensors", "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"F32"}


def test_conversion_and_load_emit_no_python_warnings(ggufs):
    gc.collect()  # objects earlier tests left behind warn when collected; only this code's warnings count here
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = converted_dir(ggufs["Q4_1"], progress=False)
        load_model(ModelConfig(path=str(out), device="cpu"))
    assert [f"{w.category.__name__}: {w.message} ({w.filename}:{w.lineno})" for w in caught] == []


def test_a_copy_of_the_file_reuses_the_cache_without_converting(ggufs, tmp_path, monkeypatch, caplog):
    path = ggufs["Q4_1"]
    with caplog.at_level(logging.INFO, logger=gguf_store.__name__):
        first = converted_dir(path, progress=False)
    assert any(f"converting {path}" in r.getMessage() and first.name[:12] in r.getMessage() for r in caplog.records)

    def fail(*args):
        raise AssertionError("converted again")

    monkeypatch.setattr(gguf_store, "_convert", fail)
    copy = tmp_path / "elsewhere" / "renamed.gguf"
    copy.parent.mkdir()
    shutil.copyfile(path, copy)
    assert converted_dir(copy, progress=False) == first
    assert converted_dir(path, progress=False) == first
    with pytest.raises(AssertionError, match="converted again"):  # a different file is a different entry
        converted_dir(ggufs["F32"], progress=False)


@pytest.mark.parametrize("marker", [None, '{"sha256": "0000"}', "{trunc"])
def test_a_half_written_entry_and_crash_leftovers_are_rebuilt(ggufs, home, marker):
    path = ggufs["Q4_1"]
    digest = file_sha256(path, progress=False)
    final = home / "converted" / digest
    final.mkdir(parents=True)
    (final / "config.json").write_text("{half")  # a crashed or foreign write: no marker, or not this file's
    if marker is not None:
        (final / MARKER).write_text(marker)
    dead = subprocess.Popen(["true"])
    dead.wait()
    leftover = home / "converted" / f".{digest}.{socket.gethostname()}-{dead.pid}.abc123"
    leftover.mkdir()

    assert converted_dir(path, progress=False) == final
    assert json.loads((final / MARKER).read_text())["sha256"] == digest
    assert json.loads((final / "config.json").read_text())["model_type"] == "llama"
    assert not leftover.exists()
    assert [p.name for p in final.parent.iterdir() if p.is_dir()] == [digest]  # no partial directory left
    load_model(ModelConfig(path=str(final), device="cpu"))


def test_losing_the_rename_race_uses_the_winners_directory(ggufs, home, monkeypatch):
    path = ggufs["F32"]
    winner = converted_dir(path, progress=False)
    (winner / "winner.txt").write_text("first")
    kept = home / "kept"
    shutil.move(winner, kept)
    real_convert = gguf_store._convert

    def convert_while_another_process_finishes(path, out, progress):
        real_convert(path, out, progress)
        shutil.copytree(kept, winner)  # the other process renames its complete copy into place first

    monkeypatch.setattr(gguf_store, "_convert", convert_while_another_process_finishes)
    assert converted_dir(path, progress=False) == winner
    assert (winner / "winner.txt").read_text() == "first"
    assert [p.name for p in winner.parent.iterdir() if p.is_dir()] == [winner.name]  # the loser's copy is gone


def test_concurrent_callers_convert_once_and_all_get_the_directory(ggufs, monkeypatch):
    path = ggufs["F32"]
    real_convert, calls = gguf_store._convert, []

    def counting_convert(*args):
        calls.append(args)
        real_convert(*args)

    monkeypatch.setattr(gguf_store, "_convert", counting_convert)
    results, errors = [], []

    def call():
        try:
            results.append(converted_dir(path, progress=False))
        except Exception as e:  # noqa: BLE001 - reported by the assertion below
            errors.append(e)

    threads = [threading.Thread(target=call) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and len(calls) == 1
    assert len(set(results)) == 1 and (results[0] / MARKER).is_file()


def _cuts(data: bytes) -> list[bytes]:
    # inside the header, the metadata (token list), the tensor table and the tensor data
    return [data[:10], data[:200], data[:3000], data[: len(data) // 2], data[:-100]]


def test_bad_files_raise_model_load_errors_naming_the_file(ggufs, tmp_path):
    real = ggufs["Q4_1"].read_bytes()
    cases = {f"truncated-{len(cut)}.gguf": cut for cut in _cuts(real)}
    cases["random.gguf"] = (
        b"GGUF"
        + torch.randint(0, 256, (5000,), generator=torch.Generator().manual_seed(0)).to(torch.uint8).numpy().tobytes()
    )
    cases["text.gguf"] = b"this is not a model\n"
    cases["empty.gguf"] = b""
    for name, data in cases.items():
        bad = tmp_path / name
        bad.write_bytes(data)
        with pytest.raises(ModelLoadError) as err:
            converted_dir(bad, progress=False)
        message = str(err.value)
        assert str(bad) in message and "\n" not in message and "Traceback" not in message, message
        if name in ("text.gguf", "empty.gguf"):
            assert "not a GGUF file" in message
        else:
            assert "truncated or corrupt" in message, message
    converted = tmp_path / "home" / "converted"
    assert not converted.exists() or not [p for p in converted.iterdir() if p.is_dir()]  # no partial directories

    with pytest.raises(ModelLoadError, match="does not exist") as err:
        converted_dir(tmp_path / "missing.gguf")
    assert "missing.gguf" in str(err.value)
    with pytest.raises(ModelLoadError, match="is not a file"):
        converted_dir(tmp_path)


def test_a_file_transformers_cannot_convert_raises_a_readable_error(tmp_path):
    bad = write_tiny_gguf(tmp_path / "odd-tokenizer.gguf", tokenizer_model="bogus")
    with pytest.raises(ModelLoadError) as err:
        converted_dir(bad, progress=False)
    message = str(err.value)
    assert f"could not convert the GGUF file {str(bad)!r}" in message and "bogus" in message
    assert "\n" not in message


def test_an_unsupported_architecture_is_named(tmp_path, monkeypatch):
    bad = write_tiny_gguf(tmp_path / "tinyarch.gguf", arch="tinyarch")
    monkeypatch.setattr(gguf_store, "_convert", lambda *a: pytest.fail("tried to convert"))
    with pytest.raises(ModelLoadError) as err:
        converted_dir(bad, progress=False)
    message = str(err.value)
    assert str(bad) in message and "'tinyarch'" in message and "cannot load from GGUF" in message
    assert "llama" in message and "qwen2" in message  # the loadable ones are listed


def test_is_gguf_file(ggufs, tmp_path):
    assert is_gguf_file(ggufs["Q4_1"])
    (tmp_path / "text.gguf").write_text("GGU")
    assert not is_gguf_file(tmp_path / "text.gguf")
    assert not is_gguf_file(tmp_path / "missing.gguf")
    assert not is_gguf_file(tmp_path)
