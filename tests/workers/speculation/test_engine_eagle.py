"""EAGLE-3 drafting in the in-process engine (method "eagle"): greedy output identical to target-only with random and
trained heads, sampling that draws from the target's own distribution (the exact test of test_engine_sampling.py),
the features the target's forward captures (the lean path equals Hugging Face's hidden_states; nothing is kept when
capture is off), the hand-over of committed positions' features to the head, and loading checks."""

import dataclasses

import pytest
import torch

from specserve.workers.config.request import SamplingParams, SpecParams
from specserve.workers.config.settings import KVCacheConfig, ModelConfig
from specserve.workers.errors import InvalidRequestError, ModelLoadError
from specserve.workers.models.identity import target_identity
from specserve.workers.runtime.lean_forward import full_forward
from specserve.workers.runtime.loading import load_model
from specserve.workers.runtime.runner import ForwardRow, ModelRunner
from specserve.workers.speculation.drafter import DraftRow
from specserve.workers.speculation.eagle.checkpoint import save_head
from specserve.workers.speculation.eagle.config import Eagle3Config, default_feature_layers
from specserve.workers.speculation.eagle.head import Eagle3Head
from specserve.workers.speculation.eagle.loading import load_eagle_drafter
from specserve.workers.speculation.engine import SpecEngine
from specserve.workers.speculation.planner.chain import ChainPlanner
from specserve.workers.speculation.planner.costs import VerifyCosts
from specserve.workers.speculation.planner.tree import MAX_TREE_NODES
from specserve.workers.speculation.round_drafting import TreeRounds
from specserve.workers.training.eagle_train import train_head
from tests.helpers.eagle_data import FIRST_TOKEN, write_tiny_eagle_data
from tests.helpers.eagle_heads import hf_features, random_head
from tests.helpers.greedy_oracle import PROMPTS, own_greedy_loop
from tests.helpers.marks import slow_unless
from tests.helpers.sampler_pool import sample_in_processes
from tests.helpers.sampling_oracle import NEW, PROMPT, chi2_pvalue, exact_joint, marginal_tv
from tests.helpers.workers import save_tiny_llama

LAYERS, HIDDEN = 8, 32  # feature layers (2, 4, 5)
MAX_NEW = 24


@pytest.fixture(scope="module")
def target(models_dir, device):
    path = save_tiny_llama(models_dir / "eagle_target", seed=4, layers=LAYERS, hidden=HIDDEN)
    return load_model(ModelConfig(path=path, device=device))


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A peaked tiny-vocabulary target and a head trained on its greedy answers for about a second."""
    root = tmp_path_factory.mktemp("eagle_engine")
    path = save_tiny_llama(root / "target", seed=3, layers=LAYERS, hidden=HIDDEN, tiny_vocab=True, init_range=0.5)
    data = write_tiny_eagle_data(path, root / "train", sequences=64, seed=1)
    settings = {"epochs": 12, "ttt_steps": 3, "draft_vocab_size": 6, "lr": 3e-3, "batch_tokens": 512, "seed": 0}
    result = train_head(data, path, root / "head", progress=False, **settings)
    return load_model(ModelConfig(path=path, device="cpu")), result.head_dir


@pytest.mark.parametrize(
    ("draft_vocab", "method"), slow_unless([(64, "eagle"), (259, "eagle"), (64, "eagle+ngram")], [(64, "eagle")])
)  # a reduced draft vocabulary and the whole one; the head's chain competing with prompt lookup
def test_greedy_eagle_is_identical_to_target_only(target, draft_vocab, method):
    engine = SpecEngine(target, eagle_head=random_head(target.model.config, draft_vocab, seed=draft_vocab))
    drafted = 0
    for prompt in PROMPTS:
        ids = target.tokenizer(prompt)["input_ids"]
        expected = own_greedy_loop(target.model, ids, MAX_NEW, target.eos_token_ids)
        for k in (1, 3, 5, "auto"):
            result = engine.generate(prompt, SamplingParams(max_new_tokens=MAX_NEW), SpecParams(method=method, k=k))
            assert result.token_ids == expected, (prompt, k)
            drafted += result.stats.drafted
            reached, accepted = result.stats.reached_by_position, result.stats.accepted_by_position
            assert sum(reached) == result.stats.drafted and all(a <= r for a, r in zip(accepted, reached, strict=True))
    assert drafted > 0
    assert engine.verifier.runner.store.used_tokens == 0 and not engine.drafters["eagle"].drafting._requests
    costs = engine.planner_costs()  # measured once, on the first k='auto' request
    assert costs.verify.max_k == engine.max_auto_k and all(t > 0 for t in costs.verify.verify_s)


def test_eagle_and_ngram_take_turns_and_stay_identical(target):
    """A prompt that repeats itself: prompt lookup's long matches win some rounds, the head the others."""
    engine = SpecEngine(target, eagle_head=random_head(target.model.config, 64, seed=1))
    sources = []
    planner_plan = ChainPlanner.plan

    def spy(self, tokens, k, budget):
        plan = planner_plan(self, tokens, k, budget)
        sources.append(plan.chain.source)
        return plan

    prompt = target.tokenizer("one two three four one two three four one two")["input_ids"]
    expected = own_greedy_loop(target.model, prompt, MAX_NEW, target.eos_token_ids)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ChainPlanner, "plan", spy)
        result = engine.generate(prompt, SamplingParams(max_new_tokens=MAX_NEW), SpecParams(method="eagle+ngram", k=3))
    assert result.token_ids == expected
    assert {"head", "ngram"} <= set(sources), sources


