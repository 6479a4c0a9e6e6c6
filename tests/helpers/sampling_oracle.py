"""The sampling oracle: the target's exact joint distribution over the next NEW tokens after PROMPT, enumerated with
full forward passes, and the tests that sampled outputs fit it (chi-square goodness of fit, total variation of each
position's marginal). Shared by every test that says speculative sampling draws from the target's distribution."""

import numpy as np
import torch
from scipy.stats import chisquare

from specserve.workers.speculation.sampling import logits_to_probs

PROMPT = [1, 3, 4, 3, 4, 3]  # <s> a b a b a: repeats, so n-gram lookup has something to propose
NEW = 3


def exact_joint(model, params, V, prompt: list[int] = PROMPT):
    """P(t1, t2, t3 | prompt) under target-only sampling, by enumeration with full forwards: {tuple: prob}."""
    with torch.no_grad():
        probs = {(): 1.0}
        for _ in range(NEW):
            nxt = {}
            for prefix, mass in probs.items():
                logits = model(torch.tensor([prompt + list(prefix)], device=model.device)).logits[0, -1]
                p = logits_to_probs(logits, params)
                for t in range(V):
                    if p[t] > 0:
                        nxt[prefix + (t,)] = mass * float(p[t])
            probs = nxt
    return probs


def chi2_pvalue(samples, joint):
    """Chi-square goodness of fit of sampled tuples to the exact joint; cells with expected count < 5 pooled."""
    counts = {}
    for s in samples:
        counts[s] = counts.get(s, 0) + 1
    n = len(samples)
    assert set(counts) <= set(joint), "sampled a sequence the target gives probability 0"
    obs, exp, pooled_obs, pooled_exp = [], [], 0, 0.0
    for cell, prob in joint.items():
        if prob * n >= 5:
            obs.append(counts.get(cell, 0))
            exp.append(prob * n)
        else:
            pooled_obs += counts.get(cell, 0)
            pooled_exp += prob * n
    if pooled_exp > 0:
        obs.append(pooled_obs)
        exp.append(pooled_exp)
    exp = np.array(exp) * n / sum(exp)  # absorb float rounding
    return chisquare(obs, exp).pvalue


def marginal_tv(samples, joint, position, V):
    emp = np.bincount([s[position] for s in samples], minlength=V) / len(samples)
    exact = np.zeros(V)
    for cell, prob in joint.items():
        exact[cell[position]] += prob
    return 0.5 * np.abs(emp - exact).sum()


def assert_target_distribution(outputs, model, params, max_tv: float) -> None:
    """The sampled NEW-token outputs after PROMPT fit the target's exact joint (chi-square) and each position's
    marginal is within `max_tv` of the exact one (total variation)."""
    V = model.config.vocab_size
    joint = exact_joint(model, params, V)
    assert chi2_pvalue(outputs, joint) > 1e-3
    for pos in range(NEW):
        assert marginal_tv(outputs, joint, pos, V) <= max_tv
