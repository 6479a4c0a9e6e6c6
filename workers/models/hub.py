"""Models by Hugging Face repo id: `org/name[@revision]`, fetched into the user's Hugging Face cache.

`resolve_model` (catalog) asks here only for a reference that is neither a known name nor an existing local path. The
files loading needs (config, tokenizer, safetensors weights, generation config) are fetched by
`huggingface_hub.snapshot_download` into the user's cache (HF_HOME / HF_HUB_CACHE; HF_TOKEN for gated or private
repos) and the snapshot directory is returned. With HF_HUB_OFFLINE=1 nothing is fetched: the cache alone answers.
Nothing else in specserve reaches a model hub; the hub's errors become a ModelLoadError that says what to do.
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from specserve.workers.errors import ModelLoadError

log = logging.getLogger(__name__)

FORM = "org/name[@revision]"
# What the loaders read (runtime.loading: AutoConfig, AutoTokenizer, AutoModelForCausalLM on safetensors), top level
# only: no pickled *.bin / *.pt weights, no remote code, no original/ or onnx/ copies.
ALLOW_PATTERNS = [
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
    "*.safetensors",
    "*.safetensors.index.json",
]
IGNORE_PATTERNS = ["*/*", "consolidated*.safetensors"]  # subfolders; Mistral's native-format copy of the weights
_PART = re.compile(r"^[A-Za-z0-9_](?:[A-Za-z0-9_.-]{0,94}[A-Za-z0-9_])?$")  # HF: <=96, no leading/trailing - or .
_REVISION = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_./-]{0,254}$")  # a branch, tag, commit or refs/pr/N


@dataclass(frozen=True)
class RepoRef:
    repo_id: str
    revision: str | None = None  # None: the repo's default branch (main)

    def __str__(self) -> str:
        return self.repo_id if self.revision is None else f"{self.repo_id}@{self.revision}"


def parse_repo_ref(ref: str) -> RepoRef:
    """`org/name` or `org/name@revision`, checked against the hub's rules; ModelLoadError saying what is wrong."""
    repo_id, at, revision = ref.partition("@")
    problem = _repo_id_problem(repo_id) or (_revision_problem(revision) if at else None)
    if problem:
        raise ModelLoadError(f"{ref!r} is not a Hugging Face repo id of the form {FORM}: {problem}")
    return RepoRef(repo_id, revision if at else None)


def _repo_id_problem(repo_id: str) -> str | None:
    if repo_id[:1] in ("/", ".", "~"):
        return f"it starts with {repo_id[0]!r}, as a path does"
    parts = repo_id.split("/")
    if len(parts) != 2:
        return f"exactly one '/' between the organization and the name (found {len(parts) - 1})"
    if ".." in repo_id or "--" in repo_id:
        return "'..' and '--' are not allowed"
    for part in parts:
        if not _PART.fullmatch(part):
            return (
                f"{part!r}: 1 to 96 letters, digits, '-', '_' or '.', not starting or ending with '-' or '.'"
                if part
                else "an empty organization or name"
            )
    return None


def _revision_problem(revision: str) -> str | None:
    if not _REVISION.fullmatch(revision):
        return (
            f"revision {revision!r}: a branch, tag or commit of letters, digits, '-', '_', '.' or '/' (not starting "
            "with '.', '-' or '/')"
        )
    if ".." in revision or "//" in revision or revision.endswith("/"):
        return f"revision {revision!r}: no '..', '//' or trailing '/'"
    return None


def is_offline() -> bool:
    """HF_HUB_OFFLINE as the hub read it at import, or as the environment says now."""
    from huggingface_hub import constants

    return constants.is_offline_mode() or os.environ.get("HF_HUB_OFFLINE", "").upper() in ("1", "ON", "YES", "TRUE")


class _Quiet(tqdm):
    def __init__(self, *args, **kwargs):
        kwargs["disable"] = True
        super().__init__(*args, **kwargs)


