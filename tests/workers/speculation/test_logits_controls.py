"""Per-request logits controls inside verification (presence / frequency / repetition penalties, min_p, logit_bias,
min_tokens): greedy output identical to transformers' `generate` with the same processors (tests/helpers/
controls_oracle.py; presence and frequency written there from OpenAI's definition) for every drafting method, in
process; the pure functions' position-by-position history (a chain's drafted prefix, a tree's ancestors); sampling
with penalties draws from the controlled target distribution (exact joint, chi-square)."""

import pytest
import torch

from specserve.workers.config.request import SamplingParams, SpecParams
from specserve.workers.config.settings import ModelConfig
from specserve.workers.config.strict import validate
from specserve.workers.errors import InvalidRequestError
from specserve.workers.runtime.loading import load_model
from specserve.workers.speculation.engine import SpecEngine
from specserve.workers.speculation.logits_controls import chain_ancestry, controlled_logits, tree_ancestry
from specserve.workers.speculation.planner.costs import VerifyCosts
from specserve.workers.speculation.planner.tree import MAX_TREE_NODES
from tests.helpers.controls_oracle import controlled_logits_reference, hf_controlled_greedy
from tests.helpers.eagle_heads import random_head
from tests.helpers.greedy_oracle import PROMPTS
from tests.helpers.marks import slow_unless
from tests.helpers.sampler_pool import sample_in_processes
from tests.helpers.sampling_oracle import NEW, PROMPT, chi2_pvalue, marginal_tv
from tests.helpers.workers import save_perturbed_copy, save_tiny_llama

MAX_NEW = 20
EOS = 2  # the tiny tokenizer's </s>
CONTROLS = {
    "repetition": {"repetition_penalty": 1.8},
    "presence+frequency": {"presence_penalty": 1.5, "frequency_penalty": 0.8},
    "bias+min_tokens": {"logit_bias": {EOS: 100.0, 70: 4.0, 71: -100.0}, "min_tokens": 7},
    "all": {"repetition_penalty": 1.3, "presence_penalty": -0.5, "frequency_penalty": 0.4, "min_p": 0.3,
            "logit_bias": {80: 3.0}, "min_tokens": 3},
}  # fmt: skip
METHODS = [("draft", 3), ("draft", "auto"), ("ngram", 3), ("eagle", 3), ("eagle+ngram", "auto"), ("eagle-tree", 6),
           ("eagle-tree", "auto"), ("ngram-tree", 6), ("suffix", 3), ("none", 1)]  # fmt: skip


@pytest.fixture(scope="module")
def engine(models_dir, device):
    path = save_tiny_llama(models_dir / "controls_target", seed=4, layers=8, hidden=32)
    draft_path = save_perturbed_copy(path, models_dir / "controls_draft", 0.05, seed=7)
    target = load_model(ModelConfig(path=path, device=device))
    head = random_head(target.model.config, 64, seed=2, std=0.3)
    flat = VerifyCosts((1.0,) * (MAX_TREE_NODES + 1))  # k='auto' trees: every node pays
    draft = load_model(ModelConfig(path=draft_path, device=device))
    return SpecEngine(target, draft, eagle_head=head, tree_costs=flat)


@pytest.fixture(scope="module")
def references(engine):
    target = engine.target
    refs = {}
    for name, controls in CONTROLS.items():
        for prompt in PROMPTS:
            ids = target.tokenizer(prompt)["input_ids"]
            refs[name, prompt] = hf_controlled_greedy(target.model, ids, MAX_NEW, controls, target.eos_token_ids)
    plain = {p: hf_controlled_greedy(target.model, target.tokenizer(p)["input_ids"], MAX_NEW, {}, [EOS])
             for p in PROMPTS}  # fmt: skip
    for name in CONTROLS:  # every case changes the output, so the identity below can fail
        assert any(refs[name, p] != plain[p] for p in PROMPTS), name
    return refs


