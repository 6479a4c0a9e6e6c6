"""Models by Hugging Face repo id (`org/name[@revision]`), read from a Hugging Face cache built here in the hub's own
layout (models--org--name/{refs, snapshots/<commit>, blobs}) with HF_HUB_OFFLINE on: nothing here reaches a hub
(the hub client's network calls fail the test if made). Also: the precedence of known names and local paths, the
refusal of malformed ids, the files fetched, and the hub's errors as clear ModelLoadErrors."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from types import SimpleNamespace

import huggingface_hub
import pytest
import torch
from huggingface_hub import constants, errors
from huggingface_hub.utils import filter_repo_objects
from transformers import AutoModelForCausalLM

from specserve.workers.config.settings import ModelConfig
from specserve.workers.errors import ModelLoadError
from specserve.workers.models import catalog, gguf_store, hub
from specserve.workers.models.catalog import resolve_model
from specserve.workers.runtime.loading import load_model
from tests.helpers.workers import save_tiny_llama

REPO = "tiny-org/Tiny-Llama.v1"
MAIN = "a" * 40  # commit hashes
V1 = "b" * 40


def cache_repo(cache: Path, repo_id: str, source: Path, commit: str, refs: tuple[str, ...] = ()) -> Path:
    """Put the files of `source` into `cache` as the hub does: content-addressed blobs, a snapshot of symlinks to them
    for `commit`, and refs/<ref> files naming the commit. Returns the snapshot directory."""
    org, name = repo_id.split("/")
    storage = cache / f"models--{org}--{name}"
    snapshot = storage / "snapshots" / commit
    for file in sorted(source.rglob("*")):
        if file.is_dir():
            continue
        data = file.read_bytes()
        blob = storage / "blobs" / hashlib.sha256(data).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = snapshot / file.relative_to(source)
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    for ref in refs:
        (storage / "refs" / ref).parent.mkdir(parents=True, exist_ok=True)
        (storage / "refs" / ref).write_text(commit)  # no newline, like the hub's
    return snapshot


@pytest.fixture
def hf_cache(tmp_path, monkeypatch) -> Path:
    """An empty Hugging Face cache, offline; any network call of the hub client fails the test."""
    cache = tmp_path / "hf-home" / "hub"
    cache.mkdir(parents=True)
    monkeypatch.setenv("HF_HOME", str(cache.parent))
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))  # the hub read the environment at import
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    calls = []

    def no_network(*args, **kwargs):
        calls.append((args, kwargs))
        raise AssertionError("a test reached for the hub")

    for method in ("repo_info", "model_info", "list_repo_tree", "list_repo_files"):
        monkeypatch.setattr(huggingface_hub.HfApi, method, no_network)
    yield cache
    assert not calls, calls


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hub-sources")
    return {
        "main": Path(save_tiny_llama(root / "main", seed=0, layers=1, hidden=16)),
        "v1": Path(save_tiny_llama(root / "v1", seed=1, layers=1, hidden=16)),
    }


def test_a_repo_id_resolves_to_its_cached_snapshot_and_loads_offline(hf_cache, tiny_models):
    snapshot = cache_repo(hf_cache, REPO, tiny_models["main"], MAIN, refs=("main",))
    path = resolve_model(REPO, progress=False)
    assert Path(path) == snapshot
    assert resolve_model(f"{REPO}@main", progress=False) == path
    loaded = load_model(ModelConfig(path=path, device="cpu"))
    direct = AutoModelForCausalLM.from_pretrained(tiny_models["main"], local_files_only=True)
    ids = torch.tensor([loaded.tokenizer.encode("def f(x): return x")])
    assert torch.equal(loaded.model(ids).logits.argmax(-1), direct(ids).logits.argmax(-1))


def test_a_revision_picks_its_snapshot(hf_cache, tiny_models):
    main = cache_repo(hf_cache, REPO, tiny_models["main"], MAIN, refs=("main",))
    v1 = cache_repo(hf_cache, REPO, tiny_models["v1"], V1, refs=("v1.0", "refs/pr/1"))
    assert Path(resolve_model(REPO, progress=False)) == main
    assert Path(resolve_model(f"{REPO}@v1.0", progress=False)) == v1
    assert Path(resolve_model(f"{REPO}@refs/pr/1", progress=False)) == v1
    assert Path(resolve_model(f"{REPO}@{V1}", progress=False)) == v1  # a commit hash needs no ref
    a = AutoModelForCausalLM.from_pretrained(main, local_files_only=True)
    b = AutoModelForCausalLM.from_pretrained(v1, local_files_only=True)
    assert not torch.equal(a.lm_head.weight, b.lm_head.weight)
    with pytest.raises(ModelLoadError, match=f"model {REPO}@v2 is not in the Hugging Face cache .*HF_HUB_OFFLINE"):
        resolve_model(f"{REPO}@v2", progress=False)


def test_an_uncached_repo_offline_is_a_clear_error(hf_cache):
    with pytest.raises(ModelLoadError) as info:
        resolve_model("someone/not-cached", progress=False)
    message = str(info.value)
    assert message.startswith("model someone/not-cached is not in the Hugging Face cache")
    assert str(hf_cache) in message and "HF_HUB_OFFLINE" in message and "hf download someone/not-cached" in message
    assert "Traceback" not in message


def test_a_cached_snapshot_without_weights_is_a_clear_error(hf_cache, tmp_path):
    partial = tmp_path / "partial"
    partial.mkdir()
    (partial / "config.json").write_text("{}")  # what a config-only look-up by another tool leaves
    cache_repo(hf_cache, "someone/partial", partial, MAIN, refs=("main",))
    with pytest.raises(ModelLoadError, match="model someone/partial: the snapshot .* has no safetensors weights"):
        resolve_model("someone/partial", progress=False)


@pytest.mark.parametrize(
    ("ref", "why"),
    [
        ("org/name/extra", "exactly one '/'"),
        ("org/na me", "'na me': 1 to 96 letters"),
        ("org/-name", "not starting or ending with '-' or '.'"),
        ("org/na..me", "'..' and '--' are not allowed"),
        ("/no/such/dir", "starts with '/', as a path does"),
        ("./org/name", "starts with '.', as a path does"),
        ("org/", "an empty organization or name"),
        ("org/name@../main", "revision '../main'"),
        ("org/name@", "revision ''"),
        ("name@main", "exactly one '/'"),
        (f"org/{'x' * 97}", "1 to 96 letters"),
    ],
)
def test_a_malformed_repo_id_is_refused(hf_cache, ref, why):
    with pytest.raises(ModelLoadError) as info:
        resolve_model(ref, progress=False)
    message = str(info.value)
    assert message.startswith(f"no such local path {ref!r}, not a known name")
    assert f"and {ref!r} is not a Hugging Face repo id of the form " in message
    assert why in message


def test_a_plain_unknown_word_lists_repo_ids_as_an_option(hf_cache):
    with pytest.raises(ModelLoadError, match=r"unknown model 'junk': .* nor a Hugging Face repo id \(org/name"):
        resolve_model("junk")


def test_an_existing_local_directory_named_like_a_repo_id_is_a_path(hf_cache, tiny_models, tmp_path, monkeypatch):
    cache_repo(hf_cache, REPO, tiny_models["main"], MAIN, refs=("main",))
    monkeypatch.chdir(tmp_path)
    (tmp_path / REPO).mkdir(parents=True)
    assert resolve_model(REPO) == REPO
    assert resolve_model(f"{REPO}@main") != REPO  # no such path: the repo id


def test_known_names_win(hf_cache, tmp_path, monkeypatch):
    monkeypatch.setattr(catalog, "known_models", lambda table=None: {"tiny-known": object()})
    monkeypatch.setattr(catalog, "pull", lambda name, progress=True: tmp_path / f"{name}.gguf")
    monkeypatch.setattr(gguf_store, "converted_dir", lambda path, progress=True: tmp_path / "converted" / path.stem)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tiny-known").mkdir()  # a same-named local directory loses to the name
    assert resolve_model("tiny-known") == str(tmp_path / "converted" / "tiny-known")
    assert resolve_model("./tiny-known") == "tiny-known"


def test_only_what_loading_needs_is_fetched():
    files = [
        ".gitattributes", "README.md", "config.json", "generation_config.json", "tokenizer.json",
        "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model", "chat_template.jinja",
        "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", "model.safetensors.index.json",
        "consolidated.safetensors", "pytorch_model.bin", "original/consolidated.00.pth", "onnx/model.onnx",
        "onnx/model.safetensors", "modeling_custom.py", "params.json",
    ]  # fmt: skip
    kept = set(filter_repo_objects(files, allow_patterns=hub.ALLOW_PATTERNS, ignore_patterns=hub.IGNORE_PATTERNS))
    assert kept == {
        "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
        "tokenizer.model", "chat_template.jinja", "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors", "model.safetensors.index.json",
    }  # fmt: skip


def test_online_the_download_fetches_what_loading_needs_and_the_model_loads(hf_cache, monkeypatch, tiny_models):
    """A hub stand-in that does what snapshot_download does with the arguments it is given: the repo's files that
    pass allow_patterns / ignore_patterns, at the revision asked for, written into the cache as a snapshot. What
    resolve_model returns is checked by what it holds and by loading it, not by the stand-in's return value."""
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    repo = {"v1.0": tiny_models["v1"], "main": tiny_models["main"]}  # each revision's files
    extras = {"README.md": b"# card", "pytorch_model.bin": b"pickle", "onnx/model.safetensors": b"onnx copy"}
    asked = []

    def snapshot_download(repo_id, revision=None, allow_patterns=None, ignore_patterns=None, local_files_only=False,
                          **kwargs):  # fmt: skip
        asked.append((repo_id, revision, local_files_only))
        source = repo[revision or "main"]
        files = [str(f.relative_to(source)) for f in source.rglob("*") if f.is_file()] + list(extras)
        staged = hf_cache.parent / "hub-side" / (revision or "main")
        for name in filter_repo_objects(files, allow_patterns=allow_patterns, ignore_patterns=ignore_patterns):
            (staged / name).parent.mkdir(parents=True, exist_ok=True)
            (staged / name).write_bytes(extras[name] if name in extras else (source / name).read_bytes())
        revision = revision or "main"
        return str(cache_repo(hf_cache, repo_id, staged, V1 if revision == "v1.0" else MAIN, refs=(revision,)))

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    path = Path(resolve_model(f"{REPO}@v1.0", progress=False))
    assert asked == [(REPO, "v1.0", False)]
    assert path.is_relative_to(hf_cache) and (path / "config.json").is_file() and any(path.glob("*.safetensors"))
    assert not [f for f in ("README.md", "pytorch_model.bin", "onnx") if (path / f).exists()]
    loaded = load_model(ModelConfig(path=str(path), device="cpu"))
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        got = loaded.model(ids).logits
        v1, main = (AutoModelForCausalLM.from_pretrained(tiny_models[r])(ids).logits for r in ("v1", "main"))
    torch.testing.assert_close(got, v1, rtol=1e-4, atol=1e-4)  # the revision asked for
    assert not torch.allclose(got, main, rtol=1e-2, atol=1e-2)  # not main's


