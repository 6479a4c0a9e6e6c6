"""Structured output under speculation, in process (workers/speculation/grammar.py): greedy output identical to
grammar-constrained target-only decoding (transformers' `generate` with xgrammar's own logits processor, tests/helpers/
grammar_oracle.py) for every drafting method; outputs that parse and validate against their schema (jsonschema), greedy
and sampled; the matcher rolled back to where target-only decoding would be after a rejected drafted span; a tree
pruned of its forbidden nodes; bad schemas refused naming response_format."""

import json

import jsonschema
import pytest
import torch

from specserve.workers.config.request import ResponseFormat, SamplingParams, SpecParams
from specserve.workers.config.settings import ModelConfig
from specserve.workers.errors import InvalidRequestError
from specserve.workers.runtime.loading import load_model
from specserve.workers.runtime.tree_rows import ROOT, TreeRow
from specserve.workers.speculation.engine import SpecEngine
from specserve.workers.speculation.grammar import Grammars
from specserve.workers.speculation.grammar_formats import check_format
from specserve.workers.speculation.grammar_rows import constrain_tree
from specserve.workers.speculation.planner.costs import VerifyCosts
from specserve.workers.speculation.planner.tree import MAX_TREE_NODES
from tests.helpers.eagle_heads import random_head
from tests.helpers.grammar_oracle import ANY_OBJECT, SCHEMAS, compiled_grammar, grammar_greedy
from tests.helpers.greedy_oracle import PROMPTS
from tests.helpers.marks import slow_unless
from tests.helpers.sampler_pool import sample_in_processes
from tests.helpers.sampling_oracle import chi2_pvalue
from tests.helpers.workers import save_perturbed_copy, save_tiny_llama

MAX_NEW = 64
FORMATS = {name: ResponseFormat(type="json_schema", json_schema=json.dumps(s)) for name, s in SCHEMAS.items()}
FORMATS["json_object"] = ResponseFormat(type="json_object")
SCHEMA_OF = dict(SCHEMAS, json_object=ANY_OBJECT)
METHODS = [("draft", 3), ("draft", "auto"), ("ngram", 3), ("eagle", 3), ("eagle+ngram", "auto"), ("eagle-tree", 6),
           ("eagle-tree", "auto"), ("ngram-tree", 6), ("suffix", 3), ("none", 1)]  # fmt: skip

ACCEPTING = ("draft", "ngram", "ngram-tree", "suffix", "eagle+ngram")


@pytest.fixture(scope="module")
def model_paths(models_dir) -> tuple[str, str]:
    """The target and a draft model perturbed from it: (target's directory, draft's)."""
    path = save_tiny_llama(models_dir / "grammar_target", seed=4, layers=8, hidden=32)
    return path, save_perturbed_copy(path, models_dir / "grammar_draft", 0.05, seed=7)


@pytest.fixture(scope="module")
def engine(model_paths):
    path, draft_path = model_paths
    target = load_model(ModelConfig(path=path, device="cpu"))
    head = random_head(target.model.config, 64, seed=2, std=0.3)
    flat = VerifyCosts((1.0,) * (MAX_TREE_NODES + 1))  # k='auto' trees: every node pays
    return SpecEngine(target, load_model(ModelConfig(path=draft_path, device="cpu")), eagle_head=head, tree_costs=flat)


@pytest.fixture(scope="module")
def references(engine):
    target = engine.target
    refs = {}
    for name, schema in SCHEMA_OF.items():
        for prompt in PROMPTS[:2]:
            refs[name, prompt] = grammar_greedy(target, target.tokenizer(prompt)["input_ids"], MAX_NEW, schema)
    plain = engine.generate(PROMPTS[0], SamplingParams(max_new_tokens=MAX_NEW), SpecParams(method="none"))
    assert all(refs[name, PROMPTS[0]] != plain.token_ids for name in SCHEMA_OF)  # the grammar changes the output
    return refs


# the fast loop: one of each drafting kind (the draft model's and the head's chains run in the served grammar tests)
@pytest.mark.parametrize(
    ("method", "k"),
    slow_unless(METHODS, [("ngram", 3), ("eagle-tree", 6), ("ngram-tree", 6), ("suffix", 3), ("none", 1)]),
)
def test_greedy_under_a_grammar_is_identical_to_constrained_target_only(engine, references, method, k):
    drafted = accepted = 0
    for (name, prompt), expected in references.items():
        params = SamplingParams(max_new_tokens=MAX_NEW, response_format=FORMATS[name])
        result = engine.generate(prompt, params, SpecParams(method=method, k=k))
        assert result.token_ids == expected, (name, prompt)
        drafted, accepted = drafted + result.stats.drafted, accepted + result.stats.accepted
    assert method == "none" or drafted > 0
    if method in ACCEPTING:  # a random head's drafts rarely survive a grammar: the others' do, and are rejected too
        assert drafted > accepted > 0


@pytest.mark.slow  # 31 s: the fast loop must stay under 5 minutes; CI runs it
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_outputs_parse_and_validate_against_their_schema(engine, temperature):
    finished = 0
    for name, fmt in FORMATS.items():
        for seed, prompt in enumerate(PROMPTS):
            params = SamplingParams(max_new_tokens=MAX_NEW, temperature=temperature, seed=seed, response_format=fmt)
            result = engine.generate(prompt, params, SpecParams(method="draft", k=4))
            if result.finish_reason == "length":
                continue  # a random model may still be inside a value: every prefix it wrote is valid JSON so far
            finished += 1
            jsonschema.validate(json.loads(result.text), SCHEMA_OF[name])
    assert finished >= len(FORMATS) * len(PROMPTS) // 2