@pytest.mark.slow  # 8 s
def test_a_trained_head_accepts_more_than_a_random_one_and_output_stays_identical(trained):
    loaded, head_dir = trained
    engines = {
        "trained": SpecEngine(loaded, eagle_head=head_dir),
        "random": SpecEngine(loaded, eagle_head=random_head(loaded.model.config, 6, seed=0)),
    }
    counts = {name: [0, 0] for name in engines}  # accepted, drafted
    g = torch.Generator().manual_seed(7)
    params = SamplingParams(max_new_tokens=16, stop_at_eos=False)
    for _ in range(6):  # prompts like the training data's: random tokens, no BOS
        prompt = torch.randint(FIRST_TOKEN, 8, (int(torch.randint(3, 9, (1,), generator=g)),), generator=g).tolist()
        expected = own_greedy_loop(loaded.model, prompt, 16, set())
        for name, engine in engines.items():
            for k in (1, 3, 5):
                result = engine.generate(prompt, params, SpecParams(method="eagle", k=k))
                assert result.token_ids == expected, (name, prompt, k)
                counts[name][0] += result.stats.accepted
                counts[name][1] += result.stats.drafted
    rates = {name: accepted / drafted for name, (accepted, drafted) in counts.items()}
    assert rates["trained"] > rates["random"] + 0.15, rates  # measured: 0.32 vs 0.04


def test_the_head_gets_each_committed_positions_target_features_once(trained):
    loaded, head_dir = trained
    engine = SpecEngine(loaded, eagle_head=head_dir)
    drafter = engine.drafters["eagle"]
    handed, add = [], drafter.add_features

    def spy(request_id, start, features):
        handed.append((start, features.clone()))
        add(request_id, start, features)

    drafter.add_features = spy
    prompt = [3, 5, 4, 7, 6]
    for temperature in (0.0, 1.0):
        handed.clear()
        params = SamplingParams(temperature=temperature, max_new_tokens=20, stop_at_eos=False, seed=1)
        result = engine.generate(prompt, params, SpecParams(method="eagle", k=3))
        assert result.stats.accepted > 0  # rounds that commit drafted positions as well as the bonus one
        ends = [start + len(f) for start, f in handed]
        assert [start for start, _ in handed] == [0, *ends[:-1]]  # each position once, in order
        sequence = prompt + result.token_ids
        assert ends[-1] == len(sequence) - 1  # all but the newest token, whose feature the next verify would compute
        want = hf_features(loaded.model, sequence)[:-1]
        torch.testing.assert_close(torch.cat([f for _, f in handed]), want, atol=1e-3, rtol=1e-3)  # cached vs not


