"""The demo family's packaged copy: specserve ships its weights (`workers/models/demo_family/`, fp16, about 13 MB), so a fresh
machine installs the family in seconds instead of training it (about 80 minutes on 2 cores).

The copy is the output of the default recipe (`DemoSpec()`: fixed seeds, fixed step counts) that
`specserve models build-demo --from-scratch` runs, rounded to fp16 to stay small; loading upcasts it to the
configured dtype. It is installed only for the spec it was built from: change the recipe and the family is trained
again (and the copy should be regenerated: `python -m specserve.workers.models.demo_package` after a from-scratch build).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from specserve.workers.training.demo_build import DemoFamily, DemoSpec, family_dir, find_demo_family, log, move_into_place
from specserve.workers.training.demo_corpus import stdlib_root

PACKAGED = Path(__file__).parent / "demo_family"
_MODEL_FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


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


def package_family(family: DemoFamily, dest: Path = PACKAGED) -> None:
    """Write `family` as the packaged copy: fp16 weights, tokenizer, manifest (what `install_packaged` reads)."""
    import torch
    from transformers import AutoModelForCausalLM

    shutil.rmtree(dest, ignore_errors=True)
    for name in ("target", "draft"):
        src = Path(getattr(family, name))
        model = AutoModelForCausalLM.from_pretrained(src, local_files_only=True, dtype=torch.float16)
        model.save_pretrained(dest / name)
        for file in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy2(src / file, dest / name / file)
        unexpected = {p.name for p in (dest / name).iterdir()} - set(_MODEL_FILES)
        if unexpected:
            raise RuntimeError(f"unexpected files in the packaged {name}: {sorted(unexpected)}")
    manifest = family.manifest
    manifest.pop("corpus_root", None)  # the machine's own, filled in at install
    manifest["weights_dtype"] = "float16"
    (dest / "family.json").write_text(json.dumps(manifest, indent=2) + "\n")


if __name__ == "__main__":
    built = find_demo_family(DemoSpec())
    if built is None:
        raise SystemExit("no demo family built from DemoSpec() in the cache: run `specserve models build-demo "
                         "--from-scratch` first")  # fmt: skip
    package_family(built)
    print(f"packaged {built.root} -> {PACKAGED}")
