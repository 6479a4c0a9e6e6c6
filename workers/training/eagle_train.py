"""Training an EAGLE-3 head on the shared data format, SpecForge's way: training-time test (TTT).

Each batch unrolls the head over `ttt_steps` drafting steps at every position (workers/speculation/eagle3.py
`ttt_forward`): step 0 reads the target's features, step j > 0 the head's own output of step j-1. Step j is scored
against the target's distribution restricted to the draft vocabulary (softmax of the target logits over the t2d
ids) by cross entropy, on answer positions whose target greedy token has a draft id, weighted step_weight**j. The
draft vocabulary is the answer tokens' most frequent `draft_vocab_size` ids. Checkpoints (model, optimizer, step, data
position) are written every few minutes and resumed; the head is saved in the community layout at the end.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from specserve.workers.errors import InvalidRequestError, ModelLoadError
from specserve.workers.models.identity import target_identity
from specserve.workers.speculation.eagle.checkpoint import save_head
from specserve.workers.speculation.eagle.config import Eagle3Config
from specserve.workers.speculation.eagle.head import Eagle3Head, ttt_forward, vocab_maps
from specserve.workers.training.eagle_acceptance import TargetWeights, chain_acceptance, target_weights
from specserve.workers.training.eagle_manifest import DataManifest, read_manifest, shard_paths
from specserve.workers.training.eagle_shards import (
    Batch,
    Shard,
    answer_token_counts,
    load_shard,
    make_batch,
    plan_batches,
    sequence_lengths,
)

log = logging.getLogger(__name__)

STATE_FILE = "train-state.pt"
MAX_GRAD_NORM = 0.5  # SpecForge's default


@dataclass
class StepStats:
    loss: torch.Tensor  # the weighted TTT loss (with grad)
    losses: list[float]  # per step
    correct: list[int]  # per step: draft argmax == the target's greedy token, on answer positions
    counted: list[int]


def ttt_loss(
    head: Eagle3Head, target: TargetWeights, batch: Batch, steps: int, step_weight: float, bf16: bool
) -> StepStats:
    """The TTT loss of one batch, with per-step accuracy counts."""
    device = target.embed.device
    draft_lm = target.lm_head[head.draft_to_target(torch.arange(head.config.draft_vocab_size, device=device))]
    tokens = [batch.at_step(batch.tokens, j) for j in range(steps)]
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
        hiddens = ttt_forward(head, target.embed, batch.features, tokens)
    stats = StepStats(loss=torch.zeros((), device=device), losses=[], correct=[], counted=[])
    for j, hidden in enumerate(hiddens):
        answer = batch.at_step(batch.answer, j)
        greedy = batch.at_step(batch.greedy, j)[answer]
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            logits = head.logits(hidden[answer]).float()  # [n, Vd]
        with torch.no_grad():
            target_p = (batch.at_step(batch.target_hidden, j)[answer].float() @ draft_lm.T).softmax(-1)
            stats.correct.append(int((head.draft_to_target(logits.argmax(-1)) == greedy).sum()))
            stats.counted.append(int(greedy.numel()))
        in_vocab = head.t2d[greedy]  # a target whose greedy token has no draft id teaches nothing useful
        loss = -(target_p[in_vocab] * logits[in_vocab].log_softmax(-1)).sum(-1).mean() if in_vocab.any() else None
        stats.losses.append(float(loss.detach()) if loss is not None else float("nan"))
        if loss is not None:
            stats.loss = stats.loss + step_weight**j * loss
    return stats


@dataclass(frozen=True)
class TrainSettings:
    ttt_steps: int
    draft_vocab_size: int
    batch_tokens: int
    seed: int
    max_len: int
    target: str  # identity


@dataclass
class TrainResult:
    head_dir: Path
    steps: int
    losses: list[float]  # per TTT step, over the last logging window
    accuracy: list[float]  # per TTT step, likewise
    acceptance: list[float] | None  # chain_acceptance on eval_data_dir, when given
    acceptance_by_step: list[tuple[int, list[float]]] = dataclasses.field(default_factory=list)


def train_head(
    data_dir: str | Path | Sequence[str | Path],
    target_path: str | Path,
    out_dir: str | Path,
    *,
    steps: int | None = None,
    epochs: int = 1,
    ttt_steps: int = 3,
    draft_vocab_size: int = 8192,
    lr: float = 5e-4,
    batch_tokens: int = 4096,
    seed: int = 0,
    resume: bool = True,
    progress: bool = True,
    bf16: bool = False,
    step_weight: float = 0.8,
    max_len: int = 2048,
    checkpoint_every_s: float = 300.0,
    log_every_s: float = 30.0,
    eval_data_dir: str | Path | None = None,
    eval_every_steps: int = 0,
    device: str = "cpu",
) -> TrainResult:
    """Train (or resume training) a head for the target at `target_path` on `data_dir`; save it to `out_dir`.

    Runs `steps` optimizer steps if given, else `epochs` passes over the data (the shards of every directory in
    `data_dir`, one target's). With `eval_data_dir`, held-out acceptance after training and, with
    `eval_every_steps`, every that many steps too (`TrainResult.acceptance_by_step`). bf16: autocast the head's matmuls
    (fast on GPUs and CPUs with bf16 units; on a CPU with only AVX2 it was over 10x slower than float32)."""
    say = log.info if progress else log.debug
    identity = target_identity(target_path)
    manifest, paths = _data(data_dir, identity, target_path)
    settings = TrainSettings(ttt_steps, draft_vocab_size, batch_tokens, seed, max_len, identity)
    target = target_weights(target_path, device)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    run = _Run.start(out_dir / STATE_FILE, settings, manifest, target, paths, lr, resume)
    data = _Batches(paths, manifest.hidden_size, target, settings)
    total = steps if steps is not None else sum(len(data.plans.epoch(e)) for e in range(epochs))
    say("training EAGLE-3 head: %d steps of TTT %d, draft vocabulary %d, from step %d", total, ttt_steps,
        draft_vocab_size, run.step)  # fmt: skip
    history: list[tuple[int, list[float]]] = []

    def evaluate() -> None:
        history.append((run.step, chain_acceptance(run.head.eval(), target, eval_data_dir, ttt_steps, batch_tokens,
                                                   max_len)))  # fmt: skip
        run.head.train()
        log.info("step %d: held-out acceptance per position %s", run.step, " ".join(f"{a:.3f}" for a in history[-1][1]))

    every = eval_every_steps if eval_data_dir is not None else 0
    window = _train_loop(run, data, total, lr, step_weight, bf16, (checkpoint_every_s, log_every_s), say,
                         (every, evaluate))  # fmt: skip
    losses, accuracy = window.last
    head_dir = save_head(run.head, out_dir)
    if eval_data_dir is not None:
        evaluate()
    return TrainResult(head_dir, run.step, losses, accuracy, history[-1][1] if history else None, history)


def _data(data_dir, identity: str, target_path) -> tuple[DataManifest, list[Path]]:
    """The first directory's manifest and the shards of every directory, all of the target `identity`."""
    dirs = [Path(data_dir)] if isinstance(data_dir, (str, Path)) else [Path(d) for d in data_dir]
    manifests = [read_manifest(d) for d in dirs]
    for d, m in zip(dirs, manifests, strict=True):
        if m.target != identity or m.feature_layers != manifests[0].feature_layers:
            raise ModelLoadError(f"{d / 'manifest.json'} was generated for another target than {target_path}")
    return manifests[0], [p for d, m in zip(dirs, manifests, strict=True) for p in shard_paths(d, m)]


def _train_loop(
    run: _Run,
    data: _Batches,
    total: int,
    lr: float,
    step_weight: float,
    bf16: bool,
    every_s: tuple[float, float],
    say,
    evaluation: tuple[int, Callable[[], None]] = (0, lambda: None),
) -> _Window:
    """Optimizer steps up to `total`, logging per-step loss and accuracy and checkpointing every `every_s` seconds
    (and calling `evaluation[1]` every `evaluation[0]` steps before the last)."""
    checkpoint_every_s, log_every_s = every_s
    window = _Window(run.settings.ttt_steps)
    last_log = last_save = time.monotonic()
    while run.step < total:
        window.add(run.train_step(data.next(run), _lr_at(lr, run.step, total), step_weight, bf16))
        now = time.monotonic()
        if now - last_log >= log_every_s or run.step == total:
            say("step %d/%d epoch %d: loss %s accuracy %s", run.step, total, run.epoch, *window.text())
            last_log = now
        if now - last_save >= checkpoint_every_s:
            run.save()
            last_save = now
        if evaluation[0] and run.step % evaluation[0] == 0 and run.step < total:
            evaluation[1]()
    run.save()
    return window


def _lr_at(lr: float, step: int, total: int) -> float:
    """Linear warmup, then cosine decay to a tenth."""
    warmup = max(1, min(50, total // 10))
    if step < warmup:
        return lr * (step + 1) / warmup
    return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, total - warmup))))


