"""Building the demo model family: tokenizer, target and distilled draft, trained reproducibly offline and cached.

`specserve models build-demo` puts it under $SPECSERVE_HOME (default ~/.cache/specserve): from the weights packaged
with specserve (`workers/models/demo.py`) when they match the spec, else trained (`--from-scratch` always trains);
`install_or_build_demo_family` returns the cached family, installing or building it first when missing. Saved
in Hugging Face format, so it loads through the same path as any user model. A build also keeps its final target under
$SPECSERVE_HOME/stages/, so a later recipe that changes only the draft starts from it. The recipe (`DemoSpec`) and
what serving reads of a family live in `workers/models/demo.py`.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Literal

import torch
from tqdm import tqdm

from specserve.workers.models.demo import (
    DemoFamily,
    DemoSpec,
    family_dir,
    find_demo_family,
    install_packaged,
    log,
    move_into_place,
)
from specserve.workers.models.home import specserve_home
from specserve.workers.runtime.loading import resolve_device
from specserve.workers.training.demo_corpus import stdlib_corpus
from specserve.workers.training.demo_train import (
    encode_stream,
    llama_config,
    saved_tokenizer,
    train_lm,
    train_tokenizer,
    use_bf16,
)
from specserve.workers.training.onpolicy import continuation_pool, pool_batches, teacher_logprobs
from specserve.workers.training.unlikelihood import unlikelihood_finetune


def install_or_build_demo_family(spec: DemoSpec | None = None, progress: bool = True) -> DemoFamily:
    """The cached family; when missing, installed from the weights packaged with specserve (if they were built from
    `spec`), else built (with progress on stderr). What `specserve models build-demo` runs; serving uses
    `workers.models.demo.ensure_demo_family`, which never trains."""
    spec = spec or DemoSpec()
    return find_demo_family(spec) or install_packaged(spec, progress) or build_demo_family(spec, progress=progress)


def build_demo_family(
    spec: DemoSpec | None = None,
    progress: bool = True,
    device: Literal["auto", "cpu", "cuda"] = "auto",
    corpus_root: str | Path | None = None,
) -> DemoFamily:
    """Build tokenizer, target and draft into a fresh directory, then move it into place atomically. Trains on a GPU
    when there is one (`device="auto"`): same recipe, same seeds and batches; the weights then differ from a CPU
    build's in rounding only. `corpus_root`: another Python's standard library (default: this one's)."""
    spec = spec or DemoSpec()
    on = resolve_device(device)
    where = torch.cuda.get_device_name(on) if on.type == "cuda" else f"cpu ({torch.get_num_threads()} threads)"
    final = family_dir(spec)
    staging = final.with_name(final.name + f".building-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    started = time.time()
    log(progress, f"building demo family {final.name} in {final.parent} (one-time; cached afterwards)")

    corpus = stdlib_corpus(corpus_root, max_files=spec.max_files)
    texts = corpus.read(corpus.train)
    log(progress, f"corpus: {len(corpus.train)} training files, {len(corpus.held_out)} held out, from {corpus.root}")
    log(progress, f"training on {where}" + (", bf16 autocast" if use_bf16(on) else ", fp32"))
    tokenizer, stream, target, target_meta = _final_target(spec, texts, on, progress)
    logprobs_file = staging.with_name(staging.name + ".logprobs")
    draft, draft_kl = _final_draft(spec, tokenizer, stream, target, on, logprobs_file, progress)

    for name, model in (("target", target), ("draft", draft)):
        model.to("cpu")
        model.generation_config.eos_token_id = tokenizer.eos_token_id
        model.generation_config.pad_token_id = tokenizer.pad_token_id
        model.save_pretrained(staging / name)
        tokenizer.save_pretrained(staging / name)
    manifest = {
        "spec": spec.model_dump(),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "corpus_root": str(corpus.root),
        "train_files": len(corpus.train),
        "held_out_files": [p.relative_to(corpus.root).as_posix() for p in corpus.held_out],
        "train_tokens": len(stream),
        "target_params": sum(p.numel() for p in target.parameters()),
        "draft_params": sum(p.numel() for p in draft.parameters()),
        **target_meta,
        "draft_final_kl": draft_kl,
        "trained_on": where,
        "build_seconds": round(time.time() - started, 1),
    }
    (staging / "family.json").write_text(json.dumps(manifest, indent=2))
    move_into_place(staging, final)
    log(progress, f"demo family ready in {manifest['build_seconds']:.0f} s: {final}")
    return DemoFamily(final)


def _final_draft(spec: DemoSpec, tokenizer, stream, target, on: torch.device, logprobs_file: Path, progress: bool):
    """(draft on `on`, its final KL): distilled from the final target on corpus windows, then on the target's own
    greedy text (its log-probs kept in `logprobs_file` while the stage runs)."""
    # Seeded here, not by whatever the target stages left in the global generator (they may have been skipped).
    torch.manual_seed(spec.seed + 5)
    draft = _llama(tokenizer, spec.draft_layers, spec.draft_hidden, spec).to(on)
    draft_losses = onpolicy_losses = []
    if spec.draft_steps:
        draft_losses = _train("draft", draft, stream, spec.draft_steps, spec, target, progress)
    if spec.draft_onpolicy_steps:
        pool = _continuation_pool(target, stream, spec, on, progress)
        try:
            logprobs = _teacher_logprobs(target, pool, progress, logprobs_file)
            onpolicy_losses = _train("draft on target text", draft, stream, spec.draft_onpolicy_steps, spec, None,
                                     progress, data=pool_batches(pool, spec.onpolicy_batch, spec.seed + 4, logprobs),
                                     lr=spec.onpolicy_lr, argmax_weight=spec.onpolicy_argmax_weight)  # fmt: skip
            del logprobs
        finally:
            logprobs_file.unlink(missing_ok=True)
    losses = onpolicy_losses or draft_losses
    return draft, _tail_mean(losses) if losses else None


def _llama(tokenizer, layers: int, hidden: int, spec: DemoSpec):
    from transformers import LlamaForCausalLM

    cfg = llama_config(len(tokenizer), layers, hidden, spec.max_positions, tokenizer.eos_token_id,
                       tokenizer.pad_token_id)  # fmt: skip
    return LlamaForCausalLM(cfg)


def target_stage_dir(spec: DemoSpec, texts: list[str], on: torch.device) -> Path:
    """Where the tokenizer and final target of this target recipe, corpus, device type and torch are kept."""
    h = hashlib.sha1(json.dumps([spec.target_recipe(), on.type, torch.__version__]).encode())
    for text in texts:
        h.update(text.encode())
        h.update(b"\0")
    return specserve_home() / "stages" / f"target-{h.hexdigest()[:10]}"


def _final_target(spec: DemoSpec, texts: list[str], on: torch.device, progress: bool):
    """(tokenizer, corpus token stream, final target on `on`, manifest fields): trained (tokenizer, cross-entropy,
    unlikelihood), or loaded from the checkpoint an earlier build of the same target recipe left (a recipe that
    changes only the draft then skips the target's ~20 minutes; the stages are deterministic, so the weights are the
    same)."""
    from transformers import AutoModelForCausalLM

    stage = target_stage_dir(spec, texts, on)
    if (stage / "stage.json").is_file():
        log(progress, f"target: the checkpoint of this target recipe, {stage}")
        tokenizer = saved_tokenizer(stage / "tokenizer.json")
        target = AutoModelForCausalLM.from_pretrained(stage, local_files_only=True, dtype=torch.float32).to(on)
        meta = json.loads((stage / "stage.json").read_text())
        return tokenizer, encode_stream(tokenizer, texts), target.eval(), meta

    torch.manual_seed(spec.seed)
    tokenizer = train_tokenizer(texts, spec.vocab_size)
    stream = encode_stream(tokenizer, texts)
    log(progress, f"tokenizer: {len(tokenizer)} tokens; corpus is {len(stream):,} tokens")
    target = _llama(tokenizer, spec.target_layers, spec.target_hidden, spec).to(on)
    losses = _train("target", target, stream, spec.target_steps, spec, None, progress)
    ul_losses = []
    if spec.unlikelihood_steps:
        ul_losses = _unlikelihood(target, stream, spec, progress)
    meta = {
        "target_final_loss": _tail_mean(losses),
        "target_final_unlikelihood": _tail_mean(ul_losses) if ul_losses else None,
    }
    staging = stage.with_name(stage.name + f".saving-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    target.save_pretrained(staging)  # fp32, whatever the family's packaged copy is rounded to
    tokenizer.save_pretrained(staging)
    (staging / "stage.json").write_text(json.dumps(meta, indent=2))
    move_into_place(staging, stage)
    return tokenizer, stream, target, meta


def _teacher_logprobs(target, pool, progress: bool, file: Path):
    bar = tqdm(total=len(pool), desc="target log-probs", unit="seq", disable=not progress, file=sys.stderr)
    try:
        return teacher_logprobs(target, pool, on_batch=bar.update, file=file)
    finally:
        bar.close()


def _tail_mean(losses: list[float]) -> float:
    return sum(losses[-20:]) / len(losses[-20:])


def _progress_bar(name: str, steps: int, progress: bool):
    bar = tqdm(total=steps, desc=f"train {name}", unit="step", disable=not progress, file=sys.stderr)

    def on_step(step: int, loss: float) -> None:
        bar.update(1)
        bar.set_postfix(loss=f"{loss:.3f}", refresh=False)

    return bar, on_step


def _train(name, model, stream, steps, spec: DemoSpec, teacher, progress: bool, data=None, lr=None,
           argmax_weight=0.0) -> list[float]:  # fmt: skip
    bar, on_step = _progress_bar(name, steps, progress)
    try:
        return train_lm(model, stream, steps, spec.batch, spec.seq_len, lr or spec.lr,
                        spec.seed + (1 if teacher else 0), teacher=teacher, on_step=on_step, data=data,
                        argmax_weight=argmax_weight)  # fmt: skip
    finally:
        bar.close()


def _continuation_pool(target, stream, spec: DemoSpec, device, progress: bool):
    bar = tqdm(total=spec.onpolicy_pool, desc="target continuations", unit="seq", disable=not progress,
               file=sys.stderr)  # fmt: skip
    try:
        return continuation_pool(stream, target, spec.onpolicy_pool, spec.seed + 3, device, on_batch=bar.update)
    finally:
        bar.close()


def _unlikelihood(target, stream, spec: DemoSpec, progress: bool) -> list[float]:
    # A sixth of the peak rate: it fine-tunes a trained model (measured at 5e-4 on the demo target).
    bar, on_step = _progress_bar("target unlikelihood", spec.unlikelihood_steps, progress)
    try:
        return unlikelihood_finetune(target, stream, spec.unlikelihood_steps, spec.batch, spec.seq_len, spec.lr / 6,
                                     spec.seed + 2, on_step=on_step)  # fmt: skip
    finally:
        bar.close()
