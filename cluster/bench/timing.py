"""How `specserve bench` times its rows: per-token costs sampled between the rows, the interleaved measurement of
every row on every prompt, the bounds a speculative row is compared with, and the throughput of stream rows (the
disaggregated, Serve and tensor-parallel ones)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from specserve.cluster.bench.rows import BenchConfig, Row, RowFn
from specserve.workers.config.request import SamplingParams
from specserve.workers.config.settings import KVCacheConfig
from specserve.workers.runtime.cost_probe import time_forward
from specserve.workers.runtime.loading import LoadedModel
from specserve.workers.runtime.runner import ModelRunner
from specserve.workers.speculation.leviathan import fit_acceptance, leviathan_speedup
from specserve.workers.speculation.methods import METHODS
from specserve.workers.speculation.request import RequestStats


@dataclass
class Costs:
    t_draft: float  # seconds per drafted token (draft model, cached, one token); 0 without a draft model
    t_target: float  # seconds per target token (cached, one token)
    verify_s: dict[int, float]  # k drafted -> seconds of a target forward over k + 1 new positions (as VerifyCosts)
    t_head: float = 0.0  # seconds per token an EAGLE-3 head drafts (at k = 4, its fixed cost per round shared out)

    def verify(self, k: float) -> float:
        """Seconds of a target forward over k + 1 positions: the sampled cost, interpolated between sampled widths for
        a fractional k (a mean over rounds; k = 0 is a plain one-token step)."""
        points = sorted({0: self.t_target, **self.verify_s}.items())
        if k >= points[-1][0]:
            return points[-1][1]
        for (k0, t0), (k1, t1) in zip(points, points[1:], strict=False):
            if k0 <= k <= k1:
                return t0 + (t1 - t0) * (k - k0) / (k1 - k0)
        return points[0][1]


PROBE_POSITIONS = 32_768  # the cost probes' KV capacity: the longest prompt a bench times, and its verify


class CostSampler:
    """Per-token costs, sampled a few times per prompt between the rows (so the VM's drift lands on the costs as on
    the rows, and `ratio_to_bound` compares like with like); `costs()` takes the medians of all samples. Without a
    draft model (n-gram drafting costs next to nothing) t_draft is 0 and the verify costs are what matter."""

    def __init__(self, target: LoadedModel, draft: LoadedModel | None, ks, reps: int = 5):
        # A probe's runs are short: a fixed capacity, so the engine's own runners beside them keep the device's memory.
        kv = KVCacheConfig(capacity_tokens=PROBE_POSITIONS)
        self.t_runner = ModelRunner(target, kv)
        self.d_runner = ModelRunner(draft, kv) if draft is not None else None
        self.verify_ks = sorted(set(ks) | {1, 2, 4, 6, 8})
        self.reps = reps
        self.samples: dict[str, list[float]] = {}

    def warm_up(self, prompt: list[int]) -> None:
        time_forward(self.t_runner, prompt, 5, self.reps)  # allocator and kernel caches
        if self.d_runner is not None:
            time_forward(self.d_runner, prompt, 1, self.reps)

    def sample(self, prompt: list[int]) -> None:
        add = lambda key, times: self.samples.setdefault(key, []).extend(times)  # noqa: E731
        if self.d_runner is not None:
            add("draft", time_forward(self.d_runner, prompt, 1, self.reps))
        add("target", time_forward(self.t_runner, prompt, 1, self.reps))
        for k in self.verify_ks:
            add(f"verify{k}", time_forward(self.t_runner, prompt, k + 1, self.reps))

    def costs(self) -> Costs:
        med = lambda key: statistics.median(self.samples[key])  # noqa: E731
        return Costs(t_draft=med("draft") if "draft" in self.samples else 0.0, t_target=med("target"),
                     verify_s={k: med(f"verify{k}") for k in self.verify_ks})  # fmt: skip


def distinct_ngram_fraction(tokens: list[int], n: int = 4) -> float:
    grams = [tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1)]
    return len(set(grams)) / len(grams) if grams else 0.0


def fill_bounds(row: Row, costs: Costs, k: float, steps: float | None = None) -> None:
    """Leviathan's S(k) with a fitted a, and the cost-aware bound B(k) = E t_target / (s t_draft + t_verify(k+1)),
    s the drafting steps a round (a chain's k; a tree's depth)."""
    E = row.mean_accepted_length
    t_verify = costs.verify(k)
    # eagle+ngram: as if the head drafted every round (prompt lookup's rounds cost less: the bound is conservative)
    entry = METHODS.get(row.method)  # None: target-only and the HF rows
    t_draft = 0.0 if entry is None or not entry.needs_model else costs.t_head if entry.needs_head else costs.t_draft
    c = t_draft / costs.t_target
    row.t_draft_ms, row.t_target_ms, row.t_verify_ms = t_draft * 1e3, costs.t_target * 1e3, t_verify * 1e3
    row.leviathan_bound = leviathan_speedup(fit_acceptance(E, k), k, c)
    row.bound = E * costs.t_target / ((k if steps is None else steps) * t_draft + t_verify)


def params_for(row: Row, greedy: SamplingParams, sampled: SamplingParams) -> SamplingParams:
    return greedy if row.temperature == 0 else sampled


@dataclass
class RoundCounts(RequestStats):
    """A row's speculation over all prompts, summed from RequestStats, and each request's share in order."""

    by_request: list[tuple[int, int]] = field(default_factory=list)  # (accepted, rounds) of each add, in order

    def add(self, other: RequestStats) -> None:
        super().add(other)
        self.by_request.append((other.accepted, other.rounds))


def measure(plan: list[tuple[Row, RowFn]], prompts, cfg: BenchConfig, bar, sampler: CostSampler | None = None,
            items: list | None = None, cold: Callable[[], None] | None = None):  # fmt: skip
    """Prompt by prompt, every row in turn (forwards, then backwards for the next prompt): this VM's speed drifts by
    tens of percent over minutes, and row after row (each over all prompts) charged a slow spell to whichever rows
    ran in it (one run measured T=0.8 speculation at 0.79x target-only, the next at 1.56x, same models). `items`:
    what the rows' functions take in place of the prompts (Spec-Bench's conversations, whose first turns the
    prompts are; the cost sampler still reads the prompts). `cold`: called before each row's turn at a prompt (the
    engine's retained prefixes given up: a row after another on the same prompt would skip the prefill the first
    paid, and a long prompt's prefill is much of its time). Returns {id(row): RoundCounts}."""
    greedy = SamplingParams(max_new_tokens=cfg.max_new_tokens)
    sampled = SamplingParams(max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature, seed=cfg.seed)
    counts = {id(row): RoundCounts() for row, _ in plan}
    for i, prompt in enumerate(prompts):
        if sampler is not None:
            sampler.sample(prompt)
        for row, fn in plan if i % 2 == 0 else plan[::-1]:
            if cold is not None:
                cold()
            t0 = time.perf_counter()
            tokens, stats = fn(prompt if items is None else items[i], params_for(row, greedy, sampled))
            row.seconds_by_prompt.append(time.perf_counter() - t0)
            row.seconds += row.seconds_by_prompt[-1]
            row.tokens += len(tokens)
            row.outputs.append(tokens)
            if stats is not None:
                counts[id(row)].add(stats)
            bar.update(1)
    for row, _ in plan:
        row.tokens_per_s = row.tokens / row.seconds
    return counts


def finish_stream_rows(rows: list[Row], base: Row) -> list[Row]:
    """Fill in throughput, speedup over `base` and the identical check of rows that recorded outputs and seconds. A
    row of several streams gets no speedup: `base` is one stream, and dividing by it would count batching as
    speculation (the load bench, `--load`, compares speculation with plain decoding at the same streams)."""
    for row in rows:
        row.tokens = sum(len(o) for o in row.outputs)
        row.tokens_per_s = row.tokens / row.seconds
        row.speedup = row.tokens_per_s / base.tokens_per_s if row.streams == 1 else None
        row.identical = row.outputs == base.outputs
    return rows
