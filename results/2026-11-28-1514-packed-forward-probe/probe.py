"""In-process forward costs of SmolLM2-135M-Instruct on this CPU: decoding rows, a prompt's chunk beside them, a
prefill. Run once per build (the slot layout before 9572e1f, the KV arena and packed pass from it) with the same
threads; writes one JSON object per run to stdout's last line."""

import json
import platform
import subprocess
import sys
import time

import torch

from specserve.workers.config.settings import KVCacheConfig, ModelConfig
from specserve.workers.models.catalog import resolve_model
from specserve.workers.runtime.loading import load_model
from specserve.workers.runtime.runner import ForwardRow, ModelRunner

torch.set_num_threads(2)
runner = ModelRunner(load_model(ModelConfig(path=resolve_model("smollm2-135m-instruct", progress=False),
                                            device="cpu")), KVCacheConfig())  # fmt: skip


def seq(r, n):
    return [3 + (7 * i + 13 * r) % 4000 for i in range(n)]


def median_ms(rows_fn, reps):
    times = []
    for i in range(reps):
        rows = rows_fn(i)
        t0 = time.perf_counter()
        runner.logits_for_batch(rows)
        times.append(time.perf_counter() - t0)
    return round(sorted(times)[len(times) // 2] * 1e3, 1)


base = {r: seq(r, 300) for r in range(4)}
runner.logits_for_batch([ForwardRow(f"c{r}", base[r], 1) for r in range(4)])
long = seq(9, 3000)
runner.logits_for("L", long[:2800], 1)
out = {
    "one_row_1_position_at_300_ms": median_ms(lambda i: [ForwardRow("c0", base[0] + [5 + i], 1)], 21),
    "one_row_5_positions_at_300_ms": median_ms(lambda i: [ForwardRow("c0", base[0] + [5 + i] * 5, 5)], 21),
    "four_rows_5_positions_at_300_ms": median_ms(
        lambda i: [ForwardRow(f"c{r}", base[r] + [5 + i] * 5, 5) for r in range(4)], 21
    ),
    "four_rows_5_positions_and_a_64_chunk_at_2800_ms": median_ms(
        lambda i: (
            [ForwardRow(f"c{r}", base[r] + [5 + i] * 5, 5) for r in range(4)]
            + [ForwardRow("L", long[:2800] + [7 + i] * 64, 1)]
        ),
        9,
    ),
    "a_64_chunk_at_2800_alone_ms": median_ms(lambda i: [ForwardRow("L", long[:2800] + [7 + i] * 64, 1)], 9),
}
t0 = time.perf_counter()
runner.logits_for("P", seq(11, 1024), 1)
out["prefill_1024_ms"] = round((time.perf_counter() - t0) * 1e3, 1)
out["commit"] = sys.argv[1] if len(sys.argv) > 1 else None
out["threads"] = torch.get_num_threads()
out["cpu"] = subprocess.run(["sh", "-c", "grep -m1 'model name' /proc/cpuinfo"], capture_output=True,
                            text=True).stdout.split(":")[-1].strip()  # fmt: skip
out["python"] = platform.python_version()
out["date"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
print(json.dumps(out))
