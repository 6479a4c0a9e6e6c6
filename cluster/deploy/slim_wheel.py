"""Rewriting a wheel without members nothing of specserve's ever loads, so a wheelhouse copied to an air-gapped
machine carries less.

Ray's cp312 wheel is 79 MB and 34 MB of it is `ray/jars/ray_dist.jar`, the runtime of Ray's Java workers (specserve
starts Python workers only), and about 7 MB the dashboard's JavaScript source maps (`*.map`, read only by a browser's
developer tools). The slimmed wheel is still a valid wheel: the other members are unchanged, and their lines of
`*.dist-info/RECORD` (with their hashes) with them; the dropped members' lines go.
"""

from __future__ import annotations

import csv
import io
import os
import re
import zipfile
from collections.abc import Callable
from pathlib import Path

from specserve.workers.errors import SpecServeError

_RECORD = re.compile(r"^[^/]+\.dist-info/RECORD$")


def ray_unused(member: str) -> bool:
    """Members of Ray's wheel specserve never uses: the Java workers' jar and the dashboard's source maps."""
    return member == "ray/jars/ray_dist.jar" or (
        member.startswith("ray/dashboard/client/build/") and member.endswith(".map")
    )


def slim_wheel(path: Path, drop: Callable[[str], bool]) -> tuple[int, int, list[str]]:
    """Rewrite the wheel at `path` in place without the members `drop` names (deflate, level 9), their RECORD lines
    dropped too. Returns its size before and after and the members dropped; a wheel with none to drop is left as is."""
    before = path.stat().st_size
    try:
        with zipfile.ZipFile(path) as zin:
            infos = zin.infolist()
            records = [i for i in infos if _RECORD.match(i.filename)]
            if len(records) != 1:
                raise SpecServeError(f"{path}: not a wheel (expected one *.dist-info/RECORD, found {len(records)})")
            dropped = [i.filename for i in infos if drop(i.filename)]
            if not dropped:
                return before, before, []
            part = path.with_name(path.name + ".part")
            try:
                _rewrite(zin, infos, records[0], set(dropped), part)
                os.replace(part, path)
            finally:
                part.unlink(missing_ok=True)
    except (OSError, zipfile.BadZipFile) as e:
        raise SpecServeError(f"cannot slim {path}: {e}") from None
    return before, path.stat().st_size, dropped


def _rewrite(
    zin: zipfile.ZipFile, infos: list[zipfile.ZipInfo], record: zipfile.ZipInfo, dropped: set[str], out: Path
) -> None:
    with zipfile.ZipFile(out, "w", compression=zipfile.ZIP_DEFLATED, compresslevel=9) as zout:
        for info in infos:
            if info.filename in dropped or info is record:
                continue
            zout.writestr(_copy_info(info), zin.read(info), compress_type=zipfile.ZIP_DEFLATED, compresslevel=9)
        zout.writestr(
            _copy_info(record),
            _record_without(zin.read(record), dropped),
            compress_type=zipfile.ZIP_DEFLATED,
            compresslevel=9,
        )


def _copy_info(info: zipfile.ZipInfo) -> zipfile.ZipInfo:
    new = zipfile.ZipInfo(info.filename, info.date_time)
    new.external_attr = info.external_attr  # file modes: ray's executables stay executable
    new.create_system = info.create_system
    return new


def _record_without(record: bytes, dropped: set[str]) -> bytes:
    rows = [row for row in csv.reader(io.StringIO(record.decode("utf-8"))) if row and row[0] not in dropped]
    text = io.StringIO()
    csv.writer(text, lineterminator="\n").writerows(rows)
    return text.getvalue().encode("utf-8")
