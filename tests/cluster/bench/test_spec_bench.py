"""`specserve bench --spec-bench FILE`: Spec-Bench's question.jsonl read as it is, its MT-bench categories folded into
mt_bench, per-category selection, multi-turn conversations through the chat template, figures per category, and a
short end-to-end run on a tiny target."""

import json
import shutil

import pytest

from specserve.cluster.bench.rows import BenchConfig, Row, parse_ks, parse_methods, plan_rows
from specserve.cluster.bench.spec_bench import (
    CATEGORIES,
    answer_text,
    category_figures,
    converse,
    fill_categories,
    parse_question,
    read_spec_bench,
    select_per_category,
    spec_bench_prompts,
)
from specserve.cluster.cli.main import main
from specserve.workers.config.settings import ModelConfig
from specserve.workers.errors import InvalidRequestError
from specserve.workers.runtime.loading import load_model
from specserve.workers.speculation.engine import SpecEngine
from specserve.workers.speculation.request import RequestStats

CHATML = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Spec-Bench's layout (question_id, category, turns, sometimes reference), short enough for a 512-position model:
# MT-bench's two-turn questions in 3 of its 8 categories, then one or two of each other task.
QUESTIONS = [
    {"question_id": 81, "category": "writing", "turns": ["Write a line on Hawaii.", "Now start it with A."]},
    {"question_id": 91, "category": "roleplay", "turns": ["Speak as Elon Musk.", "And on dancing?"]},
    {"question_id": 121, "category": "coding", "turns": ["Reverse a list in Python.", "And in C?"]},
    {"question_id": 161, "category": "translation", "turns": ["Translate German to English: Guten Tag"],
     "reference": ["Good day"]},
    {"question_id": 162, "category": "translation", "turns": ["Translate German to English: Danke"],
     "reference": ["Thanks"]},
    {"question_id": 241, "category": "summarization", "turns": ["Summarize: the cat sat on the mat. The cat sat."],
     "reference": ["A cat sat."]},
    {"question_id": 321, "category": "qa", "turns": ["who wrote hamlet"], "reference": ["Shakespeare"]},
    {"question_id": 401, "category": "math_reasoning", "turns": ["Tom has 3 apples and eats 1. How many are left?"],
     "reference": ["2"]},
    {"question_id": 481, "category": "rag", "turns": ["Answer from the passage. Passage: Oslo is in Norway. Q: Where "
     "is Oslo?"], "reference": ["Norway"]},
]  # fmt: skip


def _write(path, questions=QUESTIONS, extra_lines=()) -> str:
    path.write_text("\n".join([*(json.dumps(q) for q in questions), *extra_lines]) + "\n")
    return str(path)


@pytest.fixture(scope="module")
def chat_target(tmp_path_factory, tiny_target) -> str:
    """The tiny target with a ChatML template, so turns go through a real chat template."""
    from transformers import AutoTokenizer

    path = tmp_path_factory.mktemp("chat") / "target"
    shutil.copytree(tiny_target, path)
    tok = AutoTokenizer.from_pretrained(path)
    tok.chat_template = CHATML
    tok.save_pretrained(path)
    return str(path)


def test_the_reader_keeps_turns_and_folds_mt_bench_categories(tmp_path):
    questions = read_spec_bench(_write(tmp_path / "question.jsonl", extra_lines=["", "  "]))  # blank lines skipped
    assert [q.question_id for q in questions] == [q["question_id"] for q in QUESTIONS]
    assert [q.category for q in questions[:3]] == ["mt_bench"] * 3
    assert [q.source_category for q in questions[:3]] == ["writing", "roleplay", "coding"]
    assert questions[0].turns == ("Write a line on Hawaii.", "Now start it with A.")
    assert {q.category for q in questions} == set(CATEGORIES)  # 6 categories in all
    assert all(len(q.turns) == 1 for q in questions[3:])


