"""`specserve wheelhouse`: its flags reach the builder, its table, and clear errors (no tracebacks). pip itself is
stubbed here; tests/cluster/deploy/ run the steps."""

import os
import zipfile

import pytest
from packaging.version import Version

from specserve.cluster.cli.main import main
from specserve.cluster.deploy import wheelhouse
from specserve.cluster.deploy.wheelhouse import Wheelhouse


def _wheel(path, members):
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        info = f"{path.name.split('-')[0]}-{path.name.split('-')[1]}.dist-info"
        for name, data in members.items():
            zf.writestr(name, data)
        zf.writestr(f"{info}/METADATA", "Metadata-Version: 2.1\nName: x\nVersion: 1\nRequires-Dist: ray==2.60.0\n")
        zf.writestr(f"{info}/RECORD", "".join(f"{m},,\n" for m in members) + f"{info}/RECORD,,\n")
    return path


@pytest.fixture
def fake_pip(monkeypatch):
    """specserve's wheel and the download replaced by small wheels; records what fetch was asked."""
    asked = {}

    def build_own(source, dest):
        return _wheel(dest / "specserve-0.1.0-py3-none-any.whl", {"specserve/__init__.py": b""})

    def fetch(roots, dest, target, say):
        asked.update(roots=[str(r) for r in roots], target=target)
        ray = _wheel(
            dest / "ray-2.60.0-cp312-cp312-manylinux2014_x86_64.whl",
            {"ray/__init__.py": b"", "ray/jars/ray_dist.jar": os.urandom(200_000)},
        )
        house = Wheelhouse(dest, dropped=[("torch", "-", "the target has 2.11.0+cu128")])
        return house, [ray]

    monkeypatch.setattr(wheelhouse, "_build_own_wheel", build_own)
    monkeypatch.setattr(wheelhouse, "fetch", fetch)
    return asked


def test_the_flags_reach_the_builder_and_the_table_is_printed(tmp_path, fake_pip, capsys):
    have = tmp_path / "gpu-freeze.txt"
    have.write_text("torch==2.11.0+cu128\nnumpy grpcio\n")
    code = main(
        [
            "wheelhouse",
            "--dest",
            str(tmp_path / "wh"),
            "--python-version",
            "312",
            "--have",
            str(have),
            "--platform",
            "manylinux2014_x86_64",
            "--slim-ray",
        ]
    )
    out = capsys.readouterr()
    assert code == 0, out.err
    assert fake_pip["roots"] == ["ray==2.60.0"]  # read from the built wheel's METADATA
    target = fake_pip["target"]
    assert (target.python_version, target.platforms) == ("3.12", ("manylinux2014_x86_64",))
    assert target.have == {"torch": Version("2.11.0+cu128"), "numpy": None, "grpcio": None}
    assert "KEPT (2 wheels" in out.out and "slimmed from" in out.out
    assert "torch" in out.out.split("DROPPED (1)")[1]
    assert "TOTAL" in out.out and "slimming ray-2.60.0" in out.err
    with zipfile.ZipFile(tmp_path / "wh" / "ray-2.60.0-cp312-cp312-manylinux2014_x86_64.whl") as zf:
        assert "ray/jars/ray_dist.jar" not in zf.namelist()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--python-version", "three"], "--python-version 'three': expected X.Y"),
        (["--have", "/nonexistent/gpu.txt"], "cannot read --have /nonexistent/gpu.txt"),
        (["--have", "BAD"], "line 1: '>=2' is not NAME==VERSION"),
        (["--model", "no-such-model"], "unknown model 'no-such-model' for --model: known names are"),
    ],
)
def test_errors_are_messages(tmp_path, fake_pip, capsys, args, message):
    bad = tmp_path / "bad.txt"
    bad.write_text(">=2\n")
    args = [str(bad) if a == "BAD" else a for a in args]
    assert main(["wheelhouse", "--dest", str(tmp_path / "wh"), *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("specserve: error: ") and message in err and "Traceback" not in err
    assert "roots" not in fake_pip  # refused before anything was fetched
