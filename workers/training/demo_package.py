"""Packaging the demo family: writes a from-scratch build of the default recipe as the copy specserve ships
(`workers/models/demo_family/`, fp16, about 13 MB), the one `workers/models/demo.py` installs instead of training.

Regenerate it after a from-scratch build: `python -m specserve.workers.training.demo_package`.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from specserve.workers.errors import ModelLoadError
from specserve.workers.models.demo import PACKAGED, DemoFamily, DemoSpec, find_demo_family

_MODEL_FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


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
            raise ModelLoadError(f"{dest / name}: unexpected files in the packaged {name}: {sorted(unexpected)}")
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
