import pytest
import torch

from specserve.workers.config.request import SamplingParams
from specserve.workers.speculation.sampling import (
    exponential_noise,
    logits_to_probs,
    make_generator,
    sample,
    sample_with_noise,
)


def test_greedy_is_one_hot_argmax():
    logits = torch.tensor([[0.1, 2.0, -1.0], [3.0, 0.0, 0.0]])
    probs = logits_to_probs(logits, SamplingParams(temperature=0))
    assert probs.tolist() == [[0.0, 1.0, 0.0], [1.0, 0.0, 0.0]]


def test_temperature_scales_logits():
    logits = torch.tensor([1.0, 2.0, 3.0])
    probs = logits_to_probs(logits, SamplingParams(temperature=2.0))
    assert torch.allclose(probs, torch.softmax(logits / 2.0, -1))


def test_top_k_keeps_k_tokens():
    logits = torch.tensor([1.0, 4.0, 3.0, 2.0])
    probs = logits_to_probs(logits, SamplingParams(temperature=1.0, top_k=2))
    assert (probs > 0).tolist() == [False, True, True, False]
    assert torch.allclose(probs[1:3], torch.softmax(torch.tensor([4.0, 3.0]), -1))


@pytest.mark.parametrize(
    "top_p, kept",
    [
        (0.45, [True, False, False, False]),
        (0.6, [True, True, False, False]),
        (0.9, [True, True, True, False]),
        (1.0, [True] * 4),
    ],
)
def test_top_p_keeps_smallest_set_reaching_mass(top_p, kept):
    probs_in = torch.tensor([0.5, 0.3, 0.15, 0.05])
    probs = logits_to_probs(probs_in.log(), SamplingParams(temperature=1.0, top_p=top_p))
    assert (probs > 0).tolist() == kept
    assert torch.allclose(probs.sum(), torch.tensor(1.0))
    assert torch.allclose(probs[probs > 0], probs_in[kept] / probs_in[kept].sum())


def test_sample_with_noise_matches_distribution():
    p = torch.tensor([0.1, 0.6, 0.3])
    g = make_generator(0)
    noise = exponential_noise(3, [g] * 1)
    assert sample_with_noise(p.unsqueeze(0), noise).shape == (1,)
    draws = torch.tensor([sample(p, g) for _ in range(20_000)])
    freq = torch.bincount(draws, minlength=3).float() / len(draws)
    assert (freq - p).abs().max() < 0.015


def test_seeded_generators_reproduce_and_salts_differ():
    a = exponential_noise(8, [make_generator(5, salt=1)])
    b = exponential_noise(8, [make_generator(5, salt=1)])
    c = exponential_noise(8, [make_generator(5, salt=2)])
    assert torch.equal(a, b)
    assert not torch.equal(a, c)