def test_a_head_request_after_target_only_ones_drafts_as_on_a_fresh_engine(trained):
    """The target's prefix cache holds prompts that target-only requests computed, without the head: a head's request
    takes from it only what the head holds (none here), so its head reads every prompt position, and it drafts and
    accepts exactly as on an engine that never saw the prompt (sglang #31600: 0.98 -> 0.10 acceptance otherwise). A
    second head request takes both caches over."""
    loaded, head_dir = trained
    prompt = [FIRST_TOKEN + (3 * i) % 5 for i in range(40)]  # past PREFIX_MIN_TOKENS: the target would reuse it
    params, spec = SamplingParams(max_new_tokens=16, stop_at_eos=False), SpecParams(method="eagle", k=3)
    fresh = SpecEngine(loaded, eagle_head=head_dir).generate(prompt, params, spec)
    engine = SpecEngine(loaded, eagle_head=head_dir)
    engine.generate(prompt, params, SpecParams(method="none"))
    store, head = engine.verifier.runner.store, engine.drafters["eagle"]
    after_plain = engine.generate(prompt, params, spec)
    assert after_plain.token_ids == fresh.token_ids == own_greedy_loop(loaded.model, prompt, 16, set())
    on, alone = after_plain.stats, fresh.stats
    assert (on.rounds, on.drafted, on.accepted) == (alone.rounds, alone.drafted, alone.accepted) and on.accepted > 0
    assert head.prefix_queries == 0 and store.prefix_hits == 0  # nothing served that the head lacked
    again = engine.generate(prompt, params, spec)  # the head retained this prompt's cache: both take it over
    assert again.token_ids == fresh.token_ids and store.prefix_hits > 0 and head.prefix_hits == store.prefix_hits


def test_forgetting_prefixes_makes_the_next_request_start_cold_on_the_target_and_the_head(trained):
    """The bench's rows start cold (forget_prefixes before each): a row after another on the same prompt computes it
    all again, as the first did, and drafts as on a fresh engine."""
    loaded, head_dir = trained
    prompt = [FIRST_TOKEN + (3 * i) % 5 for i in range(40)]
    params, spec = SamplingParams(max_new_tokens=16, stop_at_eos=False), SpecParams(method="eagle", k=3)
    engine = SpecEngine(loaded, eagle_head=head_dir)
    first = engine.generate(prompt, params, spec)
    store, head = engine.verifier.runner.store, engine.drafters["eagle"]
    assert store.cached_tokens > 0 and head.held_prefix(prompt) > 0
    engine.forget_prefixes()
    assert store.cached_tokens == 0 and head.held_prefix(prompt) == 0
    hits = store.prefix_hits
    again = engine.generate(prompt, params, spec)
    assert again.token_ids == first.token_ids and store.prefix_hits == hits  # nothing taken from a cache
    assert (again.stats.rounds, again.stats.accepted) == (first.stats.rounds, first.stats.accepted)


