"""Training for the demo family: a byte-level BPE tokenizer, a target LM, and a draft distilled from the target.

Reproducible by construction: fixed seeds and fixed step counts (never time budgets), single-process.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator

import torch
from tokenizers import ByteLevelBPETokenizer
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

EOS = "<|endoftext|>"
PAD = "<|pad|>"


def train_tokenizer(texts: list[str], vocab_size: int) -> PreTrainedTokenizerFast:
    bpe = ByteLevelBPETokenizer(add_prefix_space=False)
    bpe.train_from_iterator(
        texts, vocab_size=vocab_size, min_frequency=2, special_tokens=[EOS, PAD], show_progress=False
    )
    return _fast(tokenizer_object=bpe._tokenizer)


def saved_tokenizer(tokenizer_json) -> PreTrainedTokenizerFast:
    """The tokenizer `train_tokenizer` made, from its saved tokenizer.json (saved again, the same files)."""
    return _fast(tokenizer_file=str(tokenizer_json))


def _fast(**source) -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast(**source, eos_token=EOS, pad_token=PAD, bos_token=EOS)


def encode_stream(tokenizer: PreTrainedTokenizerFast, texts: list[str]) -> torch.Tensor:
    """All texts as one token stream, each document followed by EOS: [N] int64."""
    eos = tokenizer.eos_token_id
    ids: list[int] = []
    for enc in tokenizer(texts, add_special_tokens=False)["input_ids"]:
        ids.extend(enc)
        ids.append(eos)
    return torch.tensor(ids, dtype=torch.long)


def llama_config(
    vocab_size: int, layers: int, hidden: int, max_positions: int, eos_id: int, pad_id: int
) -> LlamaConfig:
    heads = max(hidden // 64, 2)
    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=hidden * 8 // 3 // 32 * 32,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=max_positions,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        tie_word_embeddings=True,
        rope_theta=10000.0,
    )


def batches(stream: torch.Tensor, batch: int, seq: int, seed: int, device: torch.device | str = "cpu"):
    """Endless random windows of the stream: ([batch, seq] inputs, [batch, seq] next-token labels) on `device`.
    The windows are drawn on the CPU, so they are the same on every device."""
    g = torch.Generator().manual_seed(seed)
    while True:
        starts = torch.randint(0, len(stream) - seq - 1, (batch,), generator=g)
        window = torch.stack([stream[s : s + seq + 1] for s in starts.tolist()]).to(device)
        yield window[:, :-1], window[:, 1:]


def use_bf16(device: torch.device) -> bool:
    """bf16 autocast where it pays: CUDA GPUs with bf16 units. Not on CPUs: ~2x faster with AMX, but ~20x slower
    without bf16 units (measured on this project's AMD EPYC CI machines), and a recipe must not depend on which."""
    return device.type == "cuda" and torch.cuda.is_bf16_supported()


def warmup_cosine(opt: torch.optim.Optimizer, steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warmup over the first 5% of `steps`, then cosine decay to 10% of the peak rate."""
    warmup = max(1, steps // 20)
    return torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps)))
    )


def optimizer_step(model, opt: torch.optim.Optimizer, sched, loss: torch.Tensor) -> None:
    """One update: backward, gradient norm clipped to 1, AdamW step, schedule step."""
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    sched.step()


def distillation_loss(
    draft_logp: torch.Tensor, target_logp: torch.Tensor, keep: torch.Tensor, argmax_weight: float = 0.0
) -> torch.Tensor:
    """Mean over kept positions of KL(target || draft), plus `argmax_weight` x cross-entropy on the target's argmax.
    draft_logp, target_logp: [B, T, V] log-probabilities; keep: [B, T] bool. Returns a scalar."""
    per_position = (target_logp.exp() * (target_logp - draft_logp)).sum(-1)  # KL: [B, T]
    if argmax_weight:
        top = target_logp.argmax(-1, keepdim=True)  # [B, T, 1]
        per_position = per_position - argmax_weight * draft_logp.gather(-1, top)[..., 0]
    keep = keep.float()
    return (per_position * keep).sum() / keep.sum().clamp_min(1)


def train_lm(
    model: LlamaForCausalLM,
    stream: torch.Tensor,
    steps: int,
    batch: int,
    seq: int,
    lr: float,
    seed: int,
    teacher: LlamaForCausalLM | None = None,
    on_step: Callable[[int, float], None] | None = None,
    data: Iterator[tuple[torch.Tensor, ...]] | None = None,
    argmax_weight: float = 0.0,
) -> list[float]:
    """Train `model` (on its device) for exactly `steps` steps: next-token cross-entropy, or, with a teacher,
    KL(teacher || model) on the teacher's full next-token distributions (distillation makes the draft agree with the
    target, which is what acceptance measures). bf16 autocast on GPUs (`use_bf16`), fp32 elsewhere. AdamW with
    warmup and cosine decay. `data`: the ([B, T] inputs, [B, T] labels) batches (default: random corpus windows);
    positions labelled -100 are left out of the loss. A batch may carry a third item, the teacher's log-probs of its
    last M positions ([B, M, V], computed once for a fixed pool): then no teacher forward runs per step.
    `argmax_weight`: with a teacher (live or cached), adds that much cross-entropy on the teacher's argmax (what
    greedy acceptance counts). Returns the losses."""
    torch.manual_seed(seed)
    device = next(model.parameters()).device
    bf16 = use_bf16(device)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1,
                            fused=device.type == "cuda")  # fmt: skip
    sched = warmup_cosine(opt, steps)
    losses: list[float] = []
    data = data if data is not None else batches(stream, batch, seq, seed, device)
    for step in range(steps):
        inputs, labels, *cached = next(data)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            logits = model(input_ids=inputs).logits.float()  # [B, T, V]
            if cached:  # the teacher's log-probs of the last M positions, computed once: [B, M, V]
                target_logp = cached[0].to(device).float()
                m = target_logp.shape[1]
                loss = distillation_loss(torch.log_softmax(logits[:, -m:], -1), target_logp, labels[:, -m:] != -100,
                                         argmax_weight)  # fmt: skip
            elif teacher is None:
                loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
            else:
                with torch.no_grad():
                    target_logp = torch.log_softmax(teacher(input_ids=inputs).logits.float(), -1)  # [B, T, V]
                loss = distillation_loss(torch.log_softmax(logits, -1), target_logp, labels != -100, argmax_weight)
        optimizer_step(model, opt, sched, loss)
        losses.append(loss.item())
        if on_step is not None:
            on_step(step, losses[-1])
    model.eval()
    return losses
