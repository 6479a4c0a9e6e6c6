"""Sequence-level unlikelihood training (Welleck et al., 2020, "Neural Text Generation with Unlikelihood Training"):
the demo target's cure for greedy loops.

A briefly trained small LM continues a prompt greedily into loops ("LETTER LETTER LETTER ..."), and loops are easy to
draft, which inflates speculative acceptance. Here the model continues corpus prefixes greedily; every continuation
token that lies inside an n-gram already seen earlier in the sequence is pushed down with -log(1 - p(token)), while
next-token cross-entropy on corpus windows keeps it modelling the code. Pure functions first, then the training loop.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from transformers import LlamaForCausalLM

from specserve.workers.training.demo_train import batches, optimizer_step, warmup_cosine

PREFIX = 64  # corpus tokens each continuation starts from
CONTINUATION = 96  # greedy tokens generated per prefix
NGRAM = 4  # the repetition unit penalised (the demo's criterion counts distinct 4-grams)


def repeated_ngram_mask(tokens: torch.Tensor, start: int, n: int = NGRAM) -> torch.Tensor:
    """[B, L] int64 tokens -> [B, L] bool: positions >= `start` inside an n-gram that already occurred earlier (at a
    smaller start index, overlaps included, so short-period loops count) in the same row."""
    rows = []
    for row in tokens.tolist():
        seen: set[tuple[int, ...]] = set()
        mask = [False] * len(row)
        for s in range(len(row) - n + 1):
            gram = tuple(row[s : s + n])
            if gram in seen:
                for j in range(max(s, start), s + n):
                    mask[j] = True
            seen.add(gram)
        rows.append(mask)
    return torch.tensor(rows, dtype=torch.bool, device=tokens.device)


def unlikelihood_loss(logits: torch.Tensor, tokens: torch.Tensor, mask: torch.Tensor, start: int) -> torch.Tensor:
    """Mean over continuation positions of -log(1 - p(token)) where `mask` marks a repeated token, 0 elsewhere.
    logits: [B, L-1, V] for predicting tokens[:, 1:]; tokens: [B, L]; mask: [B, L] bool. Returns a scalar."""
    p = torch.softmax(logits.float(), -1).gather(-1, tokens[:, 1:, None])[..., 0]  # [B, L-1]
    penalty = -(1 - p).clamp_min(1e-5).log() * mask[:, 1:].float()  # [B, L-1]
    return penalty.sum() / (tokens.shape[0] * (tokens.shape[1] - start))


def corpus_prefixes(
    stream: torch.Tensor, batch: int, length: int, g: torch.Generator, device: torch.device | str
) -> torch.Tensor:
    """[batch, length] random windows of the corpus stream, drawn on the CPU with `g` (the same on every device)."""
    starts = torch.randint(0, len(stream) - length - 1, (batch,), generator=g)
    return torch.stack([stream[s : s + length] for s in starts.tolist()]).to(device)


@torch.no_grad()
def greedy_continuations(model: LlamaForCausalLM, prefixes: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """[B, P] prefixes -> [B, P + new_tokens]: the model's greedy continuations (EOS does not stop them)."""
    was_training = model.training
    model.eval()
    out = model.generate(
        prefixes, attention_mask=torch.ones_like(prefixes), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
        do_sample=False, pad_token_id=model.config.pad_token_id,
    )  # fmt: skip
    model.train(was_training)
    return out


def unlikelihood_finetune(
    model: LlamaForCausalLM,
    stream: torch.Tensor,
    steps: int,
    batch: int,
    seq: int,
    lr: float,
    seed: int,
    on_step: Callable[[int, float], None] | None = None,
    prefix: int = PREFIX,
    continuation: int = CONTINUATION,
) -> list[float]:
    """Fine-tune `model` (on its device, fp32) for exactly `steps` steps of unlikelihood on its own greedy
    continuations of `batch` corpus prefixes plus cross-entropy on `batch // 2` corpus windows of `seq` tokens.
    AdamW, linear warmup, cosine decay to 10%. Returns the unlikelihood losses."""
    torch.manual_seed(seed)
    device = next(model.parameters()).device
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    sched = warmup_cosine(opt, steps)
    g = torch.Generator().manual_seed(seed)
    corpus = batches(stream, max(1, batch // 2), seq, seed + 1, device)
    losses: list[float] = []
    for step in range(steps):
        tokens = greedy_continuations(model, corpus_prefixes(stream, batch, prefix, g, device), continuation)
        # tokens: [B, prefix + continuation]
        mask = repeated_ngram_mask(tokens, prefix)
        model.train()
        ul = unlikelihood_loss(model(input_ids=tokens[:, :-1]).logits, tokens, mask, prefix)
        inputs, labels = next(corpus)
        logits = model(input_ids=inputs).logits.float()  # [B/2, seq, V]
        mle = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
        loss = mle + ul
        optimizer_step(model, opt, sched, loss)
        losses.append(ul.item())
        if on_step is not None:
            on_step(step, losses[-1])
    model.eval()
    return losses