# the fast loop: one of each drafting kind (the draft model's and the head's chains run in the served controls tests)
@pytest.mark.parametrize(
    ("method", "k"),
    slow_unless(
        METHODS,
        [("ngram", 3), ("eagle-tree", 6), ("eagle-tree", "auto"), ("ngram-tree", 6), ("suffix", 3), ("none", 1)],
    ),
)
def test_greedy_with_controls_is_identical_to_transformers(engine, references, method, k):
    drafted = 0
    for name, controls in CONTROLS.items():
        for prompt in PROMPTS:
            params = SamplingParams(max_new_tokens=MAX_NEW, **controls)
            result = engine.generate(prompt, params, SpecParams(method=method, k=k))
            assert result.token_ids == references[name, prompt], (name, prompt)
            drafted += result.stats.drafted
    assert drafted > 0 or method == "none"


def test_min_tokens_holds_eos_back_then_lets_it_through(references):
    for prompt in PROMPTS:
        out = references["bias+min_tokens", prompt]
        assert len(out) == 8 and out[-1] == EOS and EOS not in out[:-1]


def test_a_chains_positions_count_the_drafted_tokens_before_them():
    V = 6
    params = SamplingParams(frequency_penalty=1.0, presence_penalty=0.5, repetition_penalty=2.0, prompt_len=2)
    committed, drafted = [1, 2, 3], [3, 4]  # prompt [1, 2]; generated [3]
    out = controlled_logits(torch.ones(3, V), params, committed, drafted)
    # position 0: 3 generated once; position 1: 3 twice; position 2: 3 twice and 4 once
    expected = torch.tensor([
        [1, 0.5, 0.5, 0.5 - 1.5, 1, 1],
        [1, 0.5, 0.5, 0.5 - 2.5, 1, 1],
        [1, 0.5, 0.5, 0.5 - 2.5, 0.5 - 1.5, 1],
    ])  # fmt: skip
    torch.testing.assert_close(out, expected)
    assert chain_ancestry(2).tolist() == [[False, False], [True, False], [True, True]]


def test_a_trees_positions_count_their_ancestors_only():
    parents = [-1, -1, 0, 2]  # nodes 0 and 1 are siblings; 2 under 0; 3 under 2
    assert tree_ancestry(parents).tolist() == [
        [False, False, False, False],
        [True, False, False, False],
        [False, True, False, False],
        [True, False, True, False],
        [True, False, True, True],
    ]
    params = SamplingParams(presence_penalty=1.0, min_tokens=3, end_token_ids=(5,), prompt_len=1)
    out = controlled_logits(torch.zeros(5, 6), params, [0, 1], [2, 3, 4, 2], parents)
    assert out[0, 2] == 0 and out[1, 2] == -1 and out[2, 2] == 0 and out[2, 3] == -1 and out[4, 2] == -1
    assert out[4, 4] == -1 and out[3, 3] == 0  # node 2's position follows nodes 0 and 2, not their sibling 1
    # min_tokens: 1 token generated before the root, so positions at depth >= 2 may end the request
    assert out[:, 5].tolist() == [float("-inf"), float("-inf"), float("-inf"), 0.0, 0.0]


@pytest.mark.parametrize(
    ("data", "field"),
    [({"presence_penalty": 2.5}, "presence_penalty"), ({"frequency_penalty": -3}, "frequency_penalty"),
     ({"repetition_penalty": 0.0}, "repetition_penalty"), ({"min_p": 1.5}, "min_p"),
     ({"logit_bias": {3: 101.0}}, "logit_bias"), ({"logit_bias": {-1: 1.0}}, "logit_bias"),
     ({"min_tokens": -1}, "min_tokens"), ({"min_tokens": 9, "max_new_tokens": 8}, "min_tokens")],
)  # fmt: skip
def test_bad_values_are_refused_naming_the_field(data, field):
    with pytest.raises(InvalidRequestError) as e:
        validate(SamplingParams, data)
    assert e.value.field == field


