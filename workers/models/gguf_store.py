"""GGUF files as model sources: dequantized once into a Hugging Face directory, cached by the file's sha256.

`converted_dir(file)` returns $SPECSERVE_HOME/converted/<sha256>/ (config.json, generation_config.json, fp32
model.safetensors, tokenizer files with the GGUF's chat template), converting on the first call only. A copy of the
file at another path has the same hash, so it reuses the directory. The directory only ever appears complete: it is
written into a temporary sibling, marked complete by `specserve-source.json` (written last) and renamed into place.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import logging
import os
import re
import shutil
import socket
import sys
import tempfile
import time
from pathlib import Path

from tqdm import tqdm

from specserve.workers.errors import ModelLoadError
from specserve.workers.models.home import specserve_home

log = logging.getLogger(__name__)

MARKER = "specserve-source.json"
GGUF_MAGIC = b"GGUF"
_PROGRESS_BYTES = 50 * 2**20  # files smaller than this hash in well under a second: no bar
_CHUNK = 4 * 2**20


def is_gguf_file(path: str | os.PathLike) -> bool:
    """A regular file whose first 4 bytes are the GGUF magic."""
    if not os.path.isfile(path):  # before opening: a FIFO would block
        return False
    try:
        with open(path, "rb") as f:
            return f.read(4) == GGUF_MAGIC
    except OSError:
        return False


def file_sha256(path: str | os.PathLike, progress: bool = True) -> str:
    """Hex sha256 of the file's bytes, streamed; a progress bar on stderr for big files when `progress`."""
    size = os.path.getsize(path)
    digest = hashlib.sha256()
    show = progress and size > _PROGRESS_BYTES
    with (
        open(path, "rb") as f,
        tqdm(total=size, unit="B", unit_scale=True, desc=f"hashing {Path(path).name}", file=sys.stderr,
             disable=not show, leave=False) as bar,
    ):  # fmt: skip
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
            bar.update(len(chunk))
    return digest.hexdigest()


def converted_dir(gguf_path: str | os.PathLike, progress: bool = True) -> Path:
    """The Hugging Face directory converted from the GGUF file at `gguf_path`, converting it on first use.

    Raises ModelLoadError naming the file when it is missing, not a GGUF file, truncated or corrupt, or of an
    architecture transformers cannot load from GGUF."""
    path = Path(gguf_path).expanduser()
    _check_gguf(path)
    digest = file_sha256(path, progress)
    root = specserve_home() / "converted"
    final = root / digest
    if _is_complete(final, digest):
        return final
    root.mkdir(parents=True, exist_ok=True)
    with _conversion_lock(root / f".{digest}.lock", path):
        if _is_complete(final, digest):  # another process converted it while this one waited
            return final
        if final.exists():
            log.warning("removing the incomplete conversion %s (no %s): converting %s again", final, MARKER, path)
            shutil.rmtree(final, ignore_errors=True)
        _remove_stale_partials(root, digest)
        architecture = _read_architecture(path)
        partial = Path(tempfile.mkdtemp(prefix=f".{digest}.{_owner_tag()}.", dir=root))
        try:
            log.info("converting %s (sha256 %s, %s architecture) into %s", path, digest[:12], architecture, final)
            start = time.perf_counter()
            _convert(path, partial, progress)
            source = {"file": path.name, "sha256": digest, "bytes": path.stat().st_size, "transformers": _tf_version()}
            (partial / MARKER).write_text(json.dumps(source, indent=2) + "\n")
            _make_readable(partial)
            _publish(partial, final, digest)
            log.info("converted %s in %.1f s", path.name, time.perf_counter() - start)
        finally:
            shutil.rmtree(partial, ignore_errors=True)  # gone after a rename; a failed or losing attempt's leftovers
    return final


def _check_gguf(path: Path) -> None:
    if not path.exists():
        raise ModelLoadError(f"GGUF file {str(path)!r} does not exist")
    if not path.is_file():
        raise ModelLoadError(f"{str(path)!r} is not a file (a GGUF model source must be a .gguf file)")
    if not is_gguf_file(path):
        raise ModelLoadError(f"{str(path)!r} is not a GGUF file: it does not start with the GGUF magic bytes")