def test_per_category_selection_takes_the_first_n_of_each_category_in_file_order(tmp_path):
    questions = read_spec_bench(_write(tmp_path / "question.jsonl"))
    assert [q.question_id for q in select_per_category(questions, 1)] == [81, 161, 241, 321, 401, 481]
    assert [q.question_id for q in select_per_category(questions, 2)] == [81, 91, 161, 162, 241, 321, 401, 481]
    assert select_per_category(questions, 0) == questions


@pytest.mark.parametrize("line, why", [
    ('{"question_id": 5, "category": "qa", "turns": ["a"]', "not JSON"),
    ('["qa", "a"]', "not a JSON object"),
    ('{"question_id": 5, "category": "qa"}', "turns must be a non-empty list"),
    ('{"question_id": 5, "category": "qa", "turns": []}', "turns must be a non-empty list"),
    ('{"question_id": 5, "category": "qa", "turns": ["a", 3]}', "turns must be a non-empty list"),
    ('{"question_id": 5, "turns": ["a"]}', "category must be a non-empty string"),
    ('{"category": "qa", "turns": ["a"]}', "question_id must be"),
])  # fmt: skip
def test_a_malformed_line_is_refused_naming_the_file_and_line(tmp_path, line, why):
    path = _write(tmp_path / "question.jsonl", QUESTIONS[:2], [line])
    with pytest.raises(InvalidRequestError) as e:
        read_spec_bench(path)
    assert e.value.field == "spec_bench"
    assert "question.jsonl' line 3:" in e.value.message and why in e.value.message


def test_an_empty_or_missing_file_is_refused(tmp_path):
    with pytest.raises(InvalidRequestError, match="holds no questions"):
        read_spec_bench(_write(tmp_path / "empty.jsonl", [], [""]))
    with pytest.raises(InvalidRequestError, match="cannot read"):
        read_spec_bench(str(tmp_path / "absent.jsonl"))


def test_the_second_turn_follows_the_models_own_first_answer_through_the_chat_template(chat_target):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(chat_target)
    question = read_spec_bench_one(QUESTIONS[0])
    _, (conversation,) = spec_bench_prompts(tok, [question], 16, 512)
    answer_ids = tok(" Aloha, islands. ", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    seen = []

    def fn(prompt, params):  # a row's generate: the same answer every turn, with drafting rounds
        seen.append(prompt)
        stats = RequestStats()
        stats.add_round(drafted=3, accepted=2)
        stats.add_round(drafted=3, accepted=0)
        return answer_ids, stats

    tokens, stats = converse(tok, fn)(conversation, None)

    render = lambda messages: tok(tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),  # noqa: E731
                                  add_special_tokens=False)["input_ids"]  # fmt: skip
    first = [{"role": "user", "content": question.turns[0]}]
    assert seen[0] == conversation.first_ids == render(first)
    assert answer_text(tok, answer_ids) == "Aloha, islands."  # the end of turn dropped, stripped
    second = [*first, {"role": "assistant", "content": "Aloha, islands."},
              {"role": "user", "content": question.turns[1]}]  # fmt: skip
    assert len(seen) == 2 and seen[1] == render(second)
    assert tokens == answer_ids + answer_ids  # both turns' tokens count
    assert (stats.rounds, stats.accepted, stats.drafted) == (4, 4, 12)
    assert converse(tok, lambda p, params: (answer_ids, None))(conversation, None)[1] is None  # HF rows: no rounds


def read_spec_bench_one(obj: dict):
    return parse_question("question.jsonl", 1, json.dumps(obj))


def test_a_first_turn_the_context_cannot_answer_is_refused_naming_the_question(chat_target):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(chat_target)
    with pytest.raises(InvalidRequestError, match="question 241 \\(summarization\\).*context of 40 positions"):
        spec_bench_prompts(tok, [read_spec_bench_one(QUESTIONS[5])], 16, 40)