def test_captured_features_are_the_inputs_of_the_feature_layers(target):
    """Lean capture equals Hugging Face's hidden_states in the same pass, bit for bit, for a prefill, a verify and a
    ragged (left-padded) batch after a rollback; the logits are those of a runner that captures nothing."""
    layers = default_feature_layers(LAYERS)
    lean, full, plain = (ModelRunner(target, KVCacheConfig()) for _ in range(3))
    full.lean, full._forward = False, full_forward(target.model)
    lean.capture_features(layers)
    full.capture_features(layers)
    assert lean.lean
    prompt, other = list(range(3, 23)), list(range(60, 70))
    steps = [
        [ForwardRow("a", prompt, 1)],  # prefill
        [ForwardRow("a", prompt + [40, 41, 42], 4)],  # verify 3 drafted tokens
        [ForwardRow("a", prompt + [40, 50], 2), ForwardRow("b", other, 3)],  # after a rollback, a prefill beside it
    ]
    for rows in steps:
        outs = [runner.forward_batch(rows, capture=runner is not plain) for runner in (lean, full, plain)]
        for row, ours, theirs, uncaptured in zip(rows, *outs, strict=True):
            sequence = row.sequence
            assert uncaptured.features is None
            assert torch.equal(ours.logits, uncaptured.logits) and torch.equal(theirs.logits, uncaptured.logits)
            assert ours.start == theirs.start and ours.features.shape == (len(sequence) - ours.start, 3 * HIDDEN)
            assert torch.equal(ours.features, theirs.features)
            want = hf_features(target.model, sequence)[ours.start :]
            torch.testing.assert_close(ours.features, want, atol=1e-4, rtol=1e-4)


def test_capture_off_keeps_no_hidden_states(target, monkeypatch):
    asked = []
    forward = target.model.forward
    monkeypatch.setattr(
        target.model, "forward", lambda *a, **kw: asked.append(kw.get("output_hidden_states")) or forward(*a, **kw)
    )
    runner = ModelRunner(target, KVCacheConfig())
    runner.lean, runner._forward = False, full_forward(target.model)
    rows = [ForwardRow("a", list(range(3, 12)), 1)]
    asked.clear()  # the runner's lean-path probe ran the model
    assert runner.forward_batch(rows)[0].features is None
    assert asked == [None]  # the model was not asked for its hidden states
    with pytest.raises(ValueError, match="capture_features"):
        runner.forward_batch(rows, capture=True)
    runner.capture_features((1, 2, 5))
    assert runner.forward_batch(rows, capture=True)[0].features.shape == (1, 3 * HIDDEN)
    assert asked[-1] is True
    lean = ModelRunner(target, KVCacheConfig())
    assert lean.lean and lean.forward_batch(rows)[0].features is None
    engine = SpecEngine(target)  # no head: no capture
    assert engine.verifier.runner.capture_layers is None and engine.verifier.runner._capture_forward is None


def test_propose_batch_equals_each_row_alone_and_samples_from_sparse_probs(target):
    head = random_head(target.model.config, 64, seed=1, std=0.3)
    features = torch.randn(3, 12, 3 * HIDDEN, generator=torch.Generator().manual_seed(0)) * 3
    tokens = [list(range(3 + r, 16 + r)) for r in range(3)]  # 13 committed tokens: 12 entries each
    greedy, sampled = SamplingParams(), SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=5)
    rows = [
        DraftRow("a", tokens[0], 4, sampled),
        DraftRow("b", tokens[1], 2, greedy),
        DraftRow("c", tokens[2], 5, sampled),
    ]
    batched, alone = load_eagle_drafter(target, head), load_eagle_drafter(target, head)
    for r, row in enumerate(rows):
        batched.add_features(row.request_id, 0, features[r])
        alone.add_features(row.request_id, 0, features[r])
    together = batched.propose_batch(rows)
    for row, proposal in zip(rows, together, strict=True):
        single = alone.propose(*row)
        assert proposal.tokens == single.tokens and len(proposal.tokens) == row.k
        if row.params.greedy:
            assert proposal.probs is None and single.probs is None
        else:
            torch.testing.assert_close(proposal.probs, single.probs, atol=1e-3, rtol=0)
            assert proposal.probs.shape == (row.k, target.vocab_size)
            assert not proposal.probs[:, ~head.t2d.to(proposal.probs.device)].any()  # no mass off the draft vocabulary
            assert torch.equal(proposal.probs.half().float(), proposal.probs)  # float16-exact, as shipped
            assert all(proposal.probs[j, t] > 0 for j, t in enumerate(proposal.tokens))
    drafted = head.draft_to_target(torch.arange(64, device=head.d2t.device)).tolist()
    assert all(t in drafted for p in together for t in p.tokens)


