"""Attention on CPU workers: PyTorch's SDPA with grouped-query attention inside the kernel (`enable_gqa`), in place of
transformers' `repeat_kv`, which copies every layer's cached keys and values for each forward that verifies more
than one position (at 8K cached positions 40% of a SmolLM2 verify on a CPU went to those copies; the kernel reads the
shared kv heads where repeat_kv copied them: 4x faster attention, the same values). Not on CUDA, where SDPA with a
mask and GQA falls back to its math kernel (transformers keeps repeat_kv there for that reason)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, PreTrainedModel

NAME = "specserve_sdpa_gqa"


def sdpa_gqa(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
             attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
             is_causal: bool | None = None, **kwargs) -> tuple[torch.Tensor, None]:  # fmt: skip
    """query [B, H, Q, D], key/value [B, H_kv, K, D], attention_mask [B, 1, Q, >=K] additive or None -> ([B, Q, H, D],
    None), as transformers' sdpa_attention_forward returns it."""
    q_length = query.shape[2]
    causal = q_length > 1 and attention_mask is None and (is_causal if is_causal is not None else module.is_causal)
    if causal and key.shape[2] > q_length:  # a first prefill into a longer cache: what follows is masked anyway
        key, value = key[:, :, :q_length], value[:, :, :q_length]
    if attention_mask is not None:
        attention_mask = attention_mask[:, :, :, : key.shape[2]]
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling,
                                         is_causal=causal, enable_gqa=key.shape[1] != query.shape[1])  # fmt: skip
    return out.transpose(1, 2).contiguous(), None


def use_gqa_attention(model: PreTrainedModel) -> bool:
    """Switch a CPU model's SDPA attention to `sdpa_gqa`; whether it was switched (other attention implementations,
    and models on other devices, are left as they are)."""
    if model.device.type != "cpu" or model.config._attn_implementation != "sdpa":
        return False
    AttentionInterface.register(NAME, sdpa_gqa)
    model.set_attn_implementation(NAME)
    return True
