"""EAGLE-3 training data from a target model, written in shards and resumable across days.

A data directory (default $SPECSERVE_HOME/eagle-data/<target identity[:16]>/) holds `manifest.json` and shards
`shard-00000.safetensors`, ...; each shard holds `input_ids` int32 [T] (sequences concatenated: prompt then answer),
`seq_starts` int64 [S+1], `loss_mask` uint8 [T] (1 on answer tokens, those the target generated), `features` float16
[T, 3H] (hidden_states[2], [N//2], [N-3] concatenated) and `last_hidden` float16 [T, H] (hidden_states[-1], the final
normed state), both from an fp32 forward over the whole sequence.

A shard is written to a temporary file and renamed when complete, so a shard file is always whole. Shard i draws
everything it samples from a seed derived from (seed, i): a restart skips the shards on disk and continues with the
next, and makes the data a single run would have made (on the same machine and settings, which the manifest records
and a resume must match). Questions are the target's own (Magpie-style, see eagle_prompts.py) plus TRAIN_QUESTIONS,
never the bench's HELD_OUT_QUESTIONS; answers use the bench's chat rendering.

    python -m specserve.workers.training.eagle_data --target smollm2-135m-instruct --answer-tokens 1000000

On a shared CPU run it with OMP_WAIT_POLICY=PASSIVE (or --threads 1): torch's OpenMP threads spin while they wait,
and beside other busy processes 32 rows x 16 decode steps took 85 s with 2 spinning threads, 10 s with 2 passive
ones and 9 s with 1 thread (2 cores).
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import logging
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm import tqdm

from specserve.workers.errors import InvalidRequestError, ModelLoadError
from specserve.workers.models.identity import target_identity
from specserve.workers.speculation.eagle.config import default_feature_layers
from specserve.workers.training.eagle_manifest import (
    FORMAT,
    MANIFEST,
    DataManifest,
    GenerationSettings,
    ShardInfo,
    default_data_dir,
    read_manifest,
    shard_name,
)
from specserve.workers.training.eagle_target import EagleTarget, Sampling, passage_requests, pick_questions

log = logging.getLogger(__name__)


def feature_layers(num_hidden_layers: int) -> list[int]:
    """The hidden_states indices EAGLE-3 reads (vLLM's and SGLang's default): the residual stream entering layers
    2, N//2 and N-3."""
    layers = list(default_feature_layers(num_hidden_layers))
    if not layers[0] < layers[1] < layers[2]:
        raise ModelLoadError(
            f"the target has {num_hidden_layers} layers; EAGLE-3 features (layers 2, N//2, N-3) need at least 7"
        )
    return layers


def generate_data(
    target_path: str | Path,
    out_dir: str | Path | None,
    answer_tokens: int,
    seed: int = 0,
    settings: GenerationSettings | None = None,
    feature_batch_tokens: int = 8192,
    threads: int | None = None,
    progress: bool = True,
    device: str = "cpu",
    deadline: float | None = None,
) -> DataManifest:
    """Write shards into `out_dir` (default: default_data_dir) until they hold at least `answer_tokens` answer tokens
    (the last shard is whole, so up to one shard more), continuing from the shards already there; or, given a
    `deadline` (time.monotonic()), until the first whole shard that ends past it (a time-boxed run on a lent GPU).

    Raises InvalidRequestError when `out_dir` holds data of another target or settings, or another process is writing
    it; ModelLoadError when the target cannot be loaded or has too few layers."""
    settings = settings or GenerationSettings()
    _check_settings(settings, answer_tokens)
    identity = target_identity(target_path)
    out = Path(out_dir) if out_dir is not None else default_data_dir(identity)
    out.mkdir(parents=True, exist_ok=True)
    if threads:
        torch.set_num_threads(threads)
    with _exclusive(out):
        done = _already_done(out, identity, seed, settings, answer_tokens)
        if done is not None:  # no need to load the target
            log.info("EAGLE-3 data in %s: %d answer tokens, of %d asked for", out, done.answer_tokens, answer_tokens)
            return done
        target = EagleTarget(target_path, settings.gen_dtype, device)
        manifest = _resume(out, identity, target, seed, settings)
        write_manifest(out, manifest)
        done = manifest.answer_tokens
        log.info(
            "EAGLE-3 data for %s in %s: %d shards, %d answer tokens of %d",
            target.path,
            out,
            len(manifest.shards),
            done,
            answer_tokens,
        )
        with tqdm(
            total=answer_tokens,
            initial=min(done, answer_tokens),
            unit="tok",
            desc="answer tokens",
            file=sys.stderr,
            disable=not progress,
            dynamic_ncols=True,
            mininterval=0.5 if sys.stderr.isatty() else 60,  # a log file gets a line a minute
        ) as bar:
            while manifest.answer_tokens < answer_tokens:
                manifest.shards.append(_make_shard(target, out, manifest, feature_batch_tokens, bar.update))
                bar.total = max(bar.total, bar.n)  # the last shard is whole: it may pass the goal
                write_manifest(out, manifest)
                if deadline is not None and time.monotonic() >= deadline:
                    log.info("stopping at the deadline with %d answer tokens", manifest.answer_tokens)
                    break
    return manifest


