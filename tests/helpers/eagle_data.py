"""Tiny EAGLE-3 training data in the shared format (manifest.json + shard-NNNNN.safetensors), made from a tiny target:
random prompts, greedy answers, features and last_hidden from an fp32 forward over the whole sequence. For tests."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from specserve.workers.models.identity import target_identity
from specserve.workers.speculation.eagle.config import default_feature_layers
from specserve.workers.training.eagle_manifest import MANIFEST, DataManifest, GenerationSettings, ShardInfo, shard_name

FIRST_TOKEN = 3  # after the byte tokenizer's specials


@torch.no_grad()
def write_tiny_eagle_data(
    target_path: str | Path,
    out_dir: str | Path,
    sequences: int,
    seed: int,
    prompt_tokens: tuple[int, int] = (3, 8),
    answer_tokens: int = 16,
    per_shard: int = 16,
) -> Path:
    model = AutoModelForCausalLM.from_pretrained(str(target_path), local_files_only=True, dtype=torch.float32).eval()
    config = model.config
    layers = list(default_feature_layers(config.num_hidden_layers))
    generator = torch.Generator().manual_seed(seed)
    rows = []
    for start in range(0, sequences, 8):  # 8 prompts of one length at a time, answered greedily together
        length = int(torch.randint(prompt_tokens[0], prompt_tokens[1] + 1, (1,), generator=generator))
        ids = torch.randint(FIRST_TOKEN, config.vocab_size, (min(8, sequences - start), length), generator=generator)
        for _ in range(answer_tokens):
            ids = torch.cat([ids, model(ids).logits[:, -1:].argmax(-1)], dim=1)
        hidden = model(ids, output_hidden_states=True).hidden_states
        features = torch.cat([hidden[i] for i in layers], dim=-1)
        rows.extend((ids[b], length, features[b], hidden[-1][b]) for b in range(ids.shape[0]))
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    shards = [
        _write_shard(out_dir, i, rows[start : start + per_shard])
        for i, start in enumerate(range(0, sequences, per_shard))
    ]
    identity = target_identity(target_path)
    manifest = DataManifest(identity, str(target_path), config.num_hidden_layers, config.hidden_size,
                            config.vocab_size, layers, seed, GenerationSettings(), shards)  # fmt: skip
    (out_dir / MANIFEST).write_text(json.dumps(manifest.to_json(), indent=2))
    return out_dir


def _write_shard(out_dir: Path, index: int, rows) -> ShardInfo:
    name = shard_name(index)
    lengths = [len(ids) for ids, _, _, _ in rows]
    loss_mask = torch.cat([(torch.arange(len(ids)) >= prompt).to(torch.uint8) for ids, prompt, _, _ in rows])
    tensors = {
        "input_ids": torch.cat([ids for ids, _, _, _ in rows]).to(torch.int32),
        "seq_starts": torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int64),
        "loss_mask": loss_mask,
        "features": torch.cat([f for _, _, f, _ in rows]).to(torch.float16),
        "last_hidden": torch.cat([h for _, _, _, h in rows]).to(torch.float16),
    }
    save_file(tensors, str(out_dir / name))
    return ShardInfo(name, len(rows), sum(lengths), int(loss_mask.sum()))
