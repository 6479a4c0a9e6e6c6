"""EAGLE-3 heads on disk, in the community layout: `config.json` + `model.safetensors` (what SpecForge exports and
vLLM / SGLang load).

The feature layers are written under both keys the servers read, in their own conventions: vLLM reads the top-level
`eagle_aux_hidden_state_layer_ids` as the layers whose *input* it captures (default 2, N//2, N-3); SGLang and
SpecForge read `eagle_config.eagle_aux_hidden_state_layer_ids` as layers whose *output* they capture (SGLang adds 1;
default 1, N//2-1, N-4). specserve's own key `specserve` records the target identity and the layers (input
convention). A head made for another target is refused; a head from elsewhere (no identity) is checked for shapes.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from specserve.workers.errors import InvalidRequestError, ModelLoadError
from specserve.workers.models.identity import target_identity
from specserve.workers.speculation.eagle.config import (
    ARCHITECTURE,
    CONFIG_FILE,
    SPECSERVE_KEY,
    Eagle3Config,
    config_from_json,
    default_feature_layers,
    parse_acceptance,
)
from specserve.workers.speculation.eagle.head import Eagle3Head

log = logging.getLogger(__name__)

WEIGHTS_FILE = "model.safetensors"
_IGNORED = {"embed_tokens.weight"}  # SpecForge trains with the target's embedding frozen: a shipped copy is the same
_DTYPES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}
_HEX64 = re.compile(r"[0-9a-f]{64}")


def config_to_json(config: Eagle3Config, dtype: torch.dtype) -> dict:
    layers = list(config.feature_layers) if config.feature_layers is not None else None
    data = {
        "architectures": [ARCHITECTURE],
        "model_type": "llama",
        "num_hidden_layers": 1,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope_theta,
        "rope_scaling": None,
        "max_position_embeddings": config.max_position_embeddings,
        "vocab_size": config.vocab_size,
        "draft_vocab_size": config.draft_vocab_size,
        "target_hidden_size": config.target_hidden_size,
        "tie_word_embeddings": False,  # SGLang would take lm_head from the (absent) embedding otherwise
        "attention_bias": False,
        "mlp_bias": False,
        "pretraining_tp": 1,
        "norm_before_residual": config.norm_before_residual,
        "torch_dtype": _DTYPES[dtype],
        SPECSERVE_KEY: {
            "format": 1,
            "target_identity": config.target_identity,
            "feature_layers": layers,
            "acceptance": list(config.acceptance) if config.acceptance else None,
        },  # fmt: skip
    }
    if layers is not None:
        data["eagle_aux_hidden_state_layer_ids"] = layers  # vLLM
        sglang = [i - 1 for i in layers]
        data["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": sglang, "use_aux_hidden_state": True}
    return data


def save_head(head: Eagle3Head, directory: str | os.PathLike, dtype: torch.dtype = torch.bfloat16) -> Path:
    """Write the head as config.json + model.safetensors (floats in `dtype`, d2t int64, t2d bool); returns the dir."""
    if dtype not in _DTYPES:
        raise InvalidRequestError("dtype", f"must be one of {list(_DTYPES.values())}, got {dtype}")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {
        name: (t.to(dtype) if t.is_floating_point() else t).detach().cpu().contiguous()
        for name, t in head.state_dict().items()
    }
    save_file(tensors, str(directory / (WEIGHTS_FILE + ".tmp")), metadata={"format": "pt"})
    os.replace(directory / (WEIGHTS_FILE + ".tmp"), directory / WEIGHTS_FILE)
    (directory / CONFIG_FILE).write_text(json.dumps(config_to_json(head.config, dtype), indent=2) + "\n")
    log.info("saved EAGLE-3 head (%s) to %s", _DTYPES[dtype], directory)
    return directory


def load_head(
    directory: str | os.PathLike,
    target: str | os.PathLike | None,
    target_hidden_size: int,
    vocab_size: int,
    *,
    target_num_layers: int | None = None,
    dtype: torch.dtype = torch.float32,
) -> Eagle3Head:
    """Load a head for the target at path `target` (or given by its identity sha256; None: check shapes only).
    A head that names no feature layers gets the default for `target_num_layers` layers, when given.

    Raises ModelLoadError naming the file when the head was made for another target (identity key), or when its
    shapes do not fit the target (hidden size, vocabulary, feature layers beyond `target_num_layers`)."""
    directory = Path(directory).expanduser()
    config_path, weights_path = directory / CONFIG_FILE, directory / WEIGHTS_FILE
    for path in (config_path, weights_path):
        if not path.is_file():
            raise ModelLoadError(f"EAGLE-3 head {str(directory)!r} has no {path.name}")
    try:
        data = json.loads(config_path.read_text())
    except (OSError, ValueError) as err:
        raise ModelLoadError(f"{config_path} is unreadable: {err}") from err
    config = config_from_json(data, config_path)
    _check_identity(config, target, config_path)
    _check_shapes(config, target_hidden_size, vocab_size, target_num_layers, config_path)
    if config.feature_layers is None and target_num_layers is not None:
        config = dataclasses.replace(config, feature_layers=default_feature_layers(target_num_layers))
    head = Eagle3Head(config)
    head.load_state_dict(_read_tensors(head, weights_path))
    return head.to(dtype).eval()


def _check_identity(config: Eagle3Config, target, config_path: Path) -> None:
    if target is None or config.target_identity is None:
        if config.target_identity is None:
            log.info("%s records no target identity (made elsewhere): checking shapes only", config_path)
        return
    text = str(target)
    wanted = text if _HEX64.fullmatch(text) and not Path(text).exists() else target_identity(text)
    if wanted != config.target_identity:
        raise ModelLoadError(
            f"{config_path} is a head for another target (identity {config.target_identity[:16]}..., "
            f"this target is {wanted[:16]}...): train a head for this target"
        )


def _check_shapes(config: Eagle3Config, hidden: int, vocab: int, num_layers: int | None, config_path: Path) -> None:
    problems = []
    if config.target_hidden_size != hidden:
        problems.append(f"target_hidden_size {config.target_hidden_size} != the target's hidden size {hidden}")
    if config.hidden_size != hidden:  # the target's embedding is shared, so the head works at its width
        problems.append(f"hidden_size {config.hidden_size} != the target's hidden size {hidden}")
    if config.vocab_size != vocab:
        problems.append(f"vocab_size {config.vocab_size} != the target's vocabulary {vocab}")
    if config.draft_vocab_size > config.vocab_size:
        problems.append(f"draft_vocab_size {config.draft_vocab_size} > vocab_size {config.vocab_size}")
    if num_layers is not None and config.feature_layers is not None and max(config.feature_layers) >= num_layers:
        problems.append(f"feature layers {list(config.feature_layers)} beyond the target's {num_layers} layers")
    if problems:
        raise ModelLoadError(f"{config_path} does not fit this target: " + "; ".join(problems))


def _read_tensors(head: Eagle3Head, weights_path: Path) -> dict[str, torch.Tensor]:
    """The file's tensors by the head's names, every shape checked; d2t/t2d derived when the file omits them."""
    expected = head.state_dict()
    try:
        with safe_open(str(weights_path), framework="pt") as f:
            found = {name: f.get_tensor(name) for name in f.keys() if name not in _IGNORED}
    except (OSError, ValueError, RuntimeError) as err:
        raise ModelLoadError(f"{weights_path} is not a readable safetensors file: {err}") from err
    unexpected = sorted(set(found) - set(expected))
    if unexpected:
        raise ModelLoadError(f"{weights_path} has tensors an EAGLE-3 head does not: {unexpected[:8]}")
    for name, tensor in found.items():
        if tuple(tensor.shape) != tuple(expected[name].shape):
            wanted = list(expected[name].shape)
            raise ModelLoadError(f"{weights_path}: {name} has shape {list(tensor.shape)}, the config implies {wanted}")
    if "d2t" in found:
        found["d2t"] = found["d2t"].to(torch.int64)
        targets = torch.arange(head.config.draft_vocab_size) + found["d2t"]
        if targets.min() < 0 or targets.max() >= head.config.vocab_size:
            raise ModelLoadError(f"{weights_path}: d2t maps draft ids outside the target vocabulary")
    _fill_vocab_maps(found, head.config, weights_path)
    missing = sorted(set(expected) - set(found))
    if missing:
        raise ModelLoadError(f"{weights_path} lacks tensors: {missing}")
    found["t2d"] = found["t2d"].to(torch.bool)
    return found


def _fill_vocab_maps(found: dict, config: Eagle3Config, weights_path: Path) -> None:
    if "d2t" not in found:
        if config.draft_vocab_size != config.vocab_size:
            raise ModelLoadError(f"{weights_path} lacks d2t but its draft vocabulary is reduced")
        found["d2t"] = torch.zeros(config.vocab_size, dtype=torch.int64)  # identity
    if "t2d" not in found:
        t2d = torch.zeros(config.vocab_size, dtype=torch.bool)
        t2d[torch.arange(found["d2t"].shape[0]) + found["d2t"].to(torch.int64)] = True
        found["t2d"] = t2d


def record_acceptance(head_dir: str | os.PathLike, acceptance: Sequence[float]) -> None:
    """Store measured acceptance per position (given the previous accepted) in the head's config.json, under
    specserve's own key: the k policy starts from it."""
    path = Path(head_dir) / "config.json"
    data = json.loads(path.read_text())
    ours = data.setdefault(SPECSERVE_KEY, {"format": 1})
    ours["acceptance"] = [round(float(a), 4) for a in acceptance]
    parse_acceptance(ours["acceptance"], path)
    path.write_text(json.dumps(data, indent=2) + "\n")