def _check_settings(settings: GenerationSettings, answer_tokens: int) -> None:
    checks = {
        "answer_tokens": answer_tokens > 0,
        "shard_sequences": settings.shard_sequences > 0,
        "batch": settings.batch > 0,
        "max_answer_tokens": settings.max_answer_tokens > 0,
        "max_question_tokens": settings.max_question_tokens > 0,
        "greedy_fraction": 0.0 <= settings.greedy_fraction <= 1.0,
        "train_question_fraction": 0.0 <= settings.train_question_fraction <= 1.0,
        "answer_temperature": settings.answer_temperature > 0,
        "answer_top_p": 0.0 < settings.answer_top_p <= 1.0,
        "gen_dtype": settings.gen_dtype in ("bfloat16", "float16", "float32"),
        "passage_fraction": 0.0 <= settings.passage_fraction <= 1.0,
    }
    for name, ok in checks.items():
        if not ok:
            value = answer_tokens if name == "answer_tokens" else getattr(settings, name)
            raise InvalidRequestError(name, f"{value!r} is out of range")


@contextlib.contextmanager
def _exclusive(out: Path):
    """One writer per data directory: a second run would write the same shard names."""
    with open(out / ".lock", "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise InvalidRequestError("out", f"{out} is being written by another process; wait for it to end") from None
        yield


def _check_resumable(out: Path, old: DataManifest, identity: str, seed: int, settings: GenerationSettings) -> None:
    if old.target != identity:
        raise InvalidRequestError("out", f"{out} holds data of target {old.target[:16]}, not of {old.target_path}")
    if old.seed != seed:
        raise InvalidRequestError("seed", f"{out} was made with seed {old.seed}: resume with --seed {old.seed}")
    for name, value in asdict(old.settings).items():
        if getattr(settings, name) != value:
            flag = "--" + name.replace("_", "-")
            raise InvalidRequestError(name, f"{out} was made with {name}={value!r}: resume with {flag} {value}")


def _already_done(out: Path, identity: str, seed: int, settings: GenerationSettings, goal: int) -> DataManifest | None:
    """The directory's manifest when it already holds `goal` answer tokens of this target and settings."""
    if not (out / MANIFEST).exists():
        return None
    old = read_manifest(out)
    _check_resumable(out, old, identity, seed, settings)
    return old if old.answer_tokens >= goal else None


def _resume(out: Path, identity: str, target: EagleTarget, seed: int, settings: GenerationSettings) -> DataManifest:
    """The manifest for this run, with the whole shards already on disk (the files are the truth: a crash between a
    shard's rename and the manifest's update loses nothing)."""
    fresh = DataManifest(
        identity,
        target.path,
        target.num_hidden_layers,
        target.hidden_size,
        target.vocab_size,
        feature_layers(target.num_hidden_layers),
        seed,
        settings,
    )
    if (out / MANIFEST).exists():
        _check_resumable(out, read_manifest(out), identity, seed, settings)
    for stale in out.glob(".shard-*.tmp"):
        log.info("removing %s, left by an interrupted run", stale)
        stale.unlink()
    index = 0
    while (out / shard_name(index)).exists():
        fresh.shards.append(_shard_info(out / shard_name(index)))
        index += 1
    if index:
        log.info("resuming after %d whole shards (%d answer tokens)", index, fresh.answer_tokens)
    return fresh


def _shard_info(path: Path) -> ShardInfo:
    try:
        with safe_open(str(path), "pt") as f:
            meta = f.metadata() or {}
        return ShardInfo(path.name, int(meta["sequences"]), int(meta["tokens"]), int(meta["answer_tokens"]))
    except (OSError, ValueError, KeyError) as err:
        raise ModelLoadError(f"shard {path} is unreadable ({err!r}): delete it to generate it again") from err


def _make_shard(target: EagleTarget, out: Path, manifest: DataManifest, batch_tokens: int, on_tokens) -> ShardInfo:
    index, settings = len(manifest.shards), manifest.settings
    rng = np.random.default_rng([manifest.seed, index])
    started = time.perf_counter()
    questions, from_train = pick_questions(
        target,
        settings.shard_sequences,
        rng,
        settings.train_question_fraction,
        settings.max_question_tokens,
        settings.batch,
    )
    asked = time.perf_counter()
    prompts, answers = _answer(target, settings, questions, from_train, rng, on_tokens)
    answered = time.perf_counter()
    sequences = [p + a for p, a in zip(prompts, answers, strict=True)]
    masks = [[0] * len(p) + [1] * len(a) for p, a in zip(prompts, answers, strict=True)]
    info = write_shard(target, out, index, sequences, masks, manifest.feature_layers, batch_tokens)
    took = time.perf_counter() - started
    log.info(
        "%s: %d sequences, %d answer tokens in %.0f s (%.1f answer tok/s; questions %.0f s, answers %.0f s, "
        "features %.0f s)",
        info.file,
        info.sequences,
        info.answer_tokens,
        took,
        info.answer_tokens / took,
        asked - started,
        answered - asked,
        took - (answered - started),
    )
    return info


def write_shard(target: EagleTarget, out: Path, index: int, sequences: list[list[int]], masks: list[list[int]],
                layers: list[int], batch_tokens: int) -> ShardInfo:  # fmt: skip
    """Shard `index` of `out` from whole sequences and their answer masks, with the target's features; written to a
    temporary file and renamed, so a shard file is always whole."""
    features, last = target.features(sequences, layers, batch_tokens)
    tensors = {
        "input_ids": torch.tensor([t for s in sequences for t in s], dtype=torch.int32),
        "seq_starts": torch.tensor(np.concatenate([[0], np.cumsum([len(s) for s in sequences])]), dtype=torch.int64),
        "loss_mask": torch.tensor([m for mask in masks for m in mask], dtype=torch.uint8),
        "features": features,
        "last_hidden": last,
    }
    answer_tokens = int(tensors["loss_mask"].sum())
    info = ShardInfo(shard_name(index), len(sequences), len(tensors["input_ids"]), answer_tokens)
    meta = {"format": str(FORMAT), "shard": str(index), "sequences": str(info.sequences), "tokens": str(info.tokens),
            "answer_tokens": str(info.answer_tokens)}  # fmt: skip
    partial = out / f".{info.file}.tmp"
    save_file(tensors, str(partial), metadata=meta)
    partial.chmod(0o644)  # safetensors creates it owner-only; the trainer may run as another user
    os.replace(partial, out / info.file)
    return info


def _answer(target: EagleTarget, settings: GenerationSettings, questions: list[str], from_train: list[bool],
            rng: np.random.Generator, on_tokens) -> tuple[list[list[int]], list[list[int]]]:  # fmt: skip
    """The chat prompts of `questions` and the target's answers, then requests over some of those answers (long
    inputs: summaries, passage QA, translation) and their answers; TRAIN_QUESTIONS entries are always sampled."""
    prompts = [target.chat_prompt(q) for q in questions]
    sampled = [t or bool(g) for t, g in zip(from_train, rng.random(len(prompts)) >= settings.greedy_fraction,
                                            strict=True)]  # fmt: skip
    sampling = Sampling(settings.answer_temperature, settings.answer_top_p)
    answers = target.answers(prompts, sampled, settings.max_answer_tokens, sampling, rng, settings.batch, on_tokens)
    derived = passage_requests(target, questions, answers, rng, settings.passage_fraction)
    if derived:
        more = [target.chat_prompt(q) for q in derived]
        more_sampled = list(rng.random(len(more)) >= settings.greedy_fraction)
        prompts += more
        answers += target.answers(more, more_sampled, settings.max_answer_tokens, sampling, rng, settings.batch,
                                  on_tokens)  # fmt: skip
    return prompts, answers


def write_manifest(out: Path, manifest: DataManifest) -> None:
    partial = out / f".{MANIFEST}.tmp"
    partial.write_text(json.dumps(manifest.to_json(), indent=2) + "\n")
    os.replace(partial, out / MANIFEST)


def main(argv: list[str] | None = None) -> int:
    defaults = GenerationSettings()
    parser = argparse.ArgumentParser(description="Generate EAGLE-3 training data from a target model (resumable).")
    parser.add_argument("--target", required=True, help="known model name, .gguf file or Hugging Face directory")
    parser.add_argument("--out", help="data directory (default $SPECSERVE_HOME/eagle-data/<target id>)")
    parser.add_argument("--answer-tokens", type=int, required=True, help="stop once the shards hold this many")
    parser.add_argument("--shard-sequences", type=int, default=defaults.shard_sequences)
    parser.add_argument("--batch", type=int, default=defaults.batch, help="rows per generate call")
    parser.add_argument("--max-answer-tokens", type=int, default=defaults.max_answer_tokens)
    parser.add_argument("--gen-dtype", default=defaults.gen_dtype, choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--feature-batch-tokens", type=int, default=8192, help="padded tokens per fp32 forward")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--passage-fraction",
        type=float,
        default=defaults.passage_fraction,
        help="per question, the chance of one more request over its answer (summary, QA, translation)",
    )
    parser.add_argument("--threads", type=int, help="torch CPU threads (default: torch's)")
    parser.add_argument("--device", default="cpu", help="where the target generates: cpu or cuda")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from specserve.workers.models.catalog import resolve_model

    settings = GenerationSettings(
        shard_sequences=args.shard_sequences,
        batch=args.batch,
        max_answer_tokens=args.max_answer_tokens,
        gen_dtype=args.gen_dtype,
        passage_fraction=args.passage_fraction,
    )
    try:
        manifest = generate_data(
            resolve_model(args.target, progress=not args.quiet),
            args.out,
            args.answer_tokens,
            args.seed,
            settings,
            args.feature_batch_tokens,
            args.threads,
            not args.quiet,
            args.device,
        )
    except (InvalidRequestError, ModelLoadError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"{len(manifest.shards)} shards, {manifest.answer_tokens} answer tokens")
    return 0


if __name__ == "__main__":
    sys.exit(main())