def _mask(grammar) -> torch.Tensor:
    return grammar._mask_row()[0]


def test_a_rejected_span_leaves_the_matcher_where_target_only_would_be(engine):
    tok = engine.tokenizer
    grammars = Grammars(tok, engine.verifier.vocab_size, engine.target.eos_token_ids)
    ids = lambda text: tok(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    state = grammars.for_request("r", FORMATS["flags"])
    state.sync(ids('{"ok'))
    good, forbidden = ids('": true, "c'), ids("}")
    length, allowed = state.chain(good + forbidden + ids('olour"'), keep_forbidden=False)
    assert length == len(good) and allowed.shape[0] == len(good) + 1  # the chain ends at the forbidden "}"
    assert not allowed[-1, forbidden[0]] and allowed[0, good[0]]
    length, _ = state.chain(good + forbidden, keep_forbidden=True)
    assert length == len(good) + 1  # a sampled chain keeps it: rejected for certain, the residual drawn there
    # verification accepted two of the span and recovered a third token: the matcher follows the committed tokens
    committed = ids('{"ok') + good[:2] + ids(" ")
    state.sync(committed)
    fresh = grammars.for_request("fresh", FORMATS["flags"])
    fresh.sync(committed)
    assert torch.equal(_mask(state), _mask(fresh)) and state.fed == committed
    state.sync(ids('{"ok'))  # and back
    fresh2 = Grammars(tok, engine.verifier.vocab_size, engine.target.eos_token_ids).for_request("f", FORMATS["flags"])
    fresh2.sync(ids('{"ok'))
    assert torch.equal(_mask(state), _mask(fresh2))


def test_a_tree_loses_its_forbidden_nodes_and_their_subtrees(engine):
    tok = engine.tokenizer
    grammars = Grammars(tok, engine.verifier.vocab_size, engine.target.eos_token_ids)
    one = lambda text: tok(text, add_special_tokens=False)["input_ids"][0]  # noqa: E731
    prefix = tok('{"ok": ', add_special_tokens=False)["input_ids"]
    # root -> t (ok) -> r (ok); root -> x (forbidden) -> y; root -> f (ok)
    tokens, parents = [one("t"), one("r"), one("x"), one("y"), one("f")], [ROOT, 0, ROOT, 2, ROOT]
    params = SamplingParams(response_format=FORMATS["flags"], prompt_len=3)
    pruned = constrain_tree(grammars, TreeRow("r", [5, 6, 7, *prefix], tokens, parents), params)
    assert pruned.kept == [0, 1, 4] and list(pruned.tree.parents) == [ROOT, 0, ROOT]
    assert pruned.allowed.shape[0] == 4 and pruned.allowed[0, one("t")] and not pruned.allowed[0, one("x")]


def test_schemas_the_engine_cannot_enforce_are_refused_naming_response_format(engine):
    for bad in ['{"type": "no such type"}', "[1, 2]", "{not json"]:
        with pytest.raises(InvalidRequestError) as e:
            check_format(ResponseFormat(type="json_schema", json_schema=bad))
        assert e.value.field == "response_format.json_schema"
    params = SamplingParams(max_new_tokens=4, response_format=ResponseFormat(type="json_schema", json_schema="{no"))
    with pytest.raises(InvalidRequestError, match="response_format"):
        engine.generate(PROMPTS[0], params, SpecParams(method="none"))


ENUM = {"enum": ["ab", "ac", "b", "cab"]}  # every output whole: a few tokens each, EOS after the closing quote


def _exact_outputs(target, prompt_ids: list[int], schema: dict) -> dict[tuple[int, ...], float]:
    """Each output the grammar allows (EOS included) -> its probability under target-only sampling at temperature 1
    with the grammar's mask, enumerated with xgrammar's own matcher and a cache-free forward."""
    import xgrammar as xgr

    matcher, vocab = xgr.GrammarMatcher(compiled_grammar(target, schema)), target.vocab_size
    bitmask, joint = xgr.allocate_token_bitmask(1, vocab), {}

    def walk(prefix: list[int], prob: float) -> None:
        matcher.fill_next_token_bitmask(bitmask)
        allowed = [t for t in range(vocab) if (int(bitmask[0, t // 32]) >> (t % 32)) & 1]
        with torch.no_grad():
            logits = target.model(torch.tensor([prompt_ids + prefix])).logits[0, -1].float()
        p = torch.softmax(logits[allowed], -1)
        for token, q in zip(allowed, p.tolist(), strict=True):
            if token in target.eos_token_ids:
                joint[(*prefix, token)] = prob * q
            elif q * prob > 1e-12:
                assert matcher.accept_token(token)
                walk([*prefix, token], prob * q)
                matcher.rollback(1)

    walk([], 1.0)
    return joint


@pytest.mark.slow
@pytest.mark.parametrize(("method", "k"), [("draft", 4), ("ngram-tree", 6)])
def test_sampling_under_a_grammar_draws_from_the_constrained_distribution(engine, model_paths, method, k):
    prompt = PROMPTS[0]
    ids = engine.tokenizer(prompt)["input_ids"]
    joint = _exact_outputs(engine.target, ids, ENUM)
    assert len(joint) == 4 and max(joint.values()) < 0.97  # four outputs, none (nearly) certain
    fmt = ResponseFormat(type="json_schema", json_schema=json.dumps(ENUM))
    params = SamplingParams(max_new_tokens=12, temperature=1.0, response_format=fmt)
    drawn = sample_in_processes(*model_paths, "cpu", prompt, params, SpecParams(method=method, k=k), list(range(300)))
    assert drawn.drafted > 0 and chi2_pvalue(drawn.outputs, joint) > 1e-3
