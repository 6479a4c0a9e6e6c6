"""The one place an EAGLE-3 head becomes an EagleDrafter: `load_eagle_drafter` for a loaded target (the in-process
engine: the head shares the target's embedding and packing), `load_head_drafter` for a draft worker, built without the
target model: the head plus the one tensor of the target it needs, the input embedding, read alone from the target's
safetensors (SmolLM2-135M's is 28 MB of its 270 MB). Both read the head with checkpoint.load_head; where a name finds
a head directory, and the layers a target worker captures for it, is config.py's (torch-free)."""

from __future__ import annotations

import copy
import logging
import os
from pathlib import Path

import torch
from safetensors import safe_open

from specserve.workers.errors import ModelLoadError
from specserve.workers.runtime.loading import LoadedModel, resolve_device, resolve_dtype
from specserve.workers.runtime.packed_linear import PackedLinear, pack_linears
from specserve.workers.speculation.eagle.checkpoint import load_head
from specserve.workers.speculation.eagle.config import default_feature_layers, read_json
from specserve.workers.speculation.eagle.drafter import EagleDrafter
from specserve.workers.speculation.eagle.graphs import ChainGraphs, ExtendGraphs, LevelGraphs
from specserve.workers.speculation.eagle.head import Eagle3Head

log = logging.getLogger(__name__)

EMBEDDING = "model.embed_tokens.weight"  # Llama-style targets, tied (SmolLM2) or not
_INDEX = "model.safetensors.index.json"


def _tensor_files(directory: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file that holds it (the index of a sharded checkpoint, else every file)."""
    if (directory / _INDEX).is_file():
        weight_map = read_json(directory / _INDEX).get("weight_map") or {}
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
    enforce_eager: bool = False,
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
    return _with_graphs(EagleDrafter(head, embed, layers, max_support), enforce_eager)


def load_eagle_drafter(
    target: LoadedModel, head: str | os.PathLike | Eagle3Head, max_support: int = 256
) -> EagleDrafter:
    """An EagleDrafter for `target` from a head directory (checked against the target: its identity when the head
    records one, hidden size, vocabulary, feature layers) or an Eagle3Head in memory (checked for shapes)."""
    config = target.model.config.get_text_config()
    hidden, num_layers, vocab = config.hidden_size, config.num_hidden_layers, target.vocab_size
    given = isinstance(head, Eagle3Head)
    if given:
        _check_fits(head, hidden, vocab, num_layers)
    else:
        head = load_head(head, target.path, hidden, vocab, target_num_layers=num_layers, dtype=target.dtype)
    head = head.to(device=target.device, dtype=target.dtype).eval()
    if isinstance(target.model.get_output_embeddings(), PackedLinear):  # the target runs packed: so does its head
        head = copy.deepcopy(head) if given else head  # the caller's head stays trainable
        pack_linears(head)
    layers = tuple(head.config.feature_layers or default_feature_layers(num_layers))
    embed = target.model.get_input_embeddings().weight
    log.info("EAGLE-3 head for %s: draft vocabulary %d, features of layers %s", target.path,
             head.config.draft_vocab_size, list(layers))  # fmt: skip
    return _with_graphs(EagleDrafter(head, embed, layers, max_support), target.enforce_eager)


def _with_graphs(drafter: EagleDrafter, enforce_eager: bool) -> EagleDrafter:
    """On CUDA (unless enforce_eager), the drafter's extension, tree levels and chain steps replay CUDA graphs
    (eagle/graphs.py)."""
    if drafter.device.type == "cuda" and not enforce_eager:
        head, embed = drafter.head, drafter.drafting.embed_weight
        drafter.drafting.level_graphs = LevelGraphs(head, embed, capture=True)
        drafter.drafting.extend_graphs = ExtendGraphs(head, embed, capture=True)
        drafter.drafting.chain_graphs = ChainGraphs(head, embed, capture=True)
    return drafter


def _check_fits(head: Eagle3Head, hidden: int, vocab: int, num_layers: int) -> None:
    cfg = head.config
    layers = cfg.feature_layers or default_feature_layers(num_layers)
    fits = (cfg.hidden_size, cfg.target_hidden_size, cfg.vocab_size) == (hidden, hidden, vocab)
    if not fits or max(layers) >= num_layers:
        raise ModelLoadError(
            f"the EAGLE-3 head (hidden {cfg.hidden_size}, target hidden {cfg.target_hidden_size}, vocabulary "
            f"{cfg.vocab_size}, feature layers {list(layers)}) does not fit this target (hidden {hidden}, vocabulary "
            f"{vocab}, {num_layers} layers)"
        )