def test_features_that_start_earlier_roll_the_head_back(target):
    """A target that recomputed positions (its cache was cut) hands their features again: the head rolls back and
    drafts what a head fed the final features from scratch drafts."""
    head = random_head(target.model.config, 64, seed=2, std=0.3)
    g = torch.Generator().manual_seed(3)
    first, second = torch.randn(12, 3 * HIDDEN, generator=g), torch.randn(12, 3 * HIDDEN, generator=g)
    tokens = list(range(3, 16))
    drafter, fresh = load_eagle_drafter(target, head), load_eagle_drafter(target, head)
    assert drafter.propose("r", tokens[:9], 3, SamplingParams()).tokens == []  # before the first verify: nothing
    drafter.add_features("r", 0, first[:8])
    drafter.propose("r", tokens[:9], 3, SamplingParams())
    drafter.add_features("r", 5, second[5:])
    fresh.add_features("r", 0, torch.cat([first[:5], second[5:]]))
    assert (
        drafter.propose("r", tokens, 4, SamplingParams()).tokens
        == fresh.propose("r", tokens, 4, SamplingParams()).tokens
    )
    assert drafter.drafting.length("r") == 12
    with pytest.raises(InvalidRequestError, match="committed tokens need entries"):
        drafter.propose("r", tokens + [20, 21], 2, SamplingParams())  # features of 12, 13 never came
    drafter.release("r")
    assert drafter.drafting.length("r") == 0


def test_a_row_of_k_0_only_extends_its_cache_beside_drafting_rows(target):
    """A prompt's chunk fed to the head (k = 0, features): its entries are added in the drafting rows' pass, nothing
    is drafted for it, and its later draft equals a head's that got every feature at once."""
    head = random_head(target.model.config, 64, seed=6, std=0.3)
    g = torch.Generator().manual_seed(7)
    first, rest, other = (torch.randn(n, 3 * HIDDEN, generator=g) for n in (8, 4, 12))
    tokens, a = list(range(3, 16)), list(range(30, 43))
    drafter, fresh, alone = (load_eagle_drafter(target, head) for _ in range(3))
    drafter.add_features("r", 0, first)
    for d in (drafter, alone):
        d.add_features("a", 0, other)
    fed, drafting = drafter.propose_batch([DraftRow("r", tokens[:9], 0, SamplingParams()),
                                           DraftRow("a", a, 3, SamplingParams())])  # fmt: skip
    assert fed.tokens == [] and drafter.drafting.length("r") == 8
    assert drafting.tokens == alone.propose("a", a, 3, SamplingParams()).tokens
    drafter.add_features("r", 8, rest)
    fresh.add_features("r", 0, torch.cat([first, rest]))
    assert (
        drafter.propose("r", tokens, 4, SamplingParams()).tokens
        == fresh.propose("r", tokens, 4, SamplingParams()).tokens
    )


def test_a_new_request_copies_a_running_requests_head_entries_of_their_shared_prompt(target):
    """A target that served a new request's prompt from a running request's cache (kv_cache.py) sends features from
    there on only: the head copies the running request's entries before that, drafts as a head fed every feature
    drafts, and the running request goes on as it would alone."""
    head = random_head(target.model.config, 64, seed=4, std=0.3)
    g = torch.Generator().manual_seed(5)
    features, own, more = (torch.randn(n, 3 * HIDDEN, generator=g) for n in (16, 2, 1))
    tokens = list(range(3, 20))  # 17 committed tokens: 16 entries
    drafter, fresh, alone = (load_eagle_drafter(target, head) for _ in range(3))
    for d in (drafter, alone):
        d.add_features("a", 0, features)
        d.propose("a", tokens, 3, SamplingParams())
    other = tokens[:12] + [30, 31]  # entry i reads feature i and token i + 1: entries 0..10 are a's
    assert drafter.held_prefix(other) == 11
    drafter.add_features("b", 11, own)  # its target computed positions 11 and 12 only
    fresh.add_features("b", 0, torch.cat([features[:11], own]))
    assert (
        drafter.propose("b", other, 4, SamplingParams()).tokens == fresh.propose("b", other, 4, SamplingParams()).tokens
    )
    assert drafter.prefix_hits == drafter.prefix_queries == 11
    for d in (drafter, alone):
        d.add_features("a", 16, more)
    nxt = tokens + [25]
    assert drafter.propose("a", nxt, 4, SamplingParams()).tokens == alone.propose("a", nxt, 4, SamplingParams()).tokens
    assert drafter.held_prefix(other) == 13  # b's own now
    drafter.release("a")
    drafter.release("b")
    assert drafter.held_prefix(other) == 0  # a running request's cache counts while it runs (released without tokens)


