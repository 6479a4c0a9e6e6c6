"""Lossless, sampling: speculative sampling draws from the target's own distribution, and seeded requests reproduce.

The reference is exact, not sampled: the target's joint distribution over the next 3 tokens is enumerated with full
forward passes, and the engine's samples are tested against it with a chi-square goodness-of-fit test (p > 1e-3, on
5,000 seeded requests per case, so the test is deterministic) plus total variation of each position's marginal.
`test_the_distribution_test_has_power` shows that the same test rejects a different distribution (the draft's)
from fewer samples. (The pure rejection sampler is tested on 200k rows in test_verification.py.)"""

import pytest

from specserve.workers.config.request import SamplingParams, SpecParams
from specserve.workers.config.settings import ModelConfig
from specserve.workers.runtime.loading import load_model
from specserve.workers.speculation.engine import SpecEngine
from tests.helpers.sampler_pool import sample_in_processes
from tests.helpers.sampling_oracle import NEW, PROMPT, chi2_pvalue, exact_joint, marginal_tv


@pytest.fixture(scope="module")
def engine(tiny_vocab_target, tiny_vocab_draft, device):
    return SpecEngine(
        load_model(ModelConfig(path=tiny_vocab_target, device=device)),
        load_model(ModelConfig(path=tiny_vocab_draft, device=device)),
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    "method, k, top_p, samples, max_tv, min_accepted",
    [
        ("draft", 2, 1.0, 5_000, 0.03, 0.1),
        ("draft", 2, 0.8, 5_000, 0.03, 0.1),
        # n-gram proposals are one-hot and mostly rejected here, which exercises the recovered-token path.
        ("ngram", 3, 1.0, 5_000, 0.03, 0.01),
        # suffix drafting: one-hot proposals from the request and the engine's earlier samples
        ("suffix", 3, 1.0, 5_000, 0.03, 0.01),
    ],
)
def test_speculative_sampling_matches_target_distribution(
    engine, tiny_vocab_target, tiny_vocab_draft, device, method, k, top_p, samples, max_tv, min_accepted
):
    V = engine.verifier.vocab_size
    params = SamplingParams(temperature=1.0, top_p=top_p, max_new_tokens=NEW, stop_at_eos=False)
    joint = exact_joint(engine.target.model, params, V)
    spec = SpecParams(method=method, k=k)
    drawn = sample_in_processes(tiny_vocab_target, tiny_vocab_draft, device, PROMPT, params, spec, list(range(samples)))
    outputs = drawn.outputs
    assert len(outputs) == samples
    assert drawn.accepted > min_accepted * samples  # speculation really happened
    assert chi2_pvalue(outputs, joint) > 1e-3
    for pos in range(NEW):
        assert marginal_tv(outputs, joint, pos, V) <= max_tv


@pytest.mark.slow  # a statistical test of 10 s on 2 cores: the full suite runs it, the fast loop stays under 5 min
def test_the_distribution_test_has_power(engine):
    """Sampling from the draft alone must fail the same test, or the test above proves nothing."""
    params = SamplingParams(temperature=1.0, max_new_tokens=NEW, stop_at_eos=False)
    V = engine.verifier.vocab_size
    joint = exact_joint(engine.target.model, params, V)
    draft_engine = SpecEngine(engine.drafters["draft"].runner.loaded)
    samples = [
        tuple(draft_engine.generate(PROMPT, params.model_copy(update={"seed": s}), SpecParams(method="none")).token_ids)
        for s in range(2000)
    ]
    try:
        p = chi2_pvalue(samples, joint)
    except AssertionError:
        return  # it sampled something the target never would: clearly distinguishable
    assert p < 1e-6


def test_seeded_request_is_reproducible_and_seed_matters(engine):
    spec = SpecParams(method="draft", k=3)
    params = SamplingParams(temperature=1.0, max_new_tokens=12, stop_at_eos=False, seed=123)
    a = engine.generate(PROMPT, params, spec)
    b = engine.generate(PROMPT, params, spec)
    assert a.token_ids == b.token_ids and a.stats == b.stats
    outputs = {tuple(engine.generate(PROMPT, params.model_copy(update={"seed": s}), spec).token_ids) for s in range(10)}
    assert len(outputs) > 1