def _response(status: int) -> SimpleNamespace:
    return SimpleNamespace(status_code=status, headers={}, request=None)


@pytest.mark.parametrize(
    ("error", "expected"),
    [
        (errors.GatedRepoError("403 gated", response=_response(403)), r"is gated .* set HF_TOKEN"),
        (errors.RepositoryNotFoundError("404", response=_response(404)), r"no such repository .*\(check the name"),
        (errors.RevisionNotFoundError("404", response=_response(404)), r"has no revision 'v9'"),
        (errors.HfHubHTTPError("401 bad token", response=_response(401)), r"answered 401 .* set HF_TOKEN"),
        (errors.HfHubHTTPError("503 down\ndetail", response=_response(503)), r"answered 503 \(503 down\): try again"),
        (errors.LocalEntryNotFoundError("no connection"), r"could not be reached .*`hf download tiny-org/"),
        (ConnectionResetError("reset by peer"), r"failed \(ConnectionResetError: reset by peer\): run again"),
    ],
)
def test_hub_errors_become_clear_model_load_errors(hf_cache, monkeypatch, error, expected):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)

    def snapshot_download(repo_id, **kwargs):
        raise error

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    with pytest.raises(ModelLoadError, match=expected) as info:
        resolve_model(f"{REPO}@v9", progress=False)
    assert str(info.value).startswith(f"model {REPO}@v9")
