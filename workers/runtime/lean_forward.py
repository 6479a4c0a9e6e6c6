"""A leaner forward pass for decoder-only models built the Llama way, as a transform applied to a loaded model.

At the demo's sizes a forward pass is mostly Python: a 1-layer draft spent 0.93 ms per token in transformers'
`model(...)`, of which the decoder layer was 0.40 ms and the wrappers around the layers (output capturing, mask
preparation that returns our 4D mask unchanged, output dataclasses) about 0.2 ms. Drafting pays that k times a round,
so it raises c = t_draft / t_target directly. `lean_forward(model)` calls the model's own modules (embedding, rotary
embedding, decoder layers, final norm, lm_head) in the order the model's forward does and skips the wrappers; the
logits are bit-identical, which a probe checks against `model(...)` before the lean path is used.

Only architectures whose forward is exactly that sequence are taken (`LEAN_MODEL_TYPES`); anything else, a model with
hooks on the modules the lean path skips, or one whose probe disagrees, keeps `model(...)`.

A capturing forward (for EAGLE-3 drafting) also returns the residual stream entering chosen layers at every input
position, concatenated: Hugging Face's `hidden_states[i]` with `output_hidden_states=True`. The lean one keeps
references to the inputs of those layers as it runs them; the full one asks the model for all hidden states.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from specserve.workers.errors import ModelLoadError
from specserve.workers.runtime.ragged import single_row_mask

# transformers classes whose `XForCausalLM.forward` is: embed_tokens -> rotary_emb -> decoder layers (given an
# already prepared 4D mask) -> norm -> lm_head on the kept positions.
LEAN_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3"})

# (input_ids [B, T], position_ids [B, T], attention_mask [B, 1, T, kv_len] or None, cache, logits_to_keep: the last
# n columns, or a 1D tensor of the columns, **attention's kwargs: ragged=RaggedPlan) -> [B, keep, V]
Forward = Callable[..., torch.Tensor]
# The same inputs -> (logits [B, keep, V], features [B, T, len(layers) * H]: the inputs of the capture layers)
CaptureForward = Callable[..., tuple[torch.Tensor, torch.Tensor | None]]

_PROBE_TOKENS = 6
_NO_MASK = torch.zeros((1, 1, 1, 1))  # a prepared 4D mask passes transformers' mask preparation unchanged


def full_forward(model) -> Forward:
    """The model's own forward, as a Forward."""

    def forward(input_ids, position_ids, attention_mask, cache, logits_to_keep, **extra):
        return _model_forward(model, input_ids, position_ids, attention_mask, cache, logits_to_keep, **extra).logits

    return forward


def _model_forward(model, input_ids, position_ids, attention_mask, cache, logits_to_keep, **extra):
    if attention_mask is None:  # a ragged pass: its plan masks; transformers' mask preparation must keep out
        attention_mask = _NO_MASK.to(model.dtype)
    return model(
        input_ids=input_ids,
        position_ids=position_ids,
        attention_mask=attention_mask,
        cache=cache,
        use_cache=cache is not None,
        logits_to_keep=logits_to_keep,
        **extra,
    )


def _lean(model) -> Forward:
    run = _lean_layers(model, ())

    def forward(input_ids, position_ids, attention_mask, cache, logits_to_keep, **extra):
        return run(input_ids, position_ids, attention_mask, cache, logits_to_keep, **extra)[0]

    return forward


def _lean_layers(model, capture: tuple[int, ...]) -> CaptureForward:
    """The lean pass, keeping the inputs of the `capture` layers (none: nothing kept, features None)."""
    base = model.model
    layers = list(base.layers[: base.config.num_hidden_layers])
    wanted = frozenset(capture)

    def forward(input_ids, position_ids, attention_mask, cache, logits_to_keep, **extra):
        hidden = base.embed_tokens(input_ids)  # [B, T, H]
        position_embeddings = base.rotary_emb(hidden, position_ids=position_ids)
        captured = {}
        for i, layer in enumerate(layers):
            if i in wanted:
                captured[i] = hidden
            hidden = layer(
                hidden,
                attention_mask=attention_mask,
                position_ids=position_ids,
                cache=cache,
                use_cache=cache is not None,
                position_embeddings=position_embeddings,
                **extra,
            )
        hidden = base.norm(hidden)
        kept = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        logits = model.lm_head(hidden[:, kept])  # [B, keep, V]
        return logits, (torch.cat([captured[i] for i in capture], dim=-1) if capture else None)

    return forward


def capture_forward(model, layers: tuple[int, ...], lean: bool) -> CaptureForward:
    """A forward that also returns the residual stream entering `layers`, concatenated [B, T, len(layers) * H]: the
    lean pass when `lean` (the caller's `lean_forward(model)` took it), else the model's own forward."""
    num_layers = model.config.get_text_config().num_hidden_layers
    if not layers or not all(0 <= i < num_layers for i in layers):
        wanted = f"ids of the model's {num_layers} layers (0..{num_layers - 1})"
        raise ModelLoadError(f"capture layers {list(layers)} must be {wanted}")
    if lean:
        return _lean_layers(model, tuple(layers))

    def forward(input_ids, position_ids, attention_mask, cache, logits_to_keep, **extra):
        out = _model_forward(
            model, input_ids, position_ids, attention_mask, cache, logits_to_keep, output_hidden_states=True, **extra
        )
        return out.logits, torch.cat([out.hidden_states[i] for i in layers], dim=-1)

    return forward


def _has_lean_shape(model) -> bool:
    base = getattr(model, "model", None)
    return (
        getattr(model.config, "model_type", None) in LEAN_MODEL_TYPES
        and all(hasattr(base, name) for name in ("embed_tokens", "rotary_emb", "layers", "norm"))
        and hasattr(model, "lm_head")
        # Hooks on the modules the lean path skips would silently stop running.
        and not any(m._forward_hooks or m._forward_pre_hooks for m in (model, base))
    )


@torch.inference_mode()
def _agrees(model, lean: Forward) -> bool:
    """Both paths on a short causal probe (no cache): bit-identical logits."""
    device = next(model.parameters()).device
    vocab = model.get_output_embeddings().weight.shape[0]
    ids = (torch.arange(_PROBE_TOKENS, device=device) * 7919 % vocab).unsqueeze(0)  # [1, T]
    positions = torch.arange(_PROBE_TOKENS, device=device).unsqueeze(0)  # [1, T]
    mask = single_row_mask(0, _PROBE_TOKENS, model.dtype, device)  # [1, 1, T, T]
    full = full_forward(model)(ids, positions, mask, None, _PROBE_TOKENS)
    return torch.equal(lean(ids, positions, mask, None, _PROBE_TOKENS), full)


def lean_forward(model) -> Forward | None:
    """The lean path for `model`, or None where it does not apply (other architectures) or would not give the same
    logits as `model(...)`."""
    if not _has_lean_shape(model):
        return None
    lean = _lean(model)
    return lean if _agrees(model, lean) else None
