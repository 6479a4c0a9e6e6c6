import statistics

import pytest

from specserve.cluster.bench.timing import Costs, CostSampler
from specserve.workers.config.settings import ModelConfig
from specserve.workers.runtime.loading import load_model


def test_costs_are_medians_of_samples_taken_after_every_prompt(tiny_target, tiny_draft):
    target = load_model(ModelConfig(path=tiny_target, device="cpu"))
    draft = load_model(ModelConfig(path=tiny_draft, device="cpu"))
    sampler = CostSampler(target, draft, ks=(2, 3), reps=3)
    prompts = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16]]
    sampler.warm_up(prompts[0])
    assert sampler.samples == {}  # warm-up timings are not costs
    for prompt in prompts:
        sampler.sample(prompt)

    assert sampler.verify_ks == [1, 2, 3, 4, 6, 8]  # the bench's ks plus those the table always reports
    assert {len(times) for times in sampler.samples.values()} == {3 * len(prompts)}
    costs = sampler.costs()
    assert costs.t_draft == statistics.median(sampler.samples["draft"]) > 0
    assert costs.t_target == statistics.median(sampler.samples["target"]) > 0
    assert costs.verify_s == {k: statistics.median(sampler.samples[f"verify{k}"]) for k in sampler.verify_ks}
    # The cost caches are released: timing leaves no request behind on either model.
    assert len(sampler.t_runner.store) == 0 and len(sampler.d_runner.store) == 0


def test_without_a_draft_model_t_draft_is_zero_and_every_verify_width_is_sampled(tiny_target):
    target = load_model(ModelConfig(path=tiny_target, device="cpu"))
    sampler = CostSampler(target, None, ks=range(1, 9), reps=2)
    sampler.warm_up([5, 6, 7])
    sampler.sample([5, 6, 7, 8])
    assert "draft" not in sampler.samples
    costs = sampler.costs()
    assert costs.t_draft == 0.0 and costs.t_target > 0
    assert sorted(costs.verify_s) == list(range(1, 9)) and min(costs.verify_s.values()) > 0


def test_verify_cost_interpolates_between_sampled_widths():
    costs = Costs(t_draft=0.0, t_target=1.0, verify_s={1: 2.0, 2: 3.0, 4: 7.0})
    assert costs.verify(2) == 3.0  # a sampled width: its own cost
    assert costs.verify(0) == 1.0  # nothing drafted: a plain step
    assert costs.verify(0.5) == pytest.approx(1.5)
    assert costs.verify(3) == pytest.approx(5.0)
    assert costs.verify(9) == 7.0  # past the widest sampled width: the widest's cost