def _controlled_joint(model, params: SamplingParams, controls: dict, V: int) -> dict:
    """The exact joint of NEW tokens after PROMPT under target-only sampling with the controls (transformers'
    processors and the OpenAI reference), enumerated with full forwards."""
    from specserve.workers.speculation.sampling import logits_to_probs

    probs = {(): 1.0}
    with torch.no_grad():
        for _ in range(NEW):
            nxt = {}
            for prefix, mass in probs.items():
                sequence = PROMPT + list(prefix)
                logits = model(torch.tensor([sequence])).logits[0, -1]
                logits = controlled_logits_reference(logits, sequence, len(PROMPT), controls, [EOS])
                p = logits_to_probs(logits, params)  # temperature, min_p, top-k, top-p
                nxt.update({prefix + (t,): mass * float(p[t]) for t in range(V) if p[t] > 0})
            probs = nxt
    return probs


@pytest.mark.slow
@pytest.mark.parametrize(("method", "k", "samples"), [("draft", 2, 5_000), ("ngram", 3, 3_000)])
def test_sampling_with_penalties_draws_from_the_controlled_distribution(tiny_vocab_target, tiny_vocab_draft, method,
                                                                        k, samples):  # fmt: skip
    """Penalties that drafted tokens trigger (the prompt repeats, so prompt lookup drafts its tokens): a draft's
    proposals are scored with the history up to them. About 3 and 2 minutes on 2 busy cores."""
    controls = {"repetition_penalty": 1.6, "presence_penalty": 0.7, "frequency_penalty": 0.9, "min_p": 0.05}
    params = SamplingParams(temperature=1.0, max_new_tokens=NEW, stop_at_eos=False, **controls)
    model = load_model(ModelConfig(path=tiny_vocab_target, device="cpu")).model
    V = model.config.vocab_size
    joint = _controlled_joint(model, params, controls, V)
    plain = _controlled_joint(model, params.model_copy(update={"repetition_penalty": 1.0, "presence_penalty": 0.0,
                                                               "frequency_penalty": 0.0}), {}, V)  # fmt: skip
    assert sum(abs(joint.get(c, 0.0) - plain.get(c, 0.0)) for c in set(joint) | set(plain)) > 0.2  # they matter
    drawn = sample_in_processes(tiny_vocab_target, tiny_vocab_draft, "cpu", PROMPT, params,
                                SpecParams(method=method, k=k), list(range(samples)))  # fmt: skip
    outputs = drawn.outputs
    assert drawn.accepted > 0.01 * samples
    assert chi2_pvalue(outputs, joint) > 1e-3
    for pos in range(NEW):
        assert marginal_tv(outputs, joint, pos, V) <= 0.03


def test_drafts_are_proposed_under_the_requests_controls():
    """A drafter's token is drawn from the controlled distribution when it is told the tokens before it (so it proposes
    what the controlled target will accept), and q is exactly that distribution; without them, from the raw one."""
    from specserve.workers.speculation.codec import sparsify
    from specserve.workers.speculation.sampling import draw_token, logits_to_probs

    logits = torch.tensor([0.0, 1.0, 3.0, 2.5, -1.0])
    before = [4, 2, 1]  # token 2 occurred: the penalty divides its logit 3.0 by 2, below token 3's 2.5
    greedy = SamplingParams(temperature=0, repetition_penalty=2.0).for_request(prompt_len=1)
    assert draw_token(logits, greedy, 3, 5, before)[0] == 3
    assert draw_token(logits, greedy, 3, 5)[0] == 2  # the tokens before unknown: uncontrolled
    assert draw_token(logits, SamplingParams(temperature=0), 3, 5, before)[0] == 2  # no control: the raw argmax

    sampled = SamplingParams(temperature=1.0, seed=3, presence_penalty=1.5).for_request(prompt_len=1)
    _, q = draw_token(logits, sampled, 3, 5, before)
    expected = sparsify(logits_to_probs(controlled_logits(logits[None], sampled, before, [])[0], sampled), 5)
    torch.testing.assert_close(q, expected)
    assert q[2] < sparsify(logits_to_probs(logits, sampled), 5)[2]  # generated token 2 penalised
