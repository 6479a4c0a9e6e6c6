"""The head's whole recipe in one time-boxed run, for a GPU lent for minutes: data, held-out data, a training run sized
to the time left, the head and a summary.

    python -m specserve.workers.training.eagle_recipe --target DIR_OR_GGUF --work DIR --out DIR --device cuda \\
        --answer-tokens 1100000 --data-seconds 240 --train-seconds 200

Data stops at `--answer-tokens` or after the shard that passes `--data-seconds`, whichever comes first. Training
first times a few steps (two short runs, so their start-up cancels out), then runs as many steps as fit in what is
left of `--train-seconds` (a cosine schedule needs its length up front), capped at `--max-epochs` passes. The held-out
set is generated with another seed: other questions, never the bench's. `--out` gets the head (its weights split in
two files of under 16 MB, see split_weights), `summary.json` and the data's token ids (`tokens.npz`, no features), so
the data can be re-featured and the head retrained elsewhere.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from specserve.workers.training.eagle_data import generate_data
from specserve.workers.training.eagle_manifest import GenerationSettings, read_manifest
from specserve.workers.training.eagle_tokens import restore_data, save_token_ids

log = logging.getLogger(__name__)

WEIGHTS_PARTS = ("model-1.safetensors", "model-2.safetensors")


def split_weights(head_dir: Path, out: Path) -> list[Path]:
    """The head's model.safetensors as two files (the lm_head apart from the rest), each under the 16 MB a lent
    machine sends back; join_weights makes the one file again."""
    tensors = load_file(str(head_dir / "model.safetensors"))
    first = {k: v for k, v in tensors.items() if not k.startswith("lm_head")}
    second = {k: v for k, v in tensors.items() if k.startswith("lm_head")}
    paths = [out / WEIGHTS_PARTS[0], out / WEIGHTS_PARTS[1]]
    save_file(first, str(paths[0]), metadata={"format": "pt"})
    save_file(second, str(paths[1]), metadata={"format": "pt"})
    return paths


def join_weights(parts_dir: Path, head_dir: Path) -> Path:
    tensors: dict[str, torch.Tensor] = {}
    for name in WEIGHTS_PARTS:
        tensors |= load_file(str(parts_dir / name))
    head_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(head_dir / "model.safetensors"), metadata={"format": "pt"})
    return head_dir / "model.safetensors"


def pack(work: Path, out: Path) -> bool:
    """After a run cut short: the head from the newest training checkpoint, split into `out`. False when none."""
    from specserve.workers.speculation.eagle.checkpoint import save_head
    from specserve.workers.speculation.eagle.config import Eagle3Config
    from specserve.workers.speculation.eagle.head import Eagle3Head
    from specserve.workers.training.eagle_train import STATE_FILE

    out.mkdir(parents=True, exist_ok=True)
    states = [p for p in (work / "head" / STATE_FILE, work / "calibration" / STATE_FILE) if p.is_file()]
    if not states:
        return False
    state = torch.load(states[0], weights_only=True, map_location="cpu")
    config = state["config"]
    head = Eagle3Head(Eagle3Config(**{**config, "feature_layers": tuple(config["feature_layers"])}))
    head.load_state_dict(state["head"])
    head_dir = save_head(head, work / "packed")
    split_weights(head_dir, out)
    (out / "config.json").write_text((head_dir / "config.json").read_text())
    log.info("packed the head of %s at step %d", states[0], state["step"])
    return True


def _timed(fn, *args, **kwargs) -> float:
    started = time.monotonic()
    fn(*args, **kwargs)
    return time.monotonic() - started


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", required=True)
    p.add_argument("--work", required=True, help="data and checkpoints (several GB of features per 1M tokens)")
    p.add_argument("--out", required=True, help="the head, its summary and the data's token ids")
    p.add_argument("--device", default="cuda")
    p.add_argument("--answer-tokens", type=int, default=1_100_000)
    p.add_argument("--eval-answer-tokens", type=int, default=40_000)
    p.add_argument("--data-seconds", type=float, default=240.0)
    p.add_argument("--train-seconds", type=float, default=200.0)
    p.add_argument("--max-epochs", type=int, default=12)
    p.add_argument("--shard-sequences", type=int, default=512)
    p.add_argument("--batch", type=int, default=512, help="rows per generate call")
    p.add_argument("--max-answer-tokens", type=int, default=256)
    p.add_argument("--feature-batch-tokens", type=int, default=65536)
    p.add_argument("--batch-tokens", type=int, default=8192, help="tokens per optimizer step")
    p.add_argument("--lr", type=float, default=8e-4)
    p.add_argument("--ttt-steps", type=int, default=4)
    p.add_argument("--draft-vocab-size", type=int, default=8192)
    p.add_argument("--seed", type=int, default=0, help="the new data's seed (another seed, other questions)")
    p.add_argument("--restore", action="append", default=[], metavar="TOKENS_NPZ",
                   help="an earlier run's tokens.npz: re-featured and trained on beside the new data")  # fmt: skip
    p.add_argument(
        "--eval-every", type=int, default=0, help="held-out acceptance every this many steps (0: at the end)"
    )
    p.add_argument("--pack-only", action="store_true", help="only pack the newest checkpoint in --work into --out")
    return p


# Timed on the first shard, a step ran 0.05 s; over all eleven shards of the 1.1M-token run, 0.085 s (shard loads).
_STEP_MARGIN = 1.8


def _steps(args: argparse.Namespace, target: str, work: Path, dirs: list[Path], tokens: int, seconds_left: float,
           common: dict):  # fmt: skip
    """How many steps fit in `seconds_left`, from two short timed runs, capped at --max-epochs passes."""
    from specserve.workers.training.eagle_train import train_head

    calib = work / "calibration"
    first = _timed(train_head, dirs, target, calib, steps=5, **common)
    second = _timed(train_head, dirs, target, calib, steps=25, **common)  # resumes: 20 more steps
    per_step = max((second - first) / 20 * _STEP_MARGIN, 1e-3)
    overhead = max(first - 5 * per_step, 0.0)
    epoch_steps = max(1, math.ceil(tokens / args.batch_tokens))
    steps = int(max(50, min((seconds_left - first - second - 2 * overhead - 20) / per_step,
                            args.max_epochs * epoch_steps)))  # fmt: skip
    log.info("%.3f s a step with margin (start-up %.0f s); %.0f s left: %d steps (%.1f passes)", per_step, overhead,
             seconds_left, steps, steps / epoch_steps)  # fmt: skip
    return steps, per_step, steps / epoch_steps


def main(argv: list[str] | None = None) -> int:
    from specserve.workers.models.catalog import resolve_model
    from specserve.workers.training.eagle_train import train_head

    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    work, out = Path(args.work), Path(args.out)
    if args.pack_only:
        return 0 if pack(work, out) else 1
    started = time.monotonic()
    out.mkdir(parents=True, exist_ok=True)
    target = resolve_model(args.target, progress=False)
    restored = _restore(args, target, work)
    data = generate_data(target, work / "data", args.answer_tokens, args.seed, _settings(args, args.shard_sequences),
                         args.feature_batch_tokens, progress=False, device=args.device,
                         deadline=started + args.data_seconds)  # fmt: skip
    held_out = generate_data(target, work / "eval", args.eval_answer_tokens, 1,
                             _settings(args, min(128, args.shard_sequences)), args.feature_batch_tokens,
                             progress=False, device=args.device)  # fmt: skip
    data_s = time.monotonic() - started
    dirs = [*restored, work / "data"]
    answer_tokens = save_token_ids(dirs, out / "tokens.npz")
    common = dict(ttt_steps=args.ttt_steps, draft_vocab_size=args.draft_vocab_size, lr=args.lr,
                  batch_tokens=args.batch_tokens, device=args.device, bf16=args.device == "cuda",
                  progress=False)  # fmt: skip
    shards = [s for d in dirs for s in read_manifest(d).shards]
    tokens = sum(s.tokens for s in shards)
    steps, per_step, passes = _steps(args, target, work, dirs, tokens, args.train_seconds, common)
    result = train_head(dirs, target, work / "head", steps=steps, eval_data_dir=work / "eval",
                        eval_every_steps=args.eval_every, checkpoint_every_s=30.0, **common)  # fmt: skip
    split_weights(result.head_dir, out)
    (out / "config.json").write_text((result.head_dir / "config.json").read_text())
    summary = {
        "answer_tokens": answer_tokens, "new_answer_tokens": data.answer_tokens, "tokens": tokens,
        "sequences": sum(s.sequences for s in shards), "shards": len(shards),
        "eval_answer_tokens": held_out.answer_tokens, "data_seconds": round(data_s, 1),
        "steps": result.steps, "passes": round(passes, 2), "seconds_per_step": round(per_step, 4),
        "train_seconds": round(time.monotonic() - started - data_s, 1), "accuracy_by_step": result.accuracy,
        "losses_by_step": result.losses, "held_out_acceptance": result.acceptance,
        "held_out_acceptance_by_step": result.acceptance_by_step, "settings": vars(args),
        "device": torch.cuda.get_device_name() if args.device == "cuda" else args.device,
    }  # fmt: skip
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps({k: summary[k] for k in ("answer_tokens", "steps", "held_out_acceptance")}))
    return 0


def _restore(args: argparse.Namespace, target: str, work: Path) -> list[Path]:
    """Each --restore file re-featured into a data directory of its own (work/restored-i)."""
    if not args.restore:
        return []
    from specserve.workers.training.eagle_target import EagleTarget

    featurer = EagleTarget(target, device=args.device)
    dirs = [work / f"restored-{i}" for i in range(len(args.restore))]
    for path, data_dir in zip(args.restore, dirs, strict=True):
        restore_data(Path(path), featurer, data_dir, args.shard_sequences, args.feature_batch_tokens)
    del featurer
    return dirs


def _settings(args: argparse.Namespace, shard_sequences: int) -> GenerationSettings:
    return GenerationSettings(
        shard_sequences=shard_sequences, batch=args.batch, max_answer_tokens=args.max_answer_tokens
    )


if __name__ == "__main__":
    sys.exit(main())