def fetch(ref: RepoRef, progress: bool = True) -> str:
    """The snapshot directory of `ref` in the Hugging Face cache, fetching what loading needs unless offline."""
    from huggingface_hub import snapshot_download

    offline = is_offline()
    log.info("model %s: %s", ref, "from the Hugging Face cache (offline)" if offline else "from the Hugging Face Hub")
    try:
        path = snapshot_download(
            ref.repo_id,
            revision=ref.revision,
            allow_patterns=ALLOW_PATTERNS,
            ignore_patterns=IGNORE_PATTERNS,
            local_files_only=offline,
            library_name="specserve",
            tqdm_class=None if progress else _Quiet,
        )
    except Exception as e:  # noqa: BLE001 - the hub's and its HTTP client's errors, whatever their class
        raise hub_error(ref, e, offline) from e
    _check_snapshot(ref, Path(path), offline)
    return str(path)


def _cache() -> str:
    from huggingface_hub import constants

    return constants.HF_HUB_CACHE


def _pre_download(ref: RepoRef) -> str:
    revision = f" --revision {ref.revision}" if ref.revision else ""
    return (
        f"pre-download it on a machine with network (`hf download {ref.repo_id}{revision}`) into the Hugging Face "
        "cache this machine reads (HF_HOME or HF_HUB_CACHE), or pass a local directory"
    )


def hub_error(ref: RepoRef, e: Exception, offline: bool) -> ModelLoadError:
    """The hub's error `e` on fetching `ref`, as a ModelLoadError that names the repo and says what to do."""
    from huggingface_hub import errors

    page = f"https://huggingface.co/{ref.repo_id}"
    if isinstance(e, errors.GatedRepoError):
        return ModelLoadError(
            f"model {ref} is gated on the Hugging Face Hub: accept its terms on {page} and set HF_TOKEN (or run "
            "`hf auth login`) with a token of that account"
        )
    if isinstance(e, errors.RepositoryNotFoundError):
        return ModelLoadError(
            f"model {ref}: no such repository on the Hugging Face Hub, nor a local path of that name (check the name; "
            "a private repo needs HF_TOKEN set to a token with access)"
        )
    if isinstance(e, errors.RevisionNotFoundError):
        return ModelLoadError(
            f"model {ref}: the repository has no revision {ref.revision!r} (check the branch, tag or commit after "
            f"'@'; see {page}/tree/main)"
        )
    if isinstance(e, errors.LocalEntryNotFoundError) and offline:
        what = "is incomplete in" if isinstance(e, errors.IncompleteSnapshotError) else "is not in"
        return ModelLoadError(
            f"model {ref} {what} the Hugging Face cache ({_cache()}) and HF_HUB_OFFLINE=1 forbids downloading: "
            f"unset HF_HUB_OFFLINE where the machine has network, or {_pre_download(ref)}"
        )
    if isinstance(e, errors.LocalEntryNotFoundError):
        return ModelLoadError(
            f"model {ref}: the Hugging Face Hub could not be reached and the model is not in the cache ({_cache()}): "
            f"check the network (proxy, HF_ENDPOINT), or {_pre_download(ref)}"
        )
    if isinstance(e, errors.HfHubHTTPError):
        status = getattr(getattr(e, "response", None), "status_code", None)
        hint = "set HF_TOKEN to a valid token" if status in (401, 403) else "try again later"
        return ModelLoadError(
            f"model {ref}: the Hugging Face Hub answered {status or 'an error'} ({_first(e)}): {hint}"
        )
    return ModelLoadError(
        f"model {ref}: fetching it from the Hugging Face Hub failed ({type(e).__name__}: {_first(e)}): run again "
        f"(finished files are kept), or {_pre_download(ref)}"
    )


def _first(e: Exception) -> str:
    line = next((s.strip() for s in str(e).splitlines() if s.strip()), "")
    return line if len(line) <= 300 else line[:300] + "..."


def _check_snapshot(ref: RepoRef, path: Path, offline: bool) -> None:
    """A snapshot may lack files (another tool cached config.json alone; the repo has only .bin weights)."""
    missing = [name for name, ok in (("config.json", (path / "config.json").is_file()),
               ("safetensors weights", any(path.glob("*.safetensors")))) if not ok]  # fmt: skip
    if not missing:
        return
    if offline:
        todo = f"unset HF_HUB_OFFLINE where the machine has network, or {_pre_download(ref)}"
    else:
        todo = (
            "specserve fetches only Hugging Face-format safetensors models from the hub (for a GGUF repo, download "
            "its .gguf file and pass that file; otherwise convert the model and pass a local directory)"
        )
    raise ModelLoadError(f"model {ref}: the snapshot {path} has no {' and no '.join(missing)}: {todo}")
