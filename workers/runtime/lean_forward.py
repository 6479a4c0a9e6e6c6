"""A leaner forward pass for decoder-only models built the Llama way, as a transform applied to a loaded model.

At the demo's sizes a forward pass is mostly Python: a 1-layer draft spent 0.93 ms per token in transformers'
`model(...)`, of which the decoder layer was 0.40 ms and the wrappers around the layers (output capturing, mask
preparation that returns our 4D mask unchanged, output dataclasses) about 0.2 ms. Drafting pays that k times a round,
so it raises c = t_draft / t_target directly. `lean_forward(model)` calls the model's own modules (embedding, rotary
embedding, decoder layers, final norm, lm_head) in the order the model's forward does and skips the wrappers; the
logits are bit-identical, which a probe checks against `model(...)` before the lean path is used.

Only architectures whose forward is exactly that sequence are taken (`LEAN_MODEL_TYPES`); anything else, a model with
hooks on the modules the lean path skips, or one whose probe disagrees, keeps `model(...)`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from specserve.workers.runtime.slot_cache import single_row_mask

# transformers classes whose `XForCausalLM.forward` is: embed_tokens -> rotary_emb -> decoder layers (given an
# already prepared 4D mask) -> norm -> lm_head on the kept positions.
LEAN_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3"})

# (input_ids [B, T], position_ids [B, T], attention_mask [B, 1, T, kv_len], cache, logits_to_keep) -> [B, keep, V]
Forward = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, object, int], torch.Tensor]

_PROBE_TOKENS = 6


def full_forward(model) -> Forward:
    """The model's own forward, as a Forward."""

    def forward(input_ids, position_ids, attention_mask, cache, logits_to_keep):
        return model(
            input_ids=input_ids,
            position_ids=position_ids,
            attention_mask=attention_mask,
            cache=cache,
            use_cache=cache is not None,
            logits_to_keep=logits_to_keep,
        ).logits

    return forward


def _lean(model) -> Forward:
    base = model.model
    layers = list(base.layers[: base.config.num_hidden_layers])

    def forward(input_ids, position_ids, attention_mask, cache, logits_to_keep):
        hidden = base.embed_tokens(input_ids)  # [B, T, H]
        position_embeddings = base.rotary_emb(hidden, position_ids=position_ids)
        for layer in layers:
            hidden = layer(
                hidden,
                attention_mask=attention_mask,
                position_ids=position_ids,
                cache=cache,
                use_cache=cache is not None,
                position_embeddings=position_embeddings,
            )
        hidden = base.norm(hidden)
        return model.lm_head(hidden[:, -logits_to_keep:])  # [B, keep, V]

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