def _row(method, outputs, seconds, temperature=0.0) -> Row:
    row = Row(f"{method} row", method, None, temperature)
    row.outputs, row.seconds_by_prompt = [[0] * n for n in outputs], list(seconds)
    row.tokens, row.seconds = sum(outputs), sum(seconds)
    row.tokens_per_s = row.tokens / row.seconds
    return row


def test_figures_per_category_are_tokens_over_time_against_target_only_on_the_same_questions():
    categories = ["mt_bench", "rag", "mt_bench", "summarization"]
    base = _row("target-only", [10, 20, 30, 8], [1.0, 4.0, 3.0, 2.0])  # mt_bench 40/4 s, rag 20/4 s, summ. 8/2 s
    spec = _row("ngram", [10, 20, 30, 8], [0.5, 1.0, 1.5, 2.0])  # mt_bench 40/2 s, rag 20/1 s, summ. 8/2 s
    hf = _row("hf-generate", [10, 20, 30, 8], [1.0, 2.0, 3.0, 1.0])
    sampled = _row("target-only", [5, 5, 5, 5], [1.0, 1.0, 1.0, 1.0], temperature=0.8)
    rows = [base, spec, hf, sampled]
    fill_categories(rows, {id(spec): [(6, 4), (12, 4), (2, 4), (0, 8)]}, categories)

    assert list(spec.categories) == ["mt_bench", "summarization", "rag"]  # Spec-Bench's order
    mt, summ, rag = (spec.categories[c] for c in ("mt_bench", "summarization", "rag"))
    assert (mt["tokens_per_s"], mt["speedup"], mt["mean_accepted_length"]) == (20.0, 2.0, 1 + 8 / 8)
    assert (rag["tokens_per_s"], rag["speedup"], rag["mean_accepted_length"]) == (20.0, 4.0, 1 + 12 / 4)
    assert (summ["tokens_per_s"], summ["speedup"], summ["mean_accepted_length"]) == (4.0, 1.0, 1.0)
    assert (mt["questions"], mt["tokens"], mt["seconds"]) == (2, 40, 2.0)
    assert base.categories["rag"]["speedup"] == 1.0 and base.categories["rag"]["tokens_per_s"] == 5.0
    assert hf.categories["rag"]["speedup"] == 2.0 and hf.categories["rag"]["mean_accepted_length"] is None
    assert sampled.categories["mt_bench"]["speedup"] == 1.0  # against target-only at its own temperature
    # overall: all questions' tokens over all their time, against target-only's (not a mean of the categories)
    overall = sum(f["tokens"] for f in spec.categories.values()) / sum(f["seconds"] for f in spec.categories.values())
    assert overall == spec.tokens_per_s == 68 / 5.0
    assert overall / base.tokens_per_s == pytest.approx(68 / 5.0 / (68 / 10.0))
    # the best prompt-lookup row is compared with its own target-only rerun
    rerun = _row("target-only", [10, 20, 30, 8], [2.0, 2.0, 6.0, 2.0])
    assert category_figures(hf, rerun, categories)["mt_bench"]["speedup"] == 2.0


def test_methods_and_k_select_the_rows_and_keep_target_only_and_hf(tiny_target):
    engine = SpecEngine(load_model(ModelConfig(path=tiny_target, device="cpu")))
    cfg = BenchConfig(suite="target", sampled=False, methods=parse_methods("ngram-tree, ngram"),
                      only_ks=parse_ks("3,auto"))  # fmt: skip
    names = [row.name for row, _ in plan_rows(engine, cfg)]
    assert names == ["target-only greedy", "hf generate greedy", "hf prompt-lookup N=10 greedy",
                     "specserve ngram k=3 greedy", "specserve ngram k=auto greedy",
                     "specserve ngram-tree k=3 greedy", "specserve ngram-tree k=auto greedy"]  # fmt: skip
    for bad, flag in (("ngram,warp", "methods"), ("", "methods")):
        with pytest.raises(InvalidRequestError, match="ngram-tree") as e:
            parse_methods(bad)
        assert e.value.field == flag
    for bad in ("0", "4,fast", "17", ""):
        with pytest.raises(InvalidRequestError, match="auto") as e:
            parse_ks(bad)
        assert e.value.field == "k"


