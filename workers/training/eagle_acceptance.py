"""Held-out acceptance of a head in training (greedy chains teacher-forced on EAGLE-3 data, no target forward), and
the target's frozen weights the head is trained and measured with."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from specserve.workers.errors import ModelLoadError
from specserve.workers.speculation.eagle.head import Eagle3Head, ttt_forward
from specserve.workers.training.eagle_manifest import read_manifest, shard_paths
from specserve.workers.training.eagle_shards import load_shard, make_batch, plan_batches


@dataclass(frozen=True)
class TargetWeights:
    embed: torch.Tensor  # [V, H] float32, frozen
    lm_head: torch.Tensor  # [V, H] float32
    config: object  # the target's Hugging Face config


def target_weights(target_path: str | Path, device: str = "cpu") -> TargetWeights:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(target_path), local_files_only=True, dtype=torch.float32)
    embed = model.get_input_embeddings().weight.detach().to(device, copy=True)
    lm_head = model.get_output_embeddings().weight.detach().to(device, copy=True)
    return TargetWeights(embed=embed, lm_head=lm_head, config=model.config)


@torch.no_grad()
def chain_acceptance(
    head: Eagle3Head, target: TargetWeights, data_dir: str | Path, k: int, batch_tokens: int = 4096, max_len: int = 2048
) -> list[float]:
    """Per-position acceptance of greedy chains of k drafted tokens, teacher-forced on the data: from every answer
    position whose next k tokens are all answer tokens, the head drafts k tokens greedily (its chain fed the target's
    greedy tokens, which its drafts equal as long as they are accepted); entry i is the fraction of chains whose first
    i+1 drafts all equal the target's greedy tokens (computed from last_hidden)."""
    manifest = read_manifest(data_dir)
    if head.config.target_identity not in (None, manifest.target):
        raise ModelLoadError(f"{Path(data_dir) / 'manifest.json'} was generated for another target than the head's")
    accepted = torch.zeros(k, dtype=torch.int64)
    starts = 0
    for path in shard_paths(data_dir, manifest):
        shard = load_shard(path, target.lm_head, manifest.hidden_size)
        lengths = shard.seq_starts[1:] - shard.seq_starts[:-1]
        for sequences in plan_batches(lengths, batch_tokens, max_len, torch.Generator().manual_seed(0)):
            batch = make_batch(shard, sequences, k, max_len).to(target.embed.device)
            tokens = [batch.at_step(batch.tokens, 0)] + [batch.greedy[:, j : j + batch.entries] for j in range(1, k)]
            hiddens = ttt_forward(head, target.embed, batch.features, tokens)
            valid = torch.stack([batch.at_step(batch.answer, j) for j in range(k)]).all(0)  # [B, T]
            hits = torch.stack(
                [
                    head.draft_to_target(head.logits(h[valid]).argmax(-1)) == batch.at_step(batch.greedy, j)[valid]
                    for j, h in enumerate(hiddens)
                ]
            )  # [k, n]
            accepted += hits.cumprod(0).sum(1).cpu()
            starts += int(valid.sum())
    if not starts:
        raise ModelLoadError(f"{data_dir}: no answer has {k} tokens to draft")
    return (accepted.double() / starts).tolist()
