"""Which wheels a wheelhouse carries, given what the target machine already has (no pip, no I/O here).

The target's `pip list --format=freeze` (or bare names) says what it has. pip on the target keeps an installed package
whose version satisfies every requirement on it, and then needs none of that package's own dependencies: so a wheel
is dropped when the target has its project at a version that satisfies what the kept packages and specserve require
(a bare name is assumed to), and with it every wheel that only dropped packages needed. Markers are evaluated for the
target's Python and platform, not this interpreter's.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from packaging.markers import default_environment
from packaging.requirements import InvalidRequirement, Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import NormalizedName, canonicalize_name
from packaging.version import InvalidVersion, Version

from specserve.workers.errors import SpecServeError

# `pip list --format=columns` has a header and a rule; freeze output has `-e` lines for editable installs
_SKIPPED_LINE = re.compile(r"^(#|-e\s|--|Package\s+Version\b|-+\s+-+)")
_NAME = re.compile(r"^[A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?$")


def parse_have(text: str, source: str = "--have") -> dict[NormalizedName, Version | None]:
    """The target's packages from `pip list --format=freeze` (NAME==VERSION), `pip list` columns (NAME VERSION) or
    bare names (one a line, or several on a line apart by spaces or commas); None where no version is given (or it
    is not a PEP 440 version): the target has it, at a version to be trusted."""
    have: dict[NormalizedName, Version | None] = {}
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.split(" #", 1)[0].strip()
        if not line or _SKIPPED_LINE.match(line):
            continue
        tokens = [t for t in re.split(r"[\s,]+", line) if t]
        if len(tokens) >= 2 and tokens[1] == "@":  # `name @ file:///...`: installed from a URL, version not said
            pairs = [(tokens[0], None)]
        elif len(tokens) in (2, 3) and _version(tokens[1]) is not None:  # `pip list` columns: NAME VERSION [PATH]
            pairs = [(tokens[0], tokens[1])]
        else:
            pairs = [
                (name.strip(), version.strip() or None) for name, _, version in (t.partition("==") for t in tokens)
            ]
        for name, version in pairs:
            if not _NAME.match(name):
                raise SpecServeError(f"{source}, line {number}: {name!r} is not NAME==VERSION or a package name")
            have[canonicalize_name(name)] = _version(version.lstrip("=")) if version else None
    return have


def _version(text: str) -> Version | None:
    try:
        return Version(text)
    except InvalidVersion:
        return None


def target_environment(python_version: str, platforms: Sequence[str]) -> dict[str, str]:
    """The marker environment of a CPython `python_version` ("3.12") on the first of `platforms` (pip's tags)."""
    env = default_environment()
    tag = platforms[0] if platforms else ""
    system = "Linux" if "linux" in tag else "Darwin" if tag.startswith("macosx") else "Windows" if "win" in tag else ""
    machine = re.sub(r"^(manylinux_\d+_\d+|musllinux_\d+_\d+|manylinux\d*|linux|macosx_\d+_\d+|win)_?", "", tag)
    env.update(
        python_version=python_version,
        python_full_version=f"{python_version}.0",
        implementation_name="cpython",
        implementation_version=f"{python_version}.0",
        platform_python_implementation="CPython",
    )
    if system:
        env.update(
            platform_system=system,
            sys_platform={"Linux": "linux", "Darwin": "darwin", "Windows": "win32"}[system],
            os_name="nt" if system == "Windows" else "posix",
        )
    if machine:
        env["platform_machine"] = {"amd64": "AMD64", "arm64": "arm64"}.get(machine, machine)
    return env


def stand_in_version(requirement: Requirement, have: Version | None) -> Version | None:
    """The version at which a top-level requirement the target has may stand in for the real package while pip
    resolves (a stub: no files, no dependencies, so torch and its CUDA wheels are never fetched), or None to resolve it
    for real. The target's own version where it satisfies the requirement; for a bare name, the highest version the
    requirement pins (== or <=), the one pip would pick; an open range is resolved for real and dropped afterwards.
    A requirement with extras is always resolved: the target may lack the extras' dependencies."""
    spec = requirement.specifier
    if requirement.extras:
        return None
    if have is not None:
        return have if spec.contains(have, prereleases=True) else None
    pins = []
    for s in spec:
        if s.operator in ("==", "===", "<=") and "*" not in s.version:
            try:
                pins.append(Version(s.version))
            except InvalidVersion:
                continue
    fits = [v for v in pins if spec.contains(v, prereleases=True)]
    return max(fits) if fits else None


def stub_version(version: Version) -> str:
    """A version string only a stub has: `version` with a local label (2.13.0+have, 2.11.0+cu128.have)."""
    return f"{version}.have" if version.local else f"{version}+have"


@dataclass(frozen=True)
class Resolved:
    """One wheel pip's resolution picked: its project, version, dependencies and where it comes from."""

    name: NormalizedName
    version: Version
    requires: tuple[Requirement, ...] = ()
    url: str = ""
    sha256: str | None = None


@dataclass
class Plan:
    kept: list[Resolved] = field(default_factory=list)
    dropped: list[tuple[str, str, str]] = field(default_factory=list)  # (name, version, why)
    missing: list[str] = field(default_factory=list)  # needed on the target, not resolved: names with requirers


def parse_requirements(lines: Iterable[str], source: str) -> list[Requirement]:
    out = []
    for line in lines:
        try:
            out.append(Requirement(line))
        except InvalidRequirement as e:
            raise SpecServeError(f"{source}: invalid requirement {line!r}: {e}") from None
    return out


def runtime_requirements(requires_dist: Iterable[str], source: str) -> list[Requirement]:
    """A distribution's Requires-Dist without its extras' lines (what `pip install specserve` installs)."""
    return [r for r in parse_requirements(requires_dist, source) if not (r.marker and "extra" in str(r.marker))]


def _active(req: Requirement, extras: set[str], env: Mapping[str, str]) -> bool:
    return req.marker is None or any(req.marker.evaluate({**env, "extra": e}) for e in {"", *extras})


def _edges(roots: Sequence[Requirement], resolved: Mapping[str, Resolved], env: Mapping[str, str]):
    """Each resolved package's active requirements (for the extras asked of it anywhere) and, of those, the ones
    only its extras bring (the target may have the package without them)."""
    extras: dict[str, set[str]] = defaultdict(set)
    for r in roots:
        extras[canonicalize_name(r.name)] |= r.extras
    changed = True
    while changed:
        changed = False
        for name, pkg in resolved.items():
            for req in pkg.requires:
                child = canonicalize_name(req.name)
                if _active(req, extras[name], env) and not req.extras <= extras[child]:
                    extras[child] |= req.extras
                    changed = True
    edges = {name: [r for r in pkg.requires if _active(r, extras[name], env)] for name, pkg in resolved.items()}
    extra_only = {name: [r for r in reqs if not _active(r, set(), env)] for name, reqs in edges.items()}
    return edges, extra_only


def _walk(roots, resolved, edges, extra_only, satisfied) -> tuple[set[str], set[str], dict[str, set[str]]]:
    """From the roots: the kept packages, the satisfied (dropped) ones reached, and the unresolved names needed."""
    kept, met, missing = set(), set(), defaultdict(set)
    queue = [(canonicalize_name(r.name), "specserve") for r in roots]
    while queue:
        name, by = queue.pop()
        if name in kept or name in met:
            continue
        if satisfied(name):
            met.add(name)
            children = extra_only.get(name, [])  # installed, but maybe without the extras' dependencies
        elif name in resolved:
            kept.add(name)
            children = edges[name]
        else:
            missing[name].add(by)
            continue
        queue += [(canonicalize_name(r.name), name) for r in children]
    return kept, met, missing


def plan(
    roots: Sequence[Requirement],
    resolved: Mapping[str, Resolved],
    have: Mapping[str, Version | None],
    env: Mapping[str, str],
) -> Plan:
    """Keep what the target needs of `resolved` (pip's resolution of `roots`, stand-ins excluded): see the module."""
    edges, extra_only = _edges(roots, resolved, env)
    kept: set[str] = set(resolved)
    while True:  # fewer kept packages ask for less, so more of what the target has satisfies: repeat to a fixpoint
        specs: dict[str, list[SpecifierSet]] = defaultdict(list)
        for r in roots:
            specs[canonicalize_name(r.name)].append(r.specifier)
        for name in kept:
            for r in edges[name]:
                specs[canonicalize_name(r.name)].append(r.specifier)

        def satisfied(name: str, specs=specs) -> bool:
            v = have.get(name, False)
            return v is None or (v is not False and all(s.contains(v, prereleases=True) for s in specs[name]))

        now, met, missing = _walk(roots, resolved, edges, extra_only, satisfied)
        if now == kept:
            break
        kept = now
    reachable, _, _ = _walk(roots, resolved, edges, extra_only, lambda name: False)
    out = Plan(kept=[resolved[n] for n in sorted(kept)])
    for name in sorted(set(resolved) | met):
        if name in kept:
            continue
        version = str(resolved[name].version) if name in resolved else "-"
        if name in met:
            v = have[name]
            why = f"the target has {v}" if v is not None else "the target has it (bare name: version not checked)"
        elif name in reachable:
            why = "needed only by packages the target has"
        else:
            why = f"not needed on Python {env['python_version']} ({env.get('sys_platform', '?')})"
        out.dropped.append((name, version, why))
    out.missing = [f"{n} (required by {', '.join(sorted(by))})" for n, by in sorted(missing.items())]
    return out