def test_a_registry_method_without_a_sweep_runs_when_named_and_each_suffix_row_has_its_own_cache(tiny_target):
    from specserve.cluster.bench.rows import spec_fn
    from specserve.workers.config.request import SamplingParams

    engine = SpecEngine(load_model(ModelConfig(path=tiny_target, device="cpu")))
    cfg = BenchConfig(suite="target", sampled=False, methods=("suffix",), only_ks=(4,))
    assert [row.name for row, _ in plan_rows(engine, cfg)][3:] == ["specserve suffix k=4 greedy"]
    prompt, params = [5, 6, 7, 8, 9, 5, 6, 7, 8], SamplingParams(max_new_tokens=24)
    first, second = spec_fn(engine, "suffix", 4), spec_fn(engine, "suffix", 4)
    drafted = [fn(prompt, params)[1].drafted for fn in (first, second, first)]
    # the second row drafts as the first did (a cache shared by the rows would hold the first row's answer); the
    # first row's second request finds its own earlier answer
    assert drafted[0] == drafted[1] < drafted[2]


@pytest.mark.parametrize("extra, field, message", [
    ([], "spec_bench", "line 3"),  # the malformed file, before the (absent) model loads
    (["--distributed"], "spec_bench", "single prompts"),
    (["--methods", "warp"], "methods", "unknown method"),
    (["--k", "0"], "k", "1..16"),
])  # fmt: skip
def test_cli_refusals_exit_2_before_loading_models(tmp_path, capsys, extra, field, message):
    good = extra != []
    path = _write(tmp_path / "question.jsonl", QUESTIONS[:2], [] if good else ["{oops"])
    code = main(["bench", "--target", str(tmp_path / "no-model"), "--spec-bench", path, *extra])
    err = capsys.readouterr().err
    assert code == 2 and f"invalid {field}" in err and message in err


def test_cli_spec_bench_needs_a_target_and_per_category_needs_spec_bench(tmp_path, capsys):
    path = _write(tmp_path / "question.jsonl")
    assert main(["bench", "--spec-bench", path]) == 2
    assert "applies with --target" in capsys.readouterr().err
    assert main(["bench", "--target", str(tmp_path), "--per-category", "2"]) == 2
    assert "applies with --spec-bench" in capsys.readouterr().err


