"""Timing a model's forward passes where it runs: the seconds of a cached forward over w new positions, per width.

On a CPU a forward's cost is far from linear in its width (SmolLM2-135M on 2 cores: 2-3 new positions cost more than
5), so whoever picks how many tokens to verify measures each width instead of assuming one.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence

from specserve.workers.runtime.runner import ForwardRow, ModelRunner

PROBE_CONTEXT = 256  # tokens of context when timing: a chat prompt and part of its answer


def probe_context(max_positions: int | None, widest: int) -> int:
    """The context to time forwards of up to `widest` new positions after, within the model's positions."""
    return min(PROBE_CONTEXT, (max_positions or PROBE_CONTEXT + 2 * widest) - 2 * widest)


def probe_tokens(count: int, vocab_size: int, salt: int = 0) -> list[int]:
    """Deterministic ordinary token ids (not the first few, which are often special)."""
    span = max(1, min(vocab_size, 200) - 3)
    return [(7 * salt + 13 * j) % span + 3 for j in range(count)]


def time_forward(runner: ModelRunner, prompt: Sequence[int], new: int, reps: int) -> list[float]:
    """Seconds of `reps` cached forwards over `new` fresh positions after `prompt`."""
    request_id, prompt, times = f"cost-probe-{uuid.uuid4().hex}", list(prompt), []
    try:
        for i in range(reps):
            runner.logits_for(request_id, prompt, 1)
            sequence = prompt + probe_tokens(new, runner.vocab_size, salt=i + 1)
            t0 = time.perf_counter()
            runner.logits_for(request_id, sequence, new)
            times.append(time.perf_counter() - t0)
    finally:
        runner.release(request_id)
    return times


def verify_seconds(runner: ModelRunner, context: int, max_width: int, reps: int = 3) -> tuple[float, ...]:
    """(t_1, ..., t_max_width): the fastest of `reps` forwards over w new positions after about `context` tokens, each
    (one request's verify; its context is fed once, not once a width)."""
    return batch_verify_seconds(runner, context, 1, max_width, reps)


def batch_verify_seconds(runner: ModelRunner, context: int, rows: int, max_width: int,
                         reps: int = 2) -> tuple[float, ...]:  # fmt: skip
    """(t_1, ..., t_max_width) of one batched forward over `rows` requests, each feeding w new positions after
    `context` tokens of its own (the fastest of `reps` each): what a target worker's verify batch costs.

    Each rep is one pass over every width, each after the same context, not `reps` forwards of one width and then the
    next: a burst of other work on the machine then slows one pass's widths, which the other passes outvote, rather
    than all of one width's tries (a planner reading a single width too dear drafts too short; seen on 2 cores)."""
    tag = uuid.uuid4().hex
    prompts = [probe_tokens(context, runner.vocab_size, salt=r) for r in range(rows)]
    ids = [f"cost-probe-{tag}-{r}" for r in range(rows)]
    # Feeding the prefill again rolls back to the context.
    prefill = [ForwardRow(rid, p, 1) for rid, p in zip(ids, prompts, strict=True)]
    best = [float("inf")] * max_width
    try:
        runner.logits_for_batch(prefill)
        runner.logits_for_batch(prefill)  # allocator and kernel caches
        for i in range(reps):
            for width in range(1, max_width + 1):
                runner.logits_for_batch(prefill)  # every width after the same context
                seqs = [s + probe_tokens(width, runner.vocab_size, salt=i + r + 1) for r, s in enumerate(prompts)]
                t0 = time.perf_counter()
                runner.logits_for_batch([ForwardRow(rid, s, width) for rid, s in zip(ids, seqs, strict=True)])
                best[width - 1] = min(best[width - 1], time.perf_counter() - t0)
    finally:
        for rid in ids:
            runner.release(rid)
    return tuple(best)
