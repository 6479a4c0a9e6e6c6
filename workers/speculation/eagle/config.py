"""An EAGLE-3 head's config (torch-free): its `config.json` in the community layout read into an Eagle3Config, and
where a model's `draft` name finds a head directory. The scheduler and the edges read heads through this module
alone, so they never import torch."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from specserve.workers.errors import ModelLoadError
from specserve.workers.models.packaged_heads import PACKAGED, resolve_head

ARCHITECTURE = "LlamaForCausalLMEagle3"
CONFIG_FILE = "config.json"
SPECSERVE_KEY = "specserve"


def default_feature_layers(num_layers: int) -> tuple[int, int, int]:
    """The target layers whose inputs an EAGLE-3 head reads, as vLLM, SGLang and SpecForge default them."""
    return (2, num_layers // 2, num_layers - 3)


@dataclass(frozen=True)
class Eagle3Config:
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int  # the target's
    draft_vocab_size: int
    target_hidden_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048
    # Target layers whose *inputs* the head reads (hidden_states[i]); None: the default for the target's depth.
    feature_layers: tuple[int, ...] | None = None
    target_identity: str | None = None  # workers/models/identity.py's sha256 of the target it was trained for
    norm_before_residual: bool = False  # a vLLM option: the residual is the normed feature
    # Acceptance at each chain position given the previous one accepted, measured on held-out chat (`specserve draft
    # eval` records it): the k policy's prior for this head. None: unmeasured.
    acceptance: tuple[float, ...] | None = None

    @classmethod
    def for_target(cls, target_config, draft_vocab_size: int, target_identity: str | None = None) -> Eagle3Config:
        """A head shaped like the target's own layers (a Hugging Face Llama-style config)."""
        rope = dict(getattr(target_config, "rope_parameters", None) or {})
        if rope.get("rope_type", "default") != "default":
            raise ModelLoadError(f"EAGLE-3 heads here support plain RoPE only, the target has {rope!r}")
        heads = target_config.num_attention_heads
        hidden = target_config.hidden_size
        return cls(
            hidden_size=hidden,
            intermediate_size=target_config.intermediate_size,
            num_attention_heads=heads,
            num_key_value_heads=getattr(target_config, "num_key_value_heads", None) or heads,
            head_dim=getattr(target_config, "head_dim", None) or hidden // heads,
            vocab_size=target_config.vocab_size,
            draft_vocab_size=draft_vocab_size,
            target_hidden_size=hidden,
            rms_norm_eps=target_config.rms_norm_eps,
            rope_theta=float(rope.get("rope_theta", getattr(target_config, "rope_theta", 10000.0))),
            max_position_embeddings=target_config.max_position_embeddings,
            feature_layers=default_feature_layers(target_config.num_hidden_layers),
            target_identity=target_identity,
        )


def config_from_json(data: dict, source: Path) -> Eagle3Config:
    """The head's config from a community config.json; errors name `source`."""
    if ARCHITECTURE not in (data.get("architectures") or []):
        raise ModelLoadError(
            f"{source}: architectures {data.get('architectures')!r} is not [{ARCHITECTURE!r}]; only EAGLE-3 heads are "
            "supported (EAGLE-1/2 heads, with `layers.0.*` and no lm_head, are not)"
        )
    if data.get("num_hidden_layers", 1) != 1 or data.get("hidden_act", "silu") != "silu":
        raise ModelLoadError(f"{source}: only one-layer SiLU heads are supported (num_hidden_layers, hidden_act)")
    scaling = data.get("rope_scaling") or {}
    if (scaling.get("rope_type") or scaling.get("type") or "default") != "default":
        raise ModelLoadError(f"{source}: rope_scaling {scaling!r} is not supported (plain RoPE only)")
    for key in ("hidden_size", "intermediate_size", "num_attention_heads", "vocab_size"):
        if not isinstance(data.get(key), int):
            raise ModelLoadError(f"{source}: missing or non-integer {key!r}")
    ours = data.get(SPECSERVE_KEY) or {}
    hidden, heads = data["hidden_size"], data["num_attention_heads"]
    rope = data.get("rope_parameters") or {}
    return Eagle3Config(
        hidden_size=hidden,
        intermediate_size=data["intermediate_size"],
        num_attention_heads=heads,
        num_key_value_heads=data.get("num_key_value_heads") or heads,
        head_dim=data.get("head_dim") or hidden // heads,
        vocab_size=data["vocab_size"],
        draft_vocab_size=data.get("draft_vocab_size") or data["vocab_size"],
        target_hidden_size=data.get("target_hidden_size") or hidden,
        rms_norm_eps=float(data.get("rms_norm_eps", 1e-6)),
        rope_theta=float(data.get("rope_theta") or rope.get("rope_theta") or 10000.0),
        max_position_embeddings=data.get("max_position_embeddings", 2048),
        feature_layers=_feature_layers(data, source),
        target_identity=ours.get("target_identity"),
        acceptance=parse_acceptance(ours.get("acceptance"), source),
        norm_before_residual=bool(data.get("norm_before_residual", False)),
    )


def parse_acceptance(value, source: Path) -> tuple[float, ...] | None:
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(a, int | float) and 0.0 <= a <= 1.0 for a in value):
        raise ModelLoadError(f"{source}: specserve.acceptance must be a list of rates in [0, 1], got {value!r}")
    return tuple(float(a) for a in value) or None


def _feature_layers(data: dict, source: Path) -> tuple[int, ...] | None:
    """The layers whose inputs the head reads (vLLM's convention), from whichever keys the file has; they must agree."""
    found = {}
    if (ours := (data.get(SPECSERVE_KEY) or {}).get("feature_layers")) is not None:
        found["specserve.feature_layers"] = tuple(ours)
    if (top := data.get("eagle_aux_hidden_state_layer_ids")) is not None:
        found["eagle_aux_hidden_state_layer_ids"] = tuple(top)
    if (nested := (data.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")) is not None:
        found["eagle_config.eagle_aux_hidden_state_layer_ids (+1)"] = tuple(i + 1 for i in nested)
    if len(set(found.values())) > 1:
        raise ModelLoadError(f"{source}: the feature layer keys disagree: {found}")
    layers = next(iter(found.values()), None)
    if layers is not None and (len(layers) != 3 or not all(isinstance(i, int) and i >= 0 for i in layers)):
        raise ModelLoadError(f"{source}: feature layers {list(layers)} must be three layer ids >= 0")
    return layers


def read_json(path: Path) -> dict:
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
    return str(directory) if ARCHITECTURE in (read_json(config).get("architectures") or []) else None


def head_acceptance(head_dir: str | os.PathLike) -> tuple[float, ...] | None:
    """The head's measured acceptance by position (`specserve draft eval --record`), the k policy's prior; None when
    it has none."""
    path = Path(head_dir).expanduser() / CONFIG_FILE
    return config_from_json(read_json(path), path).acceptance


def head_feature_layers(head_dir: str | os.PathLike, target_num_layers: int) -> tuple[int, ...]:
    """The target layers whose inputs the head reads (its config's, else the default for the target's depth)."""
    path = Path(head_dir).expanduser() / CONFIG_FILE
    layers = config_from_json(read_json(path), path).feature_layers or default_feature_layers(target_num_layers)
    if max(layers) >= target_num_layers:
        raise ModelLoadError(f"{path}: feature layers {list(layers)} beyond the target's {target_num_layers} layers")
    return tuple(layers)
