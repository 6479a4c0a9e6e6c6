"""EAGLE-3 heads in the disaggregated path: where a `draft` name becomes a head directory, the feature layers a target
worker captures for a head, and a draft worker's EagleDrafter, built without the target model: the head plus the
one tensor of the target it needs, the input embedding, read alone from the target's safetensors (SmolLM2-135M's is
28 MB of its 270 MB)."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import torch
from safetensors import safe_open

from specserve.workers.errors import ModelLoadError
from specserve.workers.models.packaged_heads import PACKAGED, resolve_head
from specserve.workers.runtime.loading import resolve_device, resolve_dtype
from specserve.workers.runtime.packed_linear import pack_linears
from specserve.workers.speculation.eagle3 import ARCHITECTURE, default_feature_layers
from specserve.workers.speculation.eagle3_io import CONFIG_FILE, config_from_json, load_head
from specserve.workers.speculation.eagle_drafter import EagleDrafter

log = logging.getLogger(__name__)

EMBEDDING = "model.embed_tokens.weight"  # Llama-style targets, tied (SmolLM2) or not
_INDEX = "model.safetensors.index.json"


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise ModelLoadError(f"{path} is unreadable: {err}") from err


def resolve_eagle_head(name: str | os.PathLike | None, target: str | os.PathLike | None = None) -> str | None:
    """The EAGLE-3 head directory a model's `draft` names, or None when it names none (a draft model, 'ngram',
    'none'): the word 'eagle', the head packaged for the model at `target` (ModelLoadError when none is), or a
    directory whose config.json has architectures ["LlamaForCausalLMEagle3"]. The one place a name becomes a head
    directory."""
    if not name:
        return None
    if str(name) == PACKAGED:
        if target is None:
            raise ModelLoadError("'eagle' names the EAGLE-3 head packaged for a target: resolve it with the target")
        return str(resolve_head(name, target))
    directory = Path(name).expanduser()
    config = directory / CONFIG_FILE
    if not config.is_file():
        return None
    return str(directory) if ARCHITECTURE in (_read_json(config).get("architectures") or []) else None


def head_acceptance(head_dir: str | os.PathLike) -> tuple[float, ...] | None:
    """The head's measured acceptance by position (`specserve draft eval --record`), the k policy's prior; None when
    it has none."""
    path = Path(head_dir).expanduser() / CONFIG_FILE
    return config_from_json(_read_json(path), path).acceptance


def head_feature_layers(head_dir: str | os.PathLike, target_num_layers: int) -> tuple[int, ...]:
    """The target layers whose inputs the head reads (its config's, else the default for the target's depth)."""
    path = Path(head_dir).expanduser() / CONFIG_FILE
    layers = config_from_json(_read_json(path), path).feature_layers or default_feature_layers(target_num_layers)
    if max(layers) >= target_num_layers:
        raise ModelLoadError(f"{path}: feature layers {list(layers)} beyond the target's {target_num_layers} layers")
    return tuple(layers)


def _tensor_files(directory: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file that holds it (the index of a sharded checkpoint, else every file)."""
    if (directory / _INDEX).is_file():
        weight_map = _read_json(directory / _INDEX).get("weight_map") or {}
        return {name: directory / file for name, file in weight_map.items()}
    names = {}
    for file in sorted(directory.glob("*.safetensors")):
        try:
            with safe_open(str(file), framework="pt") as f:
                names.update(dict.fromkeys(f.keys(), file))
        except (OSError, ValueError, RuntimeError) as err:
            raise ModelLoadError(f"{file} is not a readable safetensors file: {err}") from err
    return names


def load_target_embedding(target_path: str | os.PathLike, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The target's input embedding [V, H], alone: `model.embed_tokens.weight`, or the one tensor whose name ends in
    `embed_tokens.weight`, read from its safetensors file."""
    directory = Path(target_path).expanduser()
    files = _tensor_files(directory)
    found = [EMBEDDING] if EMBEDDING in files else sorted(n for n in files if n.endswith("embed_tokens.weight"))
    if len(found) != 1:
        raise ModelLoadError(
            f"{directory}: no single input embedding among its safetensors tensors (found {found or 'none'}); an "
            "EAGLE-3 draft worker reads the target's `embed_tokens.weight`"
        )
    try:
        with safe_open(str(files[found[0]]), framework="pt") as f:
            return f.get_tensor(found[0]).to(device=device, dtype=dtype)
    except (OSError, ValueError, RuntimeError) as err:
        raise ModelLoadError(f"{files[found[0]]}: cannot read {found[0]}: {err}") from err


def load_head_drafter(
    head_dir: str | os.PathLike,
    target_path: str | os.PathLike,
    dtype: str = "float32",
    device: str = "auto",
    max_support: int = 256,
    packed_linears: bool = True,
) -> EagleDrafter:
    """An EagleDrafter for the target at `target_path` without loading the target: its config for the checks
    (identity, hidden size, vocabulary, layers) and its embedding for the drafting. dtype/device as ModelConfig's."""
    from transformers import AutoConfig  # the config only: no model class is imported or built

    try:
        config = AutoConfig.from_pretrained(str(target_path), local_files_only=True).get_text_config()
    except Exception as e:  # noqa: BLE001 - transformers raises many kinds; all mean "not a model dir"
        raise ModelLoadError(f"{str(target_path)!r} is not a Hugging Face model directory: {e}") from None
    where = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, where)
    hidden, num_layers, vocab = config.hidden_size, config.num_hidden_layers, config.vocab_size
    head = load_head(head_dir, target_path, hidden, vocab, target_num_layers=num_layers, dtype=torch_dtype)
    embed = load_target_embedding(target_path, torch_dtype, where)
    if tuple(embed.shape) != (vocab, hidden):
        raise ModelLoadError(f"{target_path}: input embedding {list(embed.shape)}, its config says {[vocab, hidden]}")
    layers = tuple(head.config.feature_layers or default_feature_layers(num_layers))
    log.info("EAGLE-3 head %s for %s on %s: draft vocabulary %d, features of layers %s", head_dir, target_path, where,
             head.config.draft_vocab_size, list(layers))  # fmt: skip
    head = head.to(where).eval()
    if packed_linears:
        pack_linears(head)  # float32 on a CPU only
    return EagleDrafter(head, embed, layers, max_support)
