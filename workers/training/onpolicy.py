"""On-policy draft distillation: the draft learns to predict the text the target actually emits.

Greedy speculative decoding accepts a drafted token when it equals the target's argmax after the committed prefix,
and the committed prefix is always the target's own greedy text. So the draft is trained where it is used: on a pool
of the target's greedy continuations of corpus prefixes, against the target's logits there. The loss is
KL(target || draft), which keeps the two distributions close for rejection sampling, plus cross-entropy on the
target's argmax, which is what greedy acceptance counts (a small draft cannot match a whole distribution; spending its
capacity on the top token raised per-position greedy agreement with the demo target from 0.64 to 0.71-0.73). Weigh it
lightly (0.3 in the demo recipe): at 1.0 the draft grew sharper than the flat demo target and its sampled acceptance
fell (overlap with the target's distribution 0.61 -> 0.44).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from transformers import LlamaForCausalLM

from specserve.workers.training.unlikelihood import PREFIX, corpus_prefixes, greedy_continuations

POOL_CONTINUATION = 128  # greedy tokens per pooled prefix: as long as the benchmark's generations
POOL_BATCH = 64  # prefixes continued per generate call (1.8x the tokens/s of 16 rows on 2 CPU cores)


def continuation_pool(
    stream: torch.Tensor,
    teacher: LlamaForCausalLM,
    size: int,
    seed: int,
    device: torch.device | str = "cpu",
    on_batch: Callable[[int], None] | None = None,
) -> torch.Tensor:
    """[size, PREFIX + POOL_CONTINUATION]: `teacher`'s greedy continuations of corpus prefixes drawn on the CPU with
    `seed` (the same on every device). `on_batch(rows)` reports progress."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for done in range(0, size, POOL_BATCH):
        n = min(POOL_BATCH, size - done)
        rows.append(greedy_continuations(teacher, corpus_prefixes(stream, n, PREFIX, g, device), POOL_CONTINUATION))
        if on_batch is not None:
            on_batch(n)
    return torch.cat(rows)


@torch.no_grad()
def teacher_logprobs(
    teacher: LlamaForCausalLM,
    pool: torch.Tensor,
    on_batch: Callable[[int], None] | None = None,
    file: Path | None = None,
) -> torch.Tensor:
    """[N, POOL_CONTINUATION, V] float16 on the CPU: `teacher`'s log-probs at every continuation position of the
    pool's rows ([N, PREFIX + POOL_CONTINUATION]), computed once so the draft's many passes over the pool need no
    teacher forward per step (the 24-layer teacher's forward was most of each step). Written in place, into `file`
    when given (memory-mapped: the demo's 16384 rows of a 4096-token vocabulary are 17 GB, more than a laptop's RAM;
    the page cache keeps what fits), else into RAM."""
    device = next(teacher.parameters()).device
    shape = (len(pool), pool.shape[1] - PREFIX, teacher.config.vocab_size)
    if file is None:
        out = torch.empty(shape, dtype=torch.float16)
    else:
        out = torch.from_file(str(file), shared=True, size=math.prod(shape), dtype=torch.float16).view(shape)
    for start in range(0, len(pool), POOL_BATCH):
        seq = pool[start : start + POOL_BATCH].to(device)
        logits = teacher(input_ids=seq[:, :-1]).logits[:, PREFIX - 1 :].float()  # [b, POOL_CONTINUATION, V]
        out[start : start + len(seq)] = torch.log_softmax(logits, -1).half().cpu()
        if on_batch is not None:
            on_batch(len(seq))
    return out


def pool_batches(
    pool: torch.Tensor, batch: int, seed: int, logprobs: torch.Tensor | None = None
) -> Iterator[tuple[torch.Tensor, ...]]:
    """Endless ([batch, L-1] inputs, [batch, L-1] labels) of random pool rows, on the pool's device. Labels of the
    prefix's positions are -100 (left out of the loss: that text is the corpus's, not the target's); the rest are
    the continuation. With `logprobs` (`teacher_logprobs` of the pool), each batch also carries its rows' teacher
    log-probs, [batch, POOL_CONTINUATION, V]."""
    g = torch.Generator().manual_seed(seed)
    while True:
        idx = torch.randint(0, len(pool), (batch,), generator=g)
        seq = pool[idx.to(pool.device)]  # [batch, L]
        labels = seq[:, 1:].clone()
        labels[:, : PREFIX - 1] = -100
        yield (seq[:, :-1], labels) if logprobs is None else (seq[:, :-1], labels, logprobs[idx])