def test_a_head_that_does_not_fit_the_target_is_refused(target, tmp_path):
    other = save_tiny_llama(tmp_path / "other", seed=9, layers=LAYERS, hidden=HIDDEN)
    config = Eagle3Config.for_target(target.model.config, 64, target_identity=target_identity(other))
    save_head(Eagle3Head(config), tmp_path / "foreign")
    with pytest.raises(ModelLoadError, match="a head for another target"):
        SpecEngine(target, eagle_head=tmp_path / "foreign")
    save_head(Eagle3Head(dataclasses.replace(config, target_identity=target_identity(target.path))), tmp_path / "own")
    assert SpecEngine(target, eagle_head=tmp_path / "own").verifier.runner.capture_layers == (2, 4, 5)
    for bad in (dataclasses.replace(config, feature_layers=(2, 4, 9)), dataclasses.replace(config, vocab_size=300)):
        with pytest.raises(ModelLoadError, match="does not fit this target"):
            SpecEngine(target, eagle_head=Eagle3Head(bad))
    with pytest.raises(InvalidRequestError, match="'eagle' drafting needs an EAGLE-3 head"):
        SpecEngine(target).generate("hi", SamplingParams(max_new_tokens=2), SpecParams(method="eagle"))


@pytest.fixture(scope="module")
def sampling_target(models_dir) -> tuple[str, str]:
    """A 4-layer tiny-vocabulary target (feature layers 2, 2, 1) and a peaked random head over 5 of its 8 tokens."""
    path = save_tiny_llama(models_dir / "tv_eagle", seed=10, layers=4, hidden=16, tiny_vocab=True, init_range=0.5)
    config = load_model(ModelConfig(path=path, device="cpu")).model.config
    return path, str(save_head(random_head(config, 5, seed=4, std=0.5), models_dir / "tv_eagle_head", torch.float32))


@pytest.mark.slow
@pytest.mark.parametrize(
    ("method", "k", "samples"),
    [("eagle", 2, 5_000), ("eagle+ngram", 2, 5_000), ("eagle-tree", 4, 3_000), ("eagle-tree+ngram", 4, 3_000)],
)
def test_eagle_sampling_matches_target_distribution(sampling_target, device, method, k, samples):
    """About a minute each on 2 cores: top-p truncates both distributions, and the head never proposes 3 of the 8
    tokens, so the target's mass there comes only through recovered tokens; with eagle+ngram the prompt's repeats
    make prompt lookup's one-hot drafts win some rounds; eagle-tree's trees of 4 nodes (2 candidates a level) go
    through recursive rejection sampling over each node's candidates (fewer requests: a tree round costs more)."""
    path, head_dir = sampling_target
    model = load_model(ModelConfig(path=path, device=device)).model
    V = model.config.vocab_size
    params = SamplingParams(temperature=1.0, top_p=0.8, max_new_tokens=NEW, stop_at_eos=False)
    joint = exact_joint(model, params, V)
    spec = SpecParams(method=method, k=k)  # after the prefill's round, 2 of the NEW = 3 tokens are left to draft
    drawn = sample_in_processes(path, None, device, PROMPT, params, spec, list(range(samples)), eagle_head=head_dir)
    outputs = drawn.outputs
    assert len(outputs) == samples
    assert drawn.accepted > 0.2 * samples  # speculation really happened (measured: 0.35 per request)
    assert chi2_pvalue(outputs, joint) > 1e-3
    for pos in range(NEW):
        assert marginal_tv(outputs, joint, pos, V) <= 0.03