class _Batches:
    """The run's batches in plan order, from the run's data position; one shard in memory at a time."""

    def __init__(self, paths: list[Path], hidden_size: int, target: TargetWeights, settings: TrainSettings):
        self.paths, self.hidden_size, self.target, self.settings = paths, hidden_size, target, settings
        self.plans = _EpochPlans([sequence_lengths(p) for p in paths], settings)
        self._shard: tuple[int, Shard] | None = None

    def next(self, run: _Run) -> Batch:
        """The batch at the run's position (moving it to the next epoch when one is done)."""
        while run.batch >= len(self.plans.epoch(run.epoch)):
            run.epoch, run.batch = run.epoch + 1, 0
        shard_index, sequences = self.plans.epoch(run.epoch)[run.batch]
        if self._shard is None or self._shard[0] != shard_index:
            self._shard = (shard_index, load_shard(self.paths[shard_index], self.target.lm_head, self.hidden_size))
        batch = make_batch(self._shard[1], sequences, self.settings.ttt_steps, self.settings.max_len)
        return batch.to(self.target.embed.device)


class _EpochPlans:
    """Each epoch's batches, (shard index, sequence indices): a seeded shard order and in-shard order per epoch, so a
    resumed run sees the same data from its saved position."""

    def __init__(self, lengths: list[torch.Tensor], settings: TrainSettings):
        self.lengths, self.settings, self._plans = lengths, settings, {}

    def epoch(self, epoch: int) -> list[tuple[int, list[int]]]:
        if epoch not in self._plans:
            s = self.settings
            generator = torch.Generator().manual_seed(s.seed * 100_003 + epoch)
            plan = []
            for shard in torch.randperm(len(self.lengths), generator=generator).tolist():
                batches = plan_batches(self.lengths[shard], s.batch_tokens, s.max_len, generator)
                plan.extend((shard, sequences) for sequences in batches)
            if not plan:
                raise ModelLoadError("the EAGLE data has no sequence long enough to train on")
            self._plans = {epoch: plan}  # keep one: epochs are visited in order
        return self._plans[epoch]


