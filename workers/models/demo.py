"""The demo model family as serving sees it: its recipe (`DemoSpec`), where a family lives under $SPECSERVE_HOME, and
the copy packaged with specserve (`demo_family/`, fp16, about 13 MB), installed in seconds instead of trained (about
80 minutes on 2 cores).

The packaged copy is the output of the default recipe (`DemoSpec()`: fixed seeds, fixed step counts) that
`specserve models build-demo --from-scratch` runs, rounded to fp16 to stay small; loading upcasts it to the configured
dtype. It is installed only for the spec it was built from. Serving never trains: a family that is neither cached nor
packaged is an error naming the command that builds it (training lives in `workers/training/demo_build.py`; after a
from-scratch build, `python -m specserve.workers.training.demo_package` regenerates the packaged copy).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

from pydantic import Field

from specserve.workers.config.strict import StrictModel
from specserve.workers.errors import ModelLoadError
from specserve.workers.models.home import specserve_home

PACKAGED = Path(__file__).parent / "demo_family"


class DemoSpec(StrictModel):
    """Everything that determines the demo family. Changing any field builds a new family."""

    name: str = Field("demo", description="Family name, part of the cache directory.")
    vocab_size: int = Field(4096, gt=256, description="BPE vocabulary size, specials included.")
    target_layers: int = Field(24, gt=0, description="Target transformer layers.")
    target_hidden: int = Field(128, gt=0, description="Target hidden width (multiple of 64).")
    draft_layers: int = Field(1, gt=0, description="Draft transformer layers.")
    draft_hidden: int = Field(192, gt=0, description="Draft hidden width (multiple of 64).")
    max_positions: int = Field(2048, gt=0, description="Context length of both models.")
    seq_len: int = Field(256, gt=0, description="Training window length.")
    batch: int = Field(8, gt=0, description="Training windows per step.")
    target_steps: int = Field(480, gt=0, description="Target training steps (cross-entropy on the corpus).")
    unlikelihood_steps: int = Field(
        150,
        ge=0,
        description="Target fine-tuning steps with sequence-level unlikelihood on "
        "its own greedy continuations (stops greedy loops), after target_steps.",
    )
    draft_steps: int = Field(
        0, ge=0, description="Draft distillation steps on corpus windows (KL to the final target's logits)."
    )
    draft_onpolicy_steps: int = Field(
        4800,
        ge=0,
        description="Draft distillation steps on the final target's greedy continuations of corpus prefixes "
        "(the text it emits at serving time), after draft_steps.",
    )
    onpolicy_pool: int = Field(16384, gt=0, description="Greedy continuations generated for the on-policy stage.")
    onpolicy_batch: int = Field(12, gt=0, description="Pooled continuations per on-policy step.")
    onpolicy_argmax_weight: float = Field(
        0.3, ge=0, description="Weight of cross-entropy on the target's argmax beside the KL in the on-policy stage."
    )
    onpolicy_lr: float = Field(3e-3, gt=0, description="Peak AdamW learning rate of the on-policy stage.")
    lr: float = Field(3e-3, gt=0, description="Peak AdamW learning rate.")
    seed: int = Field(0, ge=0, description="Seed of every random choice.")
    max_files: int | None = Field(None, gt=0, description="Use only the first N corpus files (tiny builds).")

    def key(self) -> str:
        return hashlib.sha1(self.model_dump_json().encode()).hexdigest()[:10]

    def target_recipe(self) -> dict:
        """The fields the tokenizer and the final target depend on (the draft's do not change them)."""
        return self.model_dump(include=set(TARGET_FIELDS))


TARGET_FIELDS = ("vocab_size", "target_layers", "target_hidden", "max_positions", "seq_len", "batch", "target_steps",
                 "unlikelihood_steps", "lr", "seed", "max_files")  # fmt: skip


TINY_SPEC = DemoSpec(
    name="tiny", vocab_size=300, target_layers=2, target_hidden=64, draft_layers=1, draft_hidden=64,
    max_positions=512, seq_len=64, batch=4, target_steps=6, draft_steps=4, unlikelihood_steps=2, draft_onpolicy_steps=2,
    onpolicy_pool=6, onpolicy_batch=3, max_files=12,
)  # fmt: skip


@dataclass(frozen=True)
class DemoFamily:
    root: Path

    @property
    def target(self) -> str:
        return str(self.root / "target")

    @property
    def draft(self) -> str:
        return str(self.root / "draft")

    @property
    def manifest(self) -> dict:
        return json.loads((self.root / "family.json").read_text())


def family_dir(spec: DemoSpec) -> Path:
    return specserve_home() / "models" / f"{spec.name}-{spec.key()}"


def find_demo_family(spec: DemoSpec | None = None) -> DemoFamily | None:
    root = family_dir(spec or DemoSpec())
    return DemoFamily(root) if (root / "family.json").is_file() else None


def stdlib_root() -> Path:
    """This Python's standard library directory (the demo family's corpus, and its held-out prompts)."""
    return Path(sysconfig.get_paths()["stdlib"])


def log(progress: bool, msg: str) -> None:
    """A progress line on stderr, beside the progress bars (what a build or install is doing, for minutes)."""
    if progress:
        print(f"[specserve] {msg}", file=sys.stderr, flush=True)


def move_into_place(staging: Path, final: Path) -> None:
    """Replace `final` by the complete `staging` directory (readers never see a half-written family)."""
    if final.exists():
        shutil.rmtree(final)
    staging.rename(final)


def packaged_spec(root: Path = PACKAGED) -> DemoSpec | None:
    """The spec the packaged copy was built from (None when there is none)."""
    manifest = root / "family.json"
    if not manifest.is_file():
        return None
    return DemoSpec(**json.loads(manifest.read_text())["spec"])


def install_packaged(spec: DemoSpec, progress: bool = True, root: Path = PACKAGED) -> DemoFamily | None:
    """Copy the packaged family into the cache when it was built from `spec`; None when it was not (or is absent)."""
    if packaged_spec(root) != spec:
        return None
    final = family_dir(spec)
    staging = final.with_name(final.name + f".installing-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    staging.parent.mkdir(parents=True, exist_ok=True)
    shutil.copytree(root, staging)
    manifest = json.loads((root / "family.json").read_text())
    manifest["corpus_root"] = str(stdlib_root())  # this machine's standard library
    manifest["installed_from"] = "packaged weights (workers/models/demo_family)"
    (staging / "family.json").write_text(json.dumps(manifest, indent=2))
    move_into_place(staging, final)
    log(progress, f"demo family installed from the packaged weights: {final}")
    return DemoFamily(final)


def ensure_demo_family(spec: DemoSpec | None = None, progress: bool = True) -> DemoFamily:
    """The cached family, installed from the packaged copy first when missing. Never trains: a family that is
    neither cached nor packaged is a ModelLoadError naming the command that builds it."""
    spec = spec or DemoSpec()
    family = find_demo_family(spec) or install_packaged(spec, progress)
    if family is None:
        command = "specserve models build-demo" + (" --tiny" if spec == TINY_SPEC else "")
        raise ModelLoadError(
            f"the demo family {spec.name!r} is not built ({family_dir(spec)} holds no family.json) and specserve's "
            f"packaged copy ({PACKAGED}) is missing or from another recipe: build it once with `{command}`"
        )
    return family
