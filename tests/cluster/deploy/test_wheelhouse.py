"""The wheelhouse's pip steps: stand-in stubs, reading a wheel's requirements, and (slow) a real resolve + download
of a tiny requirement set for another Python."""

import subprocess
import sys
import zipfile

import pytest
from packaging.requirements import Requirement
from packaging.utils import parse_wheel_filename
from packaging.version import Version

from specserve.cluster.deploy.wheelhouse import Target, fetch, wheel_requires, write_stubs
from specserve.workers.errors import SpecServeError


def test_stubs_stand_in_only_where_safe(tmp_path):
    roots = [
        Requirement(r)
        for r in (
            "torch>=2.11,<=2.13.0",
            "numpy>=1.26",
            "transformers>=5.24,<5.25",
            "ray[serve]==2.60.0",
            "msgpack>=1.0",
        )
    ]
    have = {"torch": None, "numpy": Version("1.26.4"), "transformers": Version("4.46.0"), "ray": Version("2.60.0")}
    stubs = write_stubs(roots, have, tmp_path)
    assert stubs == {"torch": "2.13.0+have", "numpy": "1.26.4+have"}
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["numpy-1.26.4+have-py3-none-any.whl", "torch-2.13.0+have-py3-none-any.whl"]
    for name in files:
        assert parse_wheel_filename(name)[1] == Version(stubs[name.split("-")[0]])
        assert wheel_requires(tmp_path / name) == []  # no dependencies: the CUDA wheels are never looked at


def test_wheel_requires_reads_metadata(tmp_path):
    wheel = tmp_path / "x-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr(
            "x-1.0.dist-info/METADATA",
            "Metadata-Version: 2.1\nName: x\nVersion: 1.0\n"
            "Requires-Dist: torch>=2.11,<=2.13.0\nRequires-Dist: pytest; extra == 'dev'\n\nthe readme\n",
        )
    assert wheel_requires(wheel) == ["torch>=2.11,<=2.13.0", "pytest; extra == 'dev'"]
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr("x/__init__.py", "")
    with pytest.raises(SpecServeError, match="not a wheel"):
        wheel_requires(wheel)


@pytest.mark.slow
def test_fetch_resolves_for_another_python_and_leaves_out_what_the_target_has(tmp_path):
    """The package index: msgpack's cp312 wheel is downloaded whatever this interpreter is; typing-extensions (pinned,
    a bare name in --have) stands in as a stub and is never fetched; six (open range) is resolved, then dropped."""
    roots = [Requirement(r) for r in ("msgpack>=1.0", "typing-extensions==4.12.2", "six")]
    target = Target("3.12", have={"typing-extensions": None, "six": None})
    house, files = fetch(roots, tmp_path, target, say=lambda message: None)
    assert [parse_wheel_filename(f.name)[0] for f in files] == ["msgpack"]
    assert {t.interpreter for t in parse_wheel_filename(files[0].name)[3]} == {"cp312"}
    assert sorted(p.name for p in tmp_path.iterdir()) == [files[0].name]
    dropped = {name: version for name, version, _ in house.dropped}
    assert set(dropped) == {"six", "typing-extensions"} and dropped["typing-extensions"] == "-"  # never resolved
    assert house.missing == []
    # and the wheelhouse installs offline on a 3.12 target (pip checks the tags with --python-version)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--dry-run",
            "--no-index",
            "--find-links",
            str(tmp_path),
            "--target",
            str(tmp_path / "t"),
            "--only-binary=:all:",
            "--python-version",
            "3.12",
            "--platform",
            "manylinux2014_x86_64",
            "--no-deps",
            "msgpack",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