@pytest.mark.parametrize("budget", [1, 4, 8, 16])
def test_greedy_eagle_trees_are_identical_to_target_only(target, budget):
    """Trees of 1 node (a chain of one), 2 candidates a level, 4 a level; the head's cache and the target's stay
    consistent round after round (accepted paths kept, the rest dropped)."""
    engine = SpecEngine(target, eagle_head=random_head(target.model.config, 64, seed=2, std=0.3))
    accepted = drafted = 0
    for prompt in PROMPTS:
        ids = target.tokenizer(prompt)["input_ids"]
        expected = own_greedy_loop(target.model, ids, MAX_NEW, target.eos_token_ids)
        result = engine.generate(prompt, SamplingParams(max_new_tokens=MAX_NEW), SpecParams(method="eagle-tree",
                                                                                               k=budget))  # fmt: skip
        assert result.token_ids == expected, (prompt, budget)
        accepted, drafted = accepted + result.stats.accepted, drafted + result.stats.drafted
        assert result.stats.drafted <= (result.stats.rounds - 1) * budget
    assert drafted > 0 and accepted > 0
    assert engine.verifier.runner.store.used_tokens == 0 and not engine.drafters["eagle"].drafting._requests


def test_greedy_auto_trees_of_a_trained_head_are_identical_to_target_only(trained):
    """k='auto' weighs verify costs; measured ones may make no tree pay on a tiny model, flat ones make all of it
    pay: whole trees verified round after round, some of their paths accepted (a head whose trees are accepted: one
    whose are not backs off to plain steps)."""
    loaded, head_dir = trained
    engine = SpecEngine(loaded, eagle_head=head_dir, tree_costs=VerifyCosts((1.0,) * (MAX_TREE_NODES + 1)))
    g = torch.Generator().manual_seed(11)
    params = SamplingParams(max_new_tokens=MAX_NEW, stop_at_eos=False)
    accepted = drafted = 0
    prompts = [torch.randint(FIRST_TOKEN, 8, (int(torch.randint(3, 9, (1,), generator=g)),), generator=g).tolist()
               for _ in range(4)]  # fmt: skip
    for prompt in prompts:
        result = engine.generate(prompt, params, SpecParams(method="eagle-tree", k="auto"))
        assert result.token_ids == own_greedy_loop(loaded.model, prompt, MAX_NEW, set())
        accepted, drafted = accepted + result.stats.accepted, drafted + result.stats.drafted
        assert result.stats.drafted <= (result.stats.rounds - 1) * MAX_TREE_NODES
    assert accepted > 0 and drafted > (MAX_TREE_NODES - 1) * len(prompts)  # every node paid: whole trees verified
    assert engine.verifier.runner.store.used_tokens == 0 and not engine.drafters["eagle"].drafting._requests


