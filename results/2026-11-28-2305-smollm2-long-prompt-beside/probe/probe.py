"""In-process forward costs of SmolLM2-135M-Instruct on this CPU at the served target's one thread: a prompt's chunk
at several depths and sizes, four decoding rows, and the two together. `python probe.py [threads]`; output.txt holds
the run that pass_cost.py's docstring quotes."""

import sys
import time

import torch

from specserve.workers.config.settings import KVCacheConfig, ModelConfig
from specserve.workers.models.catalog import resolve_model
from specserve.workers.runtime.loading import load_model
from specserve.workers.runtime.runner import ForwardRow, ModelRunner

torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 1)  # the served target runs one thread
model = load_model(ModelConfig(path=resolve_model("smollm2-135m-instruct", progress=False), device="cpu"))
runner = ModelRunner(model, KVCacheConfig())


def seq(r: int, n: int) -> list[int]:
    return [3 + (7 * i + 13 * r) % 4000 for i in range(n)]


def median_ms(rows_fn, reps: int = 7) -> float:
    times = []
    for i in range(reps):
        rows = rows_fn(i)
        t0 = time.perf_counter()
        runner.logits_for_batch(rows)
        times.append(time.perf_counter() - t0)
    return round(sorted(times)[len(times) // 2] * 1e3, 1)


long = seq(9, 4000)
base = {r: seq(r, 300) for r in range(4)}
runner.logits_for_batch([ForwardRow(f"c{r}", base[r], 1) for r in range(4)])
for depth in (100, 1000, 2800):
    runner.logits_for(f"L{depth}", long[:depth], 1)
    for n in (16, 64, 128):
        ms = median_ms(lambda i, d=depth, n=n: [ForwardRow(f"L{d}", long[:d] + [7 + i] * n, 1)])
        print(depth, n, "chunk alone", ms, flush=True)


def rows(i: int, width: int) -> list[ForwardRow]:
    return [ForwardRow(f"c{r}", base[r] + [5 + i] * width, width) for r in range(4)]


def chunk(i: int) -> list[ForwardRow]:
    return [ForwardRow("L2800", long[:2800] + [7 + i] * 64, 1)]


print("4 rows x1 at 300", median_ms(lambda i: rows(i, 1)))
print("4 rows x9 at 300", median_ms(lambda i: rows(i, 9)))
print("4 rows x9 + 64@2800", median_ms(lambda i: rows(i, 9) + chunk(i)))
print("4 rows x1 + 64@2800", median_ms(lambda i: rows(i, 1) + chunk(i)))
