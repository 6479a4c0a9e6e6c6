"""The benchmark's end-to-end rows through Ray Serve's gRPC proxy: outputs identical to target-only decoding."""

import pytest
import ray

from specserve.cluster.bench.rows import BenchConfig, Row
from specserve.cluster.bench.serve import serve_rows
from specserve.cluster.serve.local_ray import init_ray
from specserve.workers.config.request import SamplingParams, SpecParams
from specserve.workers.config.settings import ModelConfig
from specserve.workers.runtime.loading import load_model
from specserve.workers.speculation.engine import SpecEngine

pytestmark = pytest.mark.slow


def test_serve_rows_are_lossless_and_timed(tiny_target, tiny_draft):
    prompts = [[5, 6, 7, 8, 9], [20, 21, 22], [30, 31, 32, 33]]
    cfg = BenchConfig(prompts=3, prompt_tokens=5, max_new_tokens=12)
    engine = SpecEngine(load_model(ModelConfig(path=tiny_target, device="cpu")))
    base = Row("target-only greedy", "target-only", None, 0.0, tokens_per_s=100.0)
    base.outputs = [engine.generate(p, SamplingParams(max_new_tokens=12), SpecParams(method="none")).token_ids
                    for p in prompts]  # fmt: skip
    init_ray(num_cpus=4, include_dashboard=False, configure_logging=False, log_to_driver=False)
    try:
        rows, status = serve_rows(tiny_target, tiny_draft, prompts, cfg, 3, "cpu", base)
    finally:
        ray.shutdown()
    assert [r.identical for r in rows] == [True, True]
    assert all(r.tokens == sum(len(o) for o in base.outputs) and r.tokens_per_s > 0 for r in rows)
    assert rows[1].name.endswith("3 streams")
    assert status["rounds"] > 0 and status["wire_bytes_per_round"] > 0 and status["orchestration_ms_p50"] > 0