@pytest.mark.slow  # a whole bench run through the CLI (6-9 s): the fast loop keeps its parts' tests
def test_cli_spec_bench_run_reports_every_row_per_category_with_identical_outputs(chat_target, tmp_path, capsys):
    path = _write(tmp_path / "question.jsonl")
    out = tmp_path / "bench.json"
    code = main(["bench", "--quick", "--target", chat_target, "--spec-bench", path, "--per-category", "1",
                 "--methods", "ngram,ngram-tree", "--k", "2,auto", "--no-load", "--json", str(out),
                 "--device", "cpu"])  # fmt: skip
    printed = capsys.readouterr()
    assert code == 0, printed.err
    assert "no chat template" not in printed.err and "Spec-Bench by category" in printed.out
    result = json.loads(out.read_text())
    meta = result["meta"]
    assert meta["prompts_kind"] == "spec-bench" and meta["prompts"] == 6 and meta["max_new_tokens"] == 64
    assert meta["spec_bench"]["questions"] == dict.fromkeys(CATEGORIES, 1)
    assert meta["spec_bench"]["turns"] == 7  # the MT-bench question's two turns
    rows = result["rows"]
    assert [(r["method"], r["k"]) for r in rows] == [
        ("target-only", None), ("hf-generate", None), ("hf-prompt-lookup", 10), ("hf-prompt-lookup", 2),
        ("ngram", 2), ("ngram", "auto"), ("ngram-tree", 2), ("ngram-tree", "auto")]  # fmt: skip
    assert all(r["temperature"] == 0 for r in rows)  # greedy only, as Spec-Bench
    assert all(r["identical"] is True for r in rows[1:])  # every output the same as target-only's
    for r in rows:
        assert list(r["categories"]) == list(CATEGORIES)
        figures = r["categories"].values()
        assert all(f["tokens_per_s"] > 0 and f["speedup"] > 0 for f in figures)
        assert sum(f["tokens"] for f in figures) == r["tokens"]
        assert sum(f["seconds"] for f in figures) == pytest.approx(r["seconds"])
        drafts = r["method"] in ("ngram", "ngram-tree")
        assert all((f["mean_accepted_length"] is not None) == drafts for f in figures)
    assert all(f["speedup"] == 1.0 for f in rows[0]["categories"].values())
    base = rows[0]
    for r in rows[4:]:  # overall: all tokens over all time, against target-only's
        assert r["speedup"] == pytest.approx((r["tokens"] / r["seconds"]) / (base["tokens"] / base["seconds"]))
    # the MT-bench question answered twice: more tokens than one turn may have
    assert rows[0]["categories"]["mt_bench"]["tokens"] > meta["max_new_tokens"]


@pytest.mark.slow  # a whole bench run through the CLI (6-9 s): the fast loop keeps its parts' tests
def test_cli_spec_bench_with_load_feeds_the_first_turns_to_the_load_bench(chat_target, tmp_path, capsys, monkeypatch):
    from transformers import AutoTokenizer

    from specserve.cluster.bench import concurrency

    seen = {}

    def load_rows(target, draft, prompts, cfg, device, dtype, then=None, fields=None):  # not started here
        seen.update(target=target, prompts=prompts, cfg=cfg)
        return [], "ngram", None

    monkeypatch.setattr(concurrency, "load_rows", load_rows)
    path = _write(tmp_path / "question.jsonl")
    code = main(["bench", "--quick", "--target", chat_target, "--spec-bench", path, "--per-category", "1",
                 "--methods", "ngram", "--k", "2", "--load", "--device", "cpu"])  # fmt: skip
    assert code == 0, capsys.readouterr().err
    tok = AutoTokenizer.from_pretrained(chat_target)
    firsts = [q["turns"][0] for q in QUESTIONS if q["question_id"] in (81, 161, 241, 321, 401, 481)]
    rendered = [tok.apply_chat_template([{"role": "user", "content": t}], tokenize=False, add_generation_prompt=True)
                for t in firsts]  # fmt: skip
    expected = [tok(text, add_special_tokens=False)["input_ids"] for text in rendered]
    assert seen["target"] == chat_target and seen["prompts"] == expected and seen["cfg"] == concurrency.QUICK_LOAD


def test_twice_asks_every_selected_question_again_as_the_second_pass(tmp_path, capsys):
    import argparse

    from specserve.cluster.bench.spec_bench import SECOND_PASS, questions_for

    path = _write(tmp_path / "question.jsonl")
    args = argparse.Namespace(spec_bench=path, per_category=1, quick=True, target="t", distributed=False,
                              tensor_parallel=None, twice=True)  # fmt: skip
    chosen, n = questions_for(args)
    first, again = chosen[:6], chosen[6:]
    assert n == 1 and [q.question_id for q in again] == [q.question_id for q in first]
    assert {q.category for q in again} == {SECOND_PASS} and SECOND_PASS not in {q.category for q in first}
    assert [q.turns for q in again] == [q.turns for q in first]
    assert main(["bench", "--target", str(tmp_path), "--twice"]) == 2
    assert "applies with --spec-bench" in capsys.readouterr().err
