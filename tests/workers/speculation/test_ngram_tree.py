"""Prompt lookup as a tree (method "ngram-tree", workers/speculation/ngram_tree.py): the continuations of every recent
match merged into a trie, scored by the share of the matches' weight through each node and cut to the budget's best
nodes; greedy decoding identical to target-only, sampling drawing the target's distribution."""

import math

import pytest

from specserve.workers.config.request import SamplingParams, SpecParams
from specserve.workers.config.settings import ModelConfig
from specserve.workers.runtime.loading import load_model
from specserve.workers.runtime.tree_rows import ROOT
from specserve.workers.speculation.engine import SpecEngine
from specserve.workers.speculation.ngram import MAX_MATCHES, ngram_matches, ngram_tree
from tests.helpers.greedy_oracle import PROMPTS, own_greedy_loop
from tests.helpers.sampler_pool import sample_in_processes
from tests.helpers.sampling_oracle import NEW, PROMPT, assert_target_distribution
from tests.helpers.workers import save_tiny_llama


def test_matches_are_the_most_recent_of_the_longest_suffixes_first():
    #         0  1  2  3  4  5  6  7  8  9 10 11
    tokens = [5, 6, 7, 1, 6, 7, 2, 9, 7, 3, 6, 7]  # suffix (6, 7) at 1 and 4; (7) also at 8
    assert ngram_matches(tokens, max_ngram=3, min_ngram=1) == [(6, 2), (3, 2), (9, 1)]
    assert ngram_matches(tokens, max_ngram=3, min_ngram=2) == [(6, 2), (3, 2)]
    assert ngram_matches([1, 2, 3], max_ngram=3, min_ngram=1) == []
    assert len(ngram_matches([4] * 100, max_ngram=2, min_ngram=1)) == MAX_MATCHES


def test_continuations_merge_into_a_trie_scored_by_their_weight():
    tokens = [5, 6, 7, 1, 6, 7, 2, 9, 7, 3, 6, 7]
    tree = ngram_tree(tokens, budget=16, depth=2, max_ngram=3, min_ngram=1)
    # matches: (6, 7) -> 2 9 (weight 2), (6, 7) -> 1 6 (weight 2), (7) -> 3 6 (weight 1): 3 branches of 2 tokens
    assert tree.tokens == [2, 9, 1, 6, 3, 6] and tree.parents == [ROOT, 0, ROOT, 2, ROOT, 4]
    assert tree.scores == pytest.approx([math.log(2 / 5)] * 4 + [math.log(1 / 5)] * 2)
    best = ngram_tree(tokens, budget=3, depth=2, max_ngram=3, min_ngram=1)
    assert best.tokens == [2, 9, 1] and best.parents == [ROOT, 0, ROOT]  # ties: the more recent, shallower first
    shared = ngram_tree([8, 1, 2, 8, 1, 3, 8], budget=8, depth=2, max_ngram=1, min_ngram=1)
    assert shared.tokens == [1, 3, 2] and shared.parents == [ROOT, 0, 0]  # both matches go on with 1: one node
    assert shared.scores[0] == 0.0 and shared.scores[1] == shared.scores[2] == pytest.approx(math.log(0.5))
    assert ngram_tree([1, 2, 3], budget=4, depth=4, max_ngram=2, min_ngram=1) is None


@pytest.fixture(scope="module")
def target(tiny_target):
    return load_model(ModelConfig(path=tiny_target, device="cpu"))


@pytest.mark.parametrize("k", [1, 4, 16, "auto"])
def test_greedy_ngram_trees_are_identical_to_target_only(target, k):
    engine = SpecEngine(target)
    drafted = 0
    for prompt in PROMPTS:
        ids = target.tokenizer(prompt)["input_ids"]
        result = engine.generate(prompt, SamplingParams(max_new_tokens=32), SpecParams(method="ngram-tree", k=k))
        assert result.token_ids == own_greedy_loop(target.model, ids, 32, target.eos_token_ids)
        drafted += result.stats.drafted
    assert drafted > 0 or k == "auto"
    assert engine.verifier.runner.store.used_tokens == 0


@pytest.mark.slow
def test_ngram_tree_sampling_matches_target_distribution(models_dir, device):
    """The prompt's repeats give prompt lookup continuations to propose, and the sampled tokens new ones: trees of 4
    nodes through recursive rejection sampling, against the exact joint of the next 3 tokens (chi-square; a target
    whose samples follow the prompt's pattern half the time; about 30 s on 2 cores)."""
    path = save_tiny_llama(models_dir / "tv_ngram_tree", seed=10, layers=4, hidden=16, tiny_vocab=True, init_range=0.5)
    model = load_model(ModelConfig(path=path, device=device)).model
    params = SamplingParams(temperature=1.0, top_p=0.8, max_new_tokens=NEW, stop_at_eos=False)
    spec = SpecParams(method="ngram-tree", k=4)
    drawn = sample_in_processes(path, None, device, PROMPT, params, spec, list(range(4000)))
    assert drawn.accepted > 0.2 * len(drawn.outputs)
    assert_target_distribution(drawn.outputs, model, params, max_tv=0.03)
