"""`specserve bench --tensor-parallel N`'s rows: the Serve app with a tensor-parallel target pool beside a draft
pool, target-only and drafting, against the single-process target-only row."""

import pytest

from specserve.cluster.bench.rows import Row
from specserve.cluster.serve.local_ray import init_ray
from specserve.workers.config.request import SamplingParams, SpecParams
from specserve.workers.config.settings import ModelConfig
from specserve.workers.runtime.loading import load_model
from specserve.workers.speculation.engine import SpecEngine

PROMPTS = [[5, 6, 7, 8, 9, 5, 6, 7, 8], [20, 21, 22, 23, 20, 21, 22]]
NEW_TOKENS = 12


@pytest.mark.slow
def test_tensor_parallel_rows_are_served_by_a_sharded_target_pool_and_identical(tiny_target, tiny_draft):
    """About a minute on 2 cores: a TP=2 target pool (two ranks over gloo), one stream each row."""
    import ray

    from specserve.cluster.bench.tp import tp_rows

    engine = SpecEngine(load_model(ModelConfig(path=tiny_target, device="cpu")))
    greedy = SamplingParams(max_new_tokens=NEW_TOKENS)
    base = Row("target-only greedy", "target-only", None, 0.0, tokens_per_s=100.0)
    base.outputs = [engine.generate(p, greedy, SpecParams(method="none")).token_ids for p in PROMPTS]
    target, draft = ModelConfig(path=tiny_target, device="cpu"), ModelConfig(path=tiny_draft, device="cpu")
    init_ray(num_cpus=4, include_dashboard=False, configure_logging=False, log_to_driver=False)
    try:
        rows, profile = tp_rows(target, draft, PROMPTS, NEW_TOKENS, 3, base, 2)
    finally:
        ray.shutdown()

    assert [r.name for r in rows] == ["TP=2 target-only greedy", "TP=2 target k=3 greedy"]
    assert [r.identical for r in rows] == [True, True]
    only, drafting = rows
    assert only.acceptance_by_position == [] and only.mean_accepted_length == 1.0  # it never drafted
    assert drafting.acceptance_by_position and drafting.mean_accepted_length >= 1.0  # it drafted
    assert all(r.speedup > 0 for r in rows)
    assert profile["ms_per_step"] > 0 and 0 <= profile["communication_share"] <= 1
