"""Slimming Ray's wheel, on a small wheel built here with Ray's layout: the members go, RECORD follows, pip installs
the result."""

import base64
import csv
import hashlib
import io
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from specserve.cluster.deploy.slim_wheel import ray_unused, slim_wheel
from specserve.workers.errors import SpecServeError

INFO = "ray-2.60.0.dist-info"
UNUSED = {
    "ray/jars/ray_dist.jar",
    "ray/dashboard/client/build/static/js/main.1234.js.map",
    "ray/dashboard/client/build/static/css/main.5678.css.map",
}


def _hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def _fake_ray_wheel(folder: Path) -> Path:
    members = {
        "ray/__init__.py": b"VERSION = '2.60.0'\n",
        "ray/jars/ray_dist.jar": os.urandom(300_000),  # incompressible, like a jar
        "ray/dashboard/client/build/static/js/main.1234.js": b"console.log(1);\n" * 100,
        "ray/dashboard/client/build/static/js/main.1234.js.map": b'{"mappings": "AAAA"}' * 2000,
        "ray/dashboard/client/build/static/css/main.5678.css.map": b'{"mappings": "BBBB"}' * 500,
        "ray/dashboard/modules/job/job.map": b"not a build source map: kept",
        f"{INFO}/METADATA": b"Metadata-Version: 2.1\nName: ray\nVersion: 2.60.0\n",
        f"{INFO}/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: false\nTag: py3-none-any\n",
    }
    path = folder / "ray-2.60.0-py3-none-any.whl"
    record = io.StringIO()
    writer = csv.writer(record, lineterminator="\n")
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED, compresslevel=1) as zf:
        for name, data in members.items():
            zf.writestr(name, data)
            writer.writerow([name, _hash(data), len(data)])
        script = zipfile.ZipInfo("ray/core/src/ray/raylet/raylet", (2024, 1, 1, 0, 0, 0))
        script.external_attr = 0o100755 << 16  # an executable: it must stay one
        zf.writestr(script, b"#!/bin/sh\n")
        writer.writerow([script.filename, _hash(b"#!/bin/sh\n"), 10])
        writer.writerow([f"{INFO}/RECORD", "", ""])
        zf.writestr(f"{INFO}/RECORD", record.getvalue())
    return path


def test_ray_unused_names_the_jar_and_the_dashboards_source_maps_only():
    assert {m for m in UNUSED if ray_unused(m)} == UNUSED
    assert not ray_unused("ray/dashboard/client/build/static/js/main.1234.js")
    assert not ray_unused("ray/dashboard/modules/job/job.map")
    assert not ray_unused("ray/jars/other.jar")


def test_slimming_drops_the_members_and_their_record_lines(tmp_path):
    wheel = _fake_ray_wheel(tmp_path)
    before, after, dropped = slim_wheel(wheel, ray_unused)
    assert set(dropped) == UNUSED
    assert after < before - 250_000 and after == wheel.stat().st_size  # the jar alone is 300 kB
    with zipfile.ZipFile(wheel) as zf:
        assert zf.testzip() is None
        names = set(zf.namelist())
        assert not names & UNUSED
        rows = list(csv.reader(io.StringIO(zf.read(f"{INFO}/RECORD").decode())))
        assert {row[0] for row in rows} == names  # every member listed once, nothing listed that is gone
        for name, digest, size in rows:
            if name != f"{INFO}/RECORD":
                assert (digest, int(size)) == (_hash(zf.read(name)), len(zf.read(name)))
        assert all(i.compress_type == zipfile.ZIP_DEFLATED for i in zf.infolist())
        assert zf.getinfo("ray/core/src/ray/raylet/raylet").external_attr >> 16 == 0o100755


def test_the_slimmed_wheel_installs(tmp_path):
    wheel = _fake_ray_wheel(tmp_path)
    slim_wheel(wheel, ray_unused)
    target = tmp_path / "site"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--no-deps",
            "--no-index",
            "--no-cache-dir",
            "--disable-pip-version-check",
            "--target",
            str(target),
            str(wheel),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (target / "ray" / "__init__.py").read_text() == "VERSION = '2.60.0'\n"
    assert not (target / "ray" / "jars").exists()
    assert (target / "ray" / "dashboard" / "client" / "build" / "static" / "js" / "main.1234.js").is_file()
    assert os.access(target / "ray" / "core" / "src" / "ray" / "raylet" / "raylet", os.X_OK)


def test_a_wheel_with_nothing_to_drop_is_left_alone(tmp_path):
    wheel = _fake_ray_wheel(tmp_path)
    data = wheel.read_bytes()
    assert slim_wheel(wheel, lambda member: False) == (len(data), len(data), [])
    assert wheel.read_bytes() == data


def test_not_a_wheel_is_a_clear_error(tmp_path):
    bogus = tmp_path / "ray-2.60.0-py3-none-any.whl"
    bogus.write_bytes(b"not a zip")
    with pytest.raises(SpecServeError, match="cannot slim"):
        slim_wheel(bogus, ray_unused)
    with zipfile.ZipFile(bogus, "w") as zf:
        zf.writestr("ray/__init__.py", "")
    with pytest.raises(SpecServeError, match="not a wheel"):
        slim_wheel(bogus, ray_unused)