class _Window:
    """Per-step loss and accuracy over the batches since the last log line."""

    def __init__(self, steps: int):
        self.steps = steps
        self.reset()
        self.last = self.means()  # the last logged window's

    def reset(self) -> None:
        if hasattr(self, "loss_sum"):
            self.last = self.means()
        self.loss_sum, self.loss_n = [0.0] * self.steps, [0] * self.steps
        self.correct, self.counted = [0] * self.steps, [0] * self.steps

    def add(self, stats: StepStats) -> None:
        for j in range(self.steps):
            if not math.isnan(stats.losses[j]):
                self.loss_sum[j] += stats.losses[j]
                self.loss_n[j] += 1
            self.correct[j] += stats.correct[j]
            self.counted[j] += stats.counted[j]

    def means(self) -> tuple[list[float], list[float]]:
        losses = [s / n if n else float("nan") for s, n in zip(self.loss_sum, self.loss_n, strict=True)]
        return losses, [c / n if n else float("nan") for c, n in zip(self.correct, self.counted, strict=True)]

    def text(self) -> tuple[str, str]:
        losses, accuracy = self.means()
        self.reset()
        return " ".join(f"{x:.3f}" for x in losses), " ".join(f"{x:.3f}" for x in accuracy)


@dataclass
class _Run:
    path: Path
    settings: TrainSettings
    target: TargetWeights
    head: Eagle3Head
    optimizer: torch.optim.Optimizer
    step: int = 0
    epoch: int = 0
    batch: int = 0

    @classmethod
    def start(cls, path: Path, settings: TrainSettings, manifest: DataManifest, target: TargetWeights, paths, lr,
              resume):  # fmt: skip
        if resume and path.is_file():
            return cls._resume(path, settings, target)
        counts = answer_token_counts(paths, manifest.vocab_size)
        if not counts.any():
            raise ModelLoadError(f"{paths[0].parent} has no answer tokens to train on")
        d2t, t2d = vocab_maps(counts, settings.draft_vocab_size)
        config = Eagle3Config.for_target(target.config, settings.draft_vocab_size, settings.target)
        config = dataclasses.replace(config, feature_layers=tuple(manifest.feature_layers))
        torch.manual_seed(settings.seed)
        head = Eagle3Head(config)
        head.set_vocab_maps(d2t, t2d)
        head.to(target.embed.device)
        return cls(path, settings, target, head, _optimizer(head, lr))

    @classmethod
    def _resume(cls, path: Path, settings: TrainSettings, target: TargetWeights) -> _Run:
        state = torch.load(path, weights_only=True, map_location="cpu")
        saved = TrainSettings(**state["settings"])
        if saved != settings:
            raise InvalidRequestError(
                "resume", f"{path} was written with {saved}, not {settings}: resume with those, or resume=False"
            )
        config = state["config"]
        head = Eagle3Head(Eagle3Config(**{**config, "feature_layers": tuple(config["feature_layers"])}))
        head.load_state_dict(state["head"])
        head.to(target.embed.device)  # before the optimizer, whose state follows its parameters' device
        optimizer = _optimizer(head, 0.0)
        optimizer.load_state_dict(state["optimizer"])
        log.info("resuming EAGLE-3 training from %s at step %d", path, state["step"])
        return cls(path, settings, target, head, optimizer, state["step"], state["epoch"], state["batch"])

    def train_step(self, batch: Batch, lr: float, step_weight: float, bf16: bool) -> StepStats:
        """One optimizer step on the batch at the run's data position; moves the position on."""
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        stats = ttt_loss(self.head, self.target, batch, self.settings.ttt_steps, step_weight, bf16)
        self.optimizer.zero_grad(set_to_none=True)
        if stats.loss.requires_grad:  # no batch position had a draft-vocabulary target: nothing to learn
            stats.loss.backward()
            torch.nn.utils.clip_grad_norm_(self.head.parameters(), MAX_GRAD_NORM)
            self.optimizer.step()
        self.step, self.batch = self.step + 1, self.batch + 1
        return stats

    def save(self) -> None:
        state = {
            "settings": asdict(self.settings),
            "config": asdict(self.head.config),
            "head": self.head.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "step": self.step,
            "epoch": self.epoch,
            "batch": self.batch,
        }
        tmp = self.path.with_suffix(".tmp")
        torch.save(state, tmp)
        os.replace(tmp, self.path)


def _optimizer(head: Eagle3Head, lr: float) -> torch.optim.Optimizer:
    return torch.optim.AdamW(head.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