def _is_complete(directory: Path, digest: str) -> bool:
    try:
        source = json.loads((directory / MARKER).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(source, dict) and source.get("sha256") == digest


def _read_architecture(path: Path) -> str:
    """The file's `general.architecture`, after the gguf reader has parsed its whole layout (which catches a
    truncated file before any dequantizing); refuses one transformers cannot load."""
    try:
        from gguf import GGUFReader
    except ImportError:
        raise ModelLoadError(
            f"reading the GGUF file {str(path)!r} needs the `gguf` package: pip install gguf"
        ) from None
    try:
        field = GGUFReader(path).fields.get("general.architecture")
        architecture = field.contents() if field is not None else None
    except Exception as e:  # noqa: BLE001 - the reader fails on bad bytes with whatever numpy or struct raises
        raise ModelLoadError(f"GGUF file {str(path)!r} is truncated or corrupt: {_one_line(e)}") from None
    if not isinstance(architecture, str):
        raise ModelLoadError(f"GGUF file {str(path)!r} is corrupt: its metadata names no general.architecture")
    loadable = _loadable_architectures()
    if loadable and _norm(architecture) not in {_norm(a) for a in loadable}:
        raise ModelLoadError(
            f"GGUF file {str(path)!r} holds a {architecture!r} model, an architecture transformers "
            f"{_tf_version()} cannot load from GGUF; its GGUF support lists the loadable ones: {', '.join(loadable)}"
        )
    return architecture


def _loadable_architectures() -> list[str]:
    """What this transformers can load from GGUF; empty when its (internal) tables moved, and then transformers'
    own error is reported instead."""
    names: set[str] = set()
    try:
        from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

        names.update(GGUF_SUPPORTED_ARCHITECTURES)
    except ImportError:
        pass
    try:
        from transformers.integrations.gguf import GGUF_CONFIG_ARCHS

        names.update(GGUF_CONFIG_ARCHS)
    except ImportError:
        pass
    return sorted(names - {"general", "tokenizer"})  # metadata groups in the same table, not architectures


def _norm(architecture: str) -> str:
    # files say "qwen2moe" or "gpt-oss" where transformers' table says "qwen2_moe" and "gpt_oss"
    return re.sub(r"[-_]", "", architecture.lower())


def _convert(path: Path, out: Path, progress: bool) -> None:
    """Dequantize the GGUF at `path` to an fp32 Hugging Face model + tokenizer saved in `out`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig
    from transformers.utils import logging as hf_logging

    # An absolute gguf_file: given a bare name, from_pretrained would prefer a same-named file in the working dir.
    source = {"pretrained_model_name_or_path": str(path.parent), "gguf_file": str(path.resolve())}
    bars_were_on = hf_logging.is_progress_bar_enabled()
    if not progress:
        hf_logging.disable_progress_bar()
    try:
        tokenizer = AutoTokenizer.from_pretrained(**source, local_files_only=True)
        # dequantize=True: never keep packed GGUF blocks (transformers does when its `kernels` are installed),
        # which save_pretrained refuses to write.
        model = AutoModelForCausalLM.from_pretrained(
            **source, local_files_only=True, dtype=torch.float32, quantization_config=GgufConfig(dequantize=True)
        )
        quantizer = getattr(model, "hf_quantizer", None)
        if quantizer is not None:  # the weights are plain fp32 now; the saved config must not ask for GGUF
            quantizer.remove_quantization_config(model)
        model.save_pretrained(out)
        # the chat template inside tokenizer_config.json, where every transformers version looks for it
        tokenizer.save_pretrained(out, save_jinja_files=False)
    except ModelLoadError:
        raise
    except Exception as e:  # noqa: BLE001 - transformers and gguf raise many kinds; each means this file won't load
        raise ModelLoadError(f"could not convert the GGUF file {str(path)!r}: {_one_line(e)}") from None
    finally:
        if bars_were_on and not progress:
            hf_logging.enable_progress_bar()


def _make_readable(directory: Path) -> None:
    # mkdtemp makes the directory private and transformers writes its weights 0600: a shared cache needs reads
    directory.chmod(0o755)
    for f in directory.iterdir():
        f.chmod(0o644)


def _publish(partial: Path, final: Path, digest: str) -> None:
    """Rename the finished conversion into place. If another process got there first (its lock did not hold, e.g.
    on a network file system), keep the winner's and drop this one."""
    try:
        os.rename(partial, final)
    except OSError as e:
        if e.errno not in (errno.EEXIST, errno.ENOTEMPTY) or not _is_complete(final, digest):
            raise
        log.info("another process finished converting into %s first; using its copy", final)


@contextlib.contextmanager
def _conversion_lock(lock_path: Path, path: Path):
    """One conversion of a file at a time per machine: a second process waits, then finds the directory."""
    with open(lock_path, "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("waiting for another process that is converting %s", path.name)
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _owner_tag() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


def _remove_stale_partials(root: Path, digest: str) -> None:
    """Delete temporary directories left by crashed conversions of this file on this host (their pid is gone)."""
    host = socket.gethostname()
    for partial in root.glob(f".{digest}.{host}-*"):
        pid = partial.name[len(f".{digest}.{host}-") :].split(".")[0]
        if pid.isdigit() and not _alive(int(pid)):
            log.info("removing %s, left by a crashed conversion", partial)
            shutil.rmtree(partial, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def _tf_version() -> str:
    import transformers

    return transformers.__version__
