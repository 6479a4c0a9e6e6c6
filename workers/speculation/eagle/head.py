"""EAGLE-3 draft heads in the community checkpoint layout (SpecForge exports it; vLLM and SGLang load it).

A head reads the target's residual stream entering three of its layers (default 2, N//2 and N-3 for N layers; in
Hugging Face terms `hidden_states[i]` with `output_hidden_states=True`), concatenated [3Ht]. `fc` projects that to H;
the one decoder layer (`midlayer`) attends over the concatenation [normed embedding of the next token, normed
feature] (2H inputs to q/k/v), adds the feature back as its residual, and `norm` + `lm_head` give logits over a
reduced draft vocabulary. `d2t` maps a draft id to its target id (target = draft + d2t[draft]); `t2d` marks the
target ids that have a draft id. The token embedding is the target's own (shared, frozen), never part of the head.

Alignment, as in SpecForge's training and vLLM's/SGLang's drafting: head entry t takes the target feature of position
t, the embedding of token t+1 and rotary position t, and predicts token t+2. Drafting chains: the next entry takes
the head's own output (before `norm`) in place of fc(feature), at the next position.

Module and parameter names are exactly the community ones (`fc.weight`, `midlayer.self_attn.q_proj.weight`, ...), so
`state_dict()` is the checkpoint. The math is split into pieces the trainer (all positions, training-time test) and
the drafter (cached, per request) share: `qkv`, an attention of their own, `finish`, `logits`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from specserve.workers.errors import InvalidRequestError
from specserve.workers.speculation.eagle.config import Eagle3Config

INIT_STD = 0.02  # LlamaConfig's initializer_range, which SpecForge's heads start from


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama's RMSNorm, computed in float32 (SmolLM2's residual stream reaches ~2.5e4)."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """positions [B, T] -> cos, sin [B, 1, T, head_dim] (Llama's half-split layout)."""
    freqs = positions.to(torch.float32)[..., None] * inv_freq  # [B, T, hd/2]
    emb = torch.cat((freqs, freqs), dim=-1)[:, None]  # [B, 1, T, hd]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, heads, T, hd]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class Eagle3Attention(nn.Module):
    def __init__(self, config: Eagle3Config):
        super().__init__()
        inputs = 2 * config.hidden_size  # [normed embedding, normed feature]
        self.q_proj = nn.Linear(inputs, config.num_attention_heads * config.head_dim, bias=False)
        self.k_proj = nn.Linear(inputs, config.num_key_value_heads * config.head_dim, bias=False)
        self.v_proj = nn.Linear(inputs, config.num_key_value_heads * config.head_dim, bias=False)
        self.o_proj = nn.Linear(config.num_attention_heads * config.head_dim, config.hidden_size, bias=False)


class Eagle3MLP(nn.Module):
    def __init__(self, config: Eagle3Config):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Eagle3Layer(nn.Module):
    def __init__(self, config: Eagle3Config):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Eagle3Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = Eagle3MLP(config)


class Eagle3Head(nn.Module):
    def __init__(self, config: Eagle3Config):
        super().__init__()
        self.config = config
        self.fc = nn.Linear(3 * config.target_hidden_size, config.hidden_size, bias=False)
        self.midlayer = Eagle3Layer(config)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.int64))
        self.register_buffer("t2d", torch.zeros(config.vocab_size, dtype=torch.bool))
        self._inv_freq: dict[torch.device, torch.Tensor] = {}  # float32 always, so not a buffer `.to()` would cast
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=INIT_STD)

    def set_vocab_maps(self, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
        self.d2t.copy_(d2t)
        self.t2d.copy_(t2d)

    def draft_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    def to_target_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """[..., draft_vocab_size] -> [..., vocab_size], -inf off the draft vocabulary (as vLLM's compute_logits), for
        sampling and verifying against the target's distribution."""
        out = logits.new_full((*logits.shape[:-1], self.config.vocab_size), float("-inf"))
        out[..., self.draft_to_target(torch.arange(logits.shape[-1], device=logits.device))] = logits
        return out

    def project(self, features: torch.Tensor) -> torch.Tensor:
        """Target features [..., 3Ht] -> the head's hidden input [..., H]."""
        return self.fc(features.to(self.fc.weight.dtype))

    def inv_freq(self, device: torch.device) -> torch.Tensor:
        if device not in self._inv_freq:
            hd = self.config.head_dim
            exponents = torch.arange(0, hd, 2, dtype=torch.float32, device=device) / hd
            self._inv_freq[device] = 1.0 / (self.config.rope_theta**exponents)
        return self._inv_freq[device]

    def qkv(self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """embeds [B, T, H] (target embeddings of the input tokens), hidden [B, T, H] (fc(feature) or the head's own
        previous output), positions [B, T] -> q [B, nh, T, hd] and k, v [B, nkv, T, hd] (q, k rotated), residual."""
        layer, cfg = self.midlayer, self.config
        normed = layer.hidden_norm(hidden)
        residual = normed if cfg.norm_before_residual else hidden
        x = torch.cat([layer.input_layernorm(embeds.to(normed.dtype)), normed], dim=-1)  # [B, T, 2H], embedding first
        batch, length, _ = x.shape
        attn = layer.self_attn
        q = attn.q_proj(x).view(batch, length, cfg.num_attention_heads, cfg.head_dim).transpose(1, 2)
        k = attn.k_proj(x).view(batch, length, cfg.num_key_value_heads, cfg.head_dim).transpose(1, 2)
        v = attn.v_proj(x).view(batch, length, cfg.num_key_value_heads, cfg.head_dim).transpose(1, 2)
        cos, sin = rope_cos_sin(positions, self.inv_freq(x.device), q.dtype)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v, residual

    def finish(self, attn: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """Attention output [B, nh, T, hd] -> the layer's output [B, T, H], before the final norm."""
        layer = self.midlayer
        batch, heads, length, hd = attn.shape
        hidden = residual + layer.self_attn.o_proj(attn.transpose(1, 2).reshape(batch, length, heads * hd))
        return hidden + layer.mlp(layer.post_attention_layernorm(hidden))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., H] -> logits over the draft vocabulary [..., draft_vocab_size]."""
        return self.lm_head(self.norm(hidden))


def ttt_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    step_kv: Sequence[tuple[torch.Tensor, torch.Tensor]],
) -> torch.Tensor:
    """Attention of training-time-test step j = len(step_kv) at every position t: over the first step's keys of
    positions <= t (causal) and over the keys of steps 1..j at position t itself (SpecForge's cache of TTT steps):
    exactly what entry t attends to when drafting j tokens ahead from position t.

    q [B, nh, T, hd]; keys, values [B, nkv, T, hd]; step_kv: per later step (k, v) [B, nkv, T, hd] -> [B, nh, T, hd]."""
    groups = q.shape[1] // keys.shape[1]
    length = keys.shape[2]
    scale = q.shape[-1] ** -0.5
    scores = (q @ keys.repeat_interleave(groups, 1).transpose(-1, -2)) * scale  # [B, nh, T, T]
    causal = torch.ones(length, length, dtype=torch.bool, device=q.device).tril()
    scores = scores.masked_fill(~causal, float("-inf"))
    if step_kv:
        diagonal = [(q * k.repeat_interleave(groups, 1)).sum(-1) * scale for k, _ in step_kv]  # j x [B, nh, T]
        scores = torch.cat([scores, torch.stack(diagonal, dim=-1)], dim=-1)  # [B, nh, T, T + j]
    weights = scores.float().softmax(-1).to(q.dtype)
    out = weights[..., :length] @ values.repeat_interleave(groups, 1)
    for i, (_, v) in enumerate(step_kv):
        out = out + weights[..., length + i, None] * v.repeat_interleave(groups, 1)
    return out


def ttt_forward(
    head: Eagle3Head, embed_weight: torch.Tensor, features: torch.Tensor, step_tokens: Sequence[torch.Tensor]
) -> list[torch.Tensor]:
    """The head unrolled over len(step_tokens) drafting steps at every position at once (no cache).

    features [B, T, 3Ht]: the target's features of positions 0..T-1 (right-padded rows are fine: padding comes after
    every real position, so causal attention never sees it). step_tokens[j] [B, T]: the token entry t takes at step
    j, i.e. the token at position t+1+j (data tokens when training, the target's greedy tokens when measuring
    acceptance). Step 0 uses fc(features); step j > 0 the head's own output of step j-1 at the same entry, at rotary
    position t+j. Returns per step the head's output [B, T, H] before its final norm (`head.logits` of it: logits)."""
    batch, length = step_tokens[0].shape
    positions = torch.arange(length, device=features.device).expand(batch, length)
    hidden = head.project(features)
    keys = values = None
    step_kv: list[tuple[torch.Tensor, torch.Tensor]] = []
    out = []
    for j, tokens in enumerate(step_tokens):
        q, k, v, residual = head.qkv(F.embedding(tokens, embed_weight), hidden, positions + j)
        if j == 0:
            keys, values = k, v
        else:
            step_kv.append((k, v))
        hidden = head.finish(ttt_attention(q, keys, values, step_kv), residual)
        out.append(hidden)
    return out


def vocab_maps(counts: torch.Tensor, draft_vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The `draft_vocab_size` most frequent target ids (ties and unseen ids: lowest id first), ascending.

    counts [V] -> d2t int64 [draft_vocab_size] (target id = draft id + d2t[draft id]), t2d bool [V]."""
    vocab = counts.shape[0]
    if not 0 < draft_vocab_size <= vocab:
        raise InvalidRequestError("draft_vocab_size", f"{draft_vocab_size} is not in 1..{vocab} (target vocabulary)")
    order = torch.argsort(counts.to(torch.float64), descending=True, stable=True)
    kept = order[:draft_vocab_size].sort().values.to(torch.int64)
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[kept] = True
    return kept - torch.arange(draft_vocab_size, dtype=torch.int64), t2d
