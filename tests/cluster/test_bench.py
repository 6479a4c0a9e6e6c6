import statistics

from specserve.cluster.bench import CostSampler
from specserve.workers.config import ModelConfig
from specserve.workers.loading import load_model


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
    assert costs.t_verify == {k: statistics.median(sampler.samples[f"verify{k}"]) for k in sampler.verify_ks}
    # The cost caches are released: timing leaves no request behind on either model.
    assert len(sampler.t_runner.store) == 0 and len(sampler.d_runner.store) == 0
