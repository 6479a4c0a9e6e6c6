"""Verifying drafted trees with the target (TargetVerifier.verify_trees): greedy rounds over random trees, where
one branch follows the target's own continuation for a while, decode exactly what the target decodes alone; sampled
rounds over trees with several candidates per level draw the target's own distribution (chi-square against the exact
joint of the next 3 tokens, 3,000 seeded requests); the committed positions' features come with the verdict."""

import random

import numpy as np
import pytest

from specserve.workers.config.request import SamplingParams
from specserve.workers.config.settings import KVCacheConfig, ModelConfig
from specserve.workers.runtime.loading import load_model
from specserve.workers.runtime.runner import ModelRunner
from specserve.workers.runtime.tree_rows import ROOT, TreeRow
from specserve.workers.speculation.sampling import TARGET_SALT, make_generator
from specserve.workers.speculation.target import TargetVerifier, TreeCall
from tests.helpers.greedy_oracle import own_greedy_loop
from tests.helpers.sampling_oracle import NEW, PROMPT, chi2_pvalue, exact_joint, marginal_tv
from tests.helpers.trees import random_tree

GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def target(tiny_target):
    return load_model(ModelConfig(path=tiny_target, device="cpu"))


def test_greedy_tree_rounds_decode_exactly_what_the_target_decodes_alone(target):
    verifier = TargetVerifier(ModelRunner(target, KVCacheConfig()))
    verifier.runner.capture_features((1,))
    prompt, new = [1, 40, 41, 42, 43, 44], 48
    want = own_greedy_loop(target.model, prompt, new, set())
    rng, tokens, accepted, rounds = random.Random(0), list(prompt), 0, 0
    while len(tokens) - len(prompt) < new:
        tree_tokens, parents = random_tree(want[len(tokens) - len(prompt) :], 60, rng)
        call = TreeCall(TreeRow("r", list(tokens), tree_tokens, parents), GREEDY, make_generator(0))
        verdict = verifier.verify_trees([call], capture=True)[0]
        committed = [tree_tokens[i] for i in verdict.path] + [verdict.next_token]
        # features: the uncached committed positions, then the accepted path's
        assert verdict.feature_start + len(verdict.features) == len(tokens) + len(verdict.path)
        tokens += committed
        accepted, rounds = accepted + len(verdict.path), rounds + 1
    assert tokens[len(prompt) : len(prompt) + new] == want
    assert accepted >= rounds // 2  # the right branch was found, wherever it sat among its siblings


@pytest.mark.slow
def test_sampled_tree_rounds_draw_the_targets_distribution(tiny_vocab_target):
    """Every request's rounds verify a tree with 3 candidates at the root and 2 under the first (fixed tokens: a
    drafter's choices that ignore the target, the hardest case for the residuals), until 3 tokens are committed."""
    model = load_model(ModelConfig(path=tiny_vocab_target, device="cpu"))
    verifier = TargetVerifier(ModelRunner(model, KVCacheConfig()))
    params = SamplingParams(temperature=1.0)
    vocab = model.model.config.vocab_size
    tree_tokens, parents = [3, 4, 5, 4, 3, 6], [ROOT, ROOT, ROOT, 0, 0, 3]
    samples, batch, depths = [], 100, []
    for first in range(0, 3000, batch):
        sequences = {seed: list(PROMPT) for seed in range(first, first + batch)}
        while any(len(s) < len(PROMPT) + NEW for s in sequences.values()):
            calls = [
                TreeCall(
                    TreeRow(str(seed), s, tree_tokens, parents), params, make_generator(seed, TARGET_SALT, len(s))
                )  # fmt: skip
                for seed, s in sequences.items()
                if len(s) < len(PROMPT) + NEW
            ]
            for call, verdict in zip(calls, verifier.verify_trees(calls), strict=True):
                sequences[int(call.tree.request_id)] += [tree_tokens[i] for i in verdict.path] + [verdict.next_token]
                depths.append(len(verdict.path))
        for seed, s in sequences.items():
            samples.append(tuple(s[len(PROMPT) : len(PROMPT) + NEW]))
            verifier.release(str(seed))
    joint = exact_joint(model.model, params, vocab)
    assert chi2_pvalue(samples, joint) > 1e-3
    assert max(marginal_tv(samples, joint, position, vocab) for position in range(NEW)) < 0.04
    accepted = np.bincount(depths, minlength=4)
    assert accepted[1] > 0 and accepted[2] > 0  # rounds took one and two of the tree's nodes
