"""EAGLE-3 data as token ids alone, small enough to keep: saved from data directories, restored by re-featuring.

A data directory holds gigabytes of features (about 4.6 KB a token for SmolLM2), which a GPU lent for minutes cannot
send back; its token ids and answer masks compress to about 0.8 byte a token. `save_token_ids` writes them
(`tokens.npz`: `input_ids` uint32, `seq_starts` int64, `loss_mask` uint8 and the target's identity), and
`restore_data` makes a data directory of them again with one fp32 forward a batch (seconds on a GPU), so data
generated in one session trains the head in the next, beside new data.

A restored directory's manifest records seed RESTORED_SEED: its shards were not drawn shard by shard from a seed, so
generation cannot resume into it (new data goes into a directory of its own; training reads several).
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
from safetensors import safe_open

from specserve.workers.errors import ModelLoadError
from specserve.workers.models.identity import target_identity
from specserve.workers.training.eagle_data import feature_layers, write_manifest, write_shard
from specserve.workers.training.eagle_manifest import (
    MANIFEST,
    DataManifest,
    GenerationSettings,
    ShardInfo,
    read_manifest,
    shard_name,
    shard_paths,
)
from specserve.workers.training.eagle_target import EagleTarget

log = logging.getLogger(__name__)

RESTORED_SEED = -1


def save_token_ids(data_dirs: list[Path], out: Path) -> int:
    """Every shard's token ids, sequence starts and answer masks of `data_dirs` (one target's) in one compressed file;
    returns the answer tokens saved."""
    manifests = [read_manifest(d) for d in data_dirs]
    identities = {m.target for m in manifests}
    if len(identities) != 1:
        raise ModelLoadError(f"{[str(d) for d in data_dirs]} hold data of {len(identities)} targets, not one")
    ids, starts, masks, offset = [], [np.zeros(1, np.int64)], [], 0
    for data_dir, manifest in zip(data_dirs, manifests, strict=True):
        for path in shard_paths(data_dir, manifest):
            with safe_open(str(path), "pt") as f:
                ids.append(f.get_tensor("input_ids").numpy().astype(np.uint32))
                starts.append(f.get_tensor("seq_starts").numpy()[1:] + offset)
                masks.append(f.get_tensor("loss_mask").numpy())
            offset += len(ids[-1])
    mask = np.concatenate(masks)
    np.savez_compressed(out, input_ids=np.concatenate(ids), seq_starts=np.concatenate(starts), loss_mask=mask,
                        target=np.array(identities.pop()))  # fmt: skip
    return int(mask.sum())


def restore_data(tokens: Path, target: EagleTarget, out: Path, shard_sequences: int, batch_tokens: int) -> DataManifest:
    """A data directory at `out` from the token ids in `tokens`, featured by `target` (whose identity the file must
    carry, where it carries one); resumes after the whole shards already there."""
    identity = target_identity(target.path)
    with np.load(tokens) as saved:
        if "target" in saved and str(saved["target"]) != identity:
            raise ModelLoadError(f"{tokens} holds token ids of target {str(saved['target'])[:16]}, not {target.path}")
        ids, starts, mask = saved["input_ids"].astype(np.int64), saved["seq_starts"], saved["loss_mask"]
    if len(starts) < 2 or int(starts[-1]) != len(ids) or len(mask) != len(ids) or ids.max() >= target.vocab_size:
        raise ModelLoadError(f"{tokens} is not a token-id file of this target (sequences, masks or ids do not fit)")
    out.mkdir(parents=True, exist_ok=True)
    layers = feature_layers(target.num_hidden_layers)
    manifest = DataManifest(identity, target.path, target.num_hidden_layers, target.hidden_size, target.vocab_size,
                            layers, RESTORED_SEED, GenerationSettings(shard_sequences=shard_sequences))  # fmt: skip
    if (out / MANIFEST).exists() and read_manifest(out).seed != RESTORED_SEED:
        raise ModelLoadError(f"{out} holds generated data: restore into a directory of its own")
    for index, first in enumerate(range(0, len(starts) - 1, shard_sequences)):
        bounds = starts[first : first + shard_sequences + 1]
        if not (out / shard_name(index)).exists():
            sequences = [ids[a:b].tolist() for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
            masks = [mask[a:b].tolist() for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
            write_shard(target, out, index, sequences, masks, layers, batch_tokens)
        with safe_open(str(out / shard_name(index)), "pt") as f:
            meta = f.metadata()
        manifest.shards.append(ShardInfo(shard_name(index), int(meta["sequences"]), int(meta["tokens"]),
                                         int(meta["answer_tokens"])))  # fmt: skip
        write_manifest(out, manifest)
    log.info("restored %d answer tokens in %d shards from %s into %s", manifest.answer_tokens, len(manifest.shards),
             tokens, out)  # fmt: skip
    return manifest