@pytest.mark.slow  # 12 s
def test_a_head_slower_than_its_trees_save_backs_off_to_plain_steps(trained, target, monkeypatch):
    """k='auto' compares drafting a tree with not drafting one, by the trees as verified: a trained head whose
    drafting costs more than its nodes save (20 ms a tree beside a 4 ms step, as an eager bf16 head beside a graphed
    target on the H200) runs plain steps with rare probes; the same head beside a slow step (1 s) drafts every round;
    a random head, whose trees are never accepted, backs off beside the slow step too (its drafting buys nothing).
    All identical to target-only."""
    import time

    from specserve.workers.speculation.eagle.drafter import EagleDrafter

    loaded, head_dir = trained
    propose = EagleDrafter.propose_tree
    trees = []

    def slow(self, *args):
        time.sleep(0.02)
        tree = propose(self, *args)
        trees.append(tree is not None)
        return tree

    monkeypatch.setattr(EagleDrafter, "propose_tree", slow)
    g = torch.Generator().manual_seed(5)
    tiny = [torch.randint(FIRST_TOKEN, 8, (int(torch.randint(3, 9, (1,), generator=g)),), generator=g).tolist()
            for _ in range(4)]  # fmt: skip
    byte = [target.tokenizer(prompt)["input_ids"] for prompt in PROMPTS]  # 259 tokens: a random head's guesses miss
    random = random_head(target.model.config, 64, seed=2, std=0.3)
    params = SamplingParams(max_new_tokens=MAX_NEW, stop_at_eos=False)
    drafted, accepted = {}, {}
    for name, model, head, prompts, step_s in (("trained", loaded, head_dir, tiny, 0.004),
                                               ("trained", loaded, head_dir, tiny, 1.0),
                                               ("random", target, random, byte, 1.0)):  # fmt: skip
        engine = SpecEngine(model, eagle_head=head, tree_costs=VerifyCosts((step_s,) * (MAX_TREE_NODES + 1)))
        trees.clear()
        rounds = tree_accepted = 0
        for prompt in prompts:
            result = engine.generate(prompt, params, SpecParams(method="eagle-tree", k="auto"))
            assert result.token_ids == own_greedy_loop(model.model, prompt, MAX_NEW, set())
            rounds += result.stats.rounds
            tree_accepted += result.stats.accepted
        drafted[name, step_s], accepted[name, step_s] = sum(trees) / rounds, tree_accepted
    assert accepted["trained", 1.0] > MAX_NEW and accepted["random", 1.0] < 4  # what each head's trees are worth
    assert drafted["trained", 1.0] > 0.8  # every round but the prompt's drafts a tree
    assert drafted["trained", 0.004] < 0.25  # each request's first tree or two, then plain steps
    # Trees accepting nothing, then plain steps between probes: a probe here loses ~20 ms of a 1 s round, so one
    # plain round keeps its loss within PROBE_SHARE (before, this head drafted every round)
    assert drafted["random", 1.0] < 0.6


@pytest.mark.parametrize("k", [4, "auto"])
def test_head_trees_beside_lookups_are_identical_to_target_only(target, k):
    """eagle-tree+ngram in process: the head's trees, and prompt lookup's continuations (verified as chain-shaped
    trees) in the rounds where they are expected to accept more; prompts that repeat themselves give them rounds."""
    flat = VerifyCosts((1.0,) * (MAX_TREE_NODES + 1))
    engine = SpecEngine(target, eagle_head=random_head(target.model.config, 64, seed=2, std=0.3), tree_costs=flat)
    planned = []
    plan = TreeRounds.plan

    def spy(self, state):
        out = plan(self, state)
        planned.append("lookup" if out.chain.k else "tree" if out.nodes else "plain")
        return out

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(TreeRounds, "plan", spy)
        for prompt in PROMPTS:
            ids = target.tokenizer(" ".join([prompt] * 3))["input_ids"]
            expected = own_greedy_loop(target.model, ids, MAX_NEW, target.eos_token_ids)
            result = engine.generate(ids, SamplingParams(max_new_tokens=MAX_NEW), SpecParams(method="eagle-tree+ngram",
                                                                                                k=k))  # fmt: skip
            assert result.token_ids == expected, (prompt, k)
    assert {"lookup", "tree"} <= set(planned), planned
    assert engine.verifier.runner.store.used_tokens == 0 and not engine.drafters["eagle"].drafting._requests


def test_tree_verify_costs_are_measured_up_to_a_whole_trees_width(target):
    engine = SpecEngine(target, eagle_head=random_head(target.model.config, 64, seed=2))
    costs = engine.tree_verify_costs()
    assert costs.max_k == MAX_TREE_NODES and all(t > 0 for t in costs.verify_s) and engine.tree_verify_costs() is costs
