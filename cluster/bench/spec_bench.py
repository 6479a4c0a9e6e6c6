"""Spec-Bench (Xia et al., 2024; github hemingkx/Spec-Bench, data/spec_bench/question.jsonl) in `specserve bench
--target NAME --spec-bench FILE`: the file read as it is (one JSON object a line: question_id, category, turns,
sometimes reference), MT-bench's 8 categories reported as one, `mt_bench`, as Spec-Bench's own speed.py does (6
categories in all), the first N questions of each category in file order, and each question asked as Spec-Bench's
eval.py asks it: turn after turn through the target's chat template, every later turn after the model's own answer
to the earlier ones (so an MT-bench question is two generations, and its time and tokens are both's). Every row then
gets figures per category: its tokens over its time on that category's questions, that against target-only's on
the same questions, and tokens per round. The file is not shipped (its questions come from data sets under their
own licences): docs/spec-bench.md says where to get it."""

from __future__ import annotations

import dataclasses
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass

from specserve.cluster.bench.rows import BenchConfig, Row, RowFn
from specserve.cluster.bench.timing import RoundCounts
from specserve.workers.config.request import SamplingParams
from specserve.workers.errors import InvalidRequestError
from specserve.workers.models.chat import ChatMessage, chat_prompt_ids

MT_BENCH = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")
SECOND_PASS = "second_pass"  # --twice: every question asked again, after all of them
CATEGORIES = ("mt_bench", "translation", "summarization", "qa", "math_reasoning", "rag")  # in speed.py's order
QUICK_PER_CATEGORY, FULL_PER_CATEGORY = 3, 10  # --quick: 18 questions; otherwise 60 (--per-category 0: all 480)
# Greedy only, as Spec-Bench's leaderboard; up to this many new tokens a turn
SPEC_BENCH_QUICK = BenchConfig(max_new_tokens=64, suite="target", sampled=False)
SPEC_BENCH_FULL = BenchConfig(max_new_tokens=128, suite="target", sampled=False)


@dataclass(frozen=True)
class Question:
    question_id: int | str
    category: str  # as reported: mt_bench for MT-bench's 8 categories, else the file's
    source_category: str  # as the file has it
    turns: tuple[str, ...]


def fold_category(category: str) -> str:
    return "mt_bench" if category in MT_BENCH else category


def read_spec_bench(path: str) -> list[Question]:
    """Every question of a Spec-Bench question.jsonl, in file order (blank lines skipped); InvalidRequestError
    naming the file and line of the first malformed one."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise InvalidRequestError("spec_bench", f"cannot read {path!r}: {e}") from None
    questions = [parse_question(path, n, line) for n, line in enumerate(lines, 1) if line.strip()]
    if not questions:
        raise InvalidRequestError("spec_bench", f"{path!r} holds no questions (Spec-Bench's question.jsonl: one JSON "
                                  "object a line with question_id, category and turns)")  # fmt: skip
    return questions


def parse_question(path: str, lineno: int, line: str) -> Question:
    """One line of the file as a Question; InvalidRequestError naming the file and line when malformed."""

    def bad(why: str) -> InvalidRequestError:
        return InvalidRequestError("spec_bench", f"{path!r} line {lineno}: {why}")

    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise bad(f"not JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(obj, dict):
        raise bad("not a JSON object")
    qid, category, turns = obj.get("question_id"), obj.get("category"), obj.get("turns")
    if isinstance(qid, bool) or not isinstance(qid, int | str):
        raise bad("question_id must be a number or a string")
    if not isinstance(category, str) or not category.strip():
        raise bad("category must be a non-empty string")
    if not isinstance(turns, list) or not turns or not all(isinstance(t, str) and t.strip() for t in turns):
        raise bad("turns must be a non-empty list of non-empty strings")
    return Question(qid, fold_category(category), category, tuple(turns))


def select_per_category(questions: list[Question], n: int) -> list[Question]:
    """The first n questions of each (reported) category, in file order; n = 0: all."""
    taken: dict[str, int] = {}
    chosen = []
    for q in questions:
        if n == 0 or taken.get(q.category, 0) < n:
            taken[q.category] = taken.get(q.category, 0) + 1
            chosen.append(q)
    return chosen


def ordered_categories(categories: list[str]) -> list[str]:
    """Spec-Bench's categories in speed.py's order, then any other the file has, in first-seen order."""
    seen = list(dict.fromkeys(categories))
    return [c for c in CATEGORIES if c in seen] + [c for c in seen if c not in CATEGORIES]


def questions_for(args) -> tuple[list[Question], int] | None:
    """The questions of a --spec-bench run and the per-category count (None without --spec-bench), checked before
    any model loads; settles args.distributed (off: those rows ask single prompts, not conversations)."""
    per_category = getattr(args, "per_category", None)
    if getattr(args, "spec_bench", None) is None:
        if per_category is not None:
            raise InvalidRequestError("per_category", "applies with --spec-bench")
        if getattr(args, "twice", False):
            raise InvalidRequestError("twice", "applies with --spec-bench")
        return None
    if not args.target:
        raise InvalidRequestError("spec_bench", "applies with --target (its questions go through the target's chat "
                                  "template)")  # fmt: skip
    if args.distributed or (args.tensor_parallel or 0) > 1:
        raise InvalidRequestError("spec_bench", "runs the in-process rows (and --load); the disaggregated and "
                                  "tensor-parallel rows ask single prompts, not conversations")  # fmt: skip
    if per_category is not None and per_category < 0:
        raise InvalidRequestError("per_category", "must be 0 (all) or more")
    n = per_category if per_category is not None else QUICK_PER_CATEGORY if args.quick else FULL_PER_CATEGORY
    args.distributed = False
    chosen = select_per_category(read_spec_bench(args.spec_bench), n)
    if getattr(args, "twice", False):  # the same questions again, after all of them: suffix drafting's second pass
        chosen += [dataclasses.replace(q, category=SECOND_PASS) for q in chosen]
    return chosen, n


@dataclass
class Conversation:
    question: Question
    first_ids: list[int]  # the first turn through the chat template (the bench's prompt for this question)


def messages_for(turns: tuple[str, ...], answers: list[str]) -> list[ChatMessage]:
    """The conversation that asks turn len(answers) + 1: every earlier turn followed by the model's answer to it."""
    messages = []
    for turn, answer in zip(turns, answers, strict=False):
        messages += [ChatMessage("user", turn), ChatMessage("assistant", answer)]
    return [*messages, ChatMessage("user", turns[len(answers)])]


def answer_text(tokenizer, tokens: list[int]) -> str:
    """The model's answer as its next turn carries it, as Spec-Bench's eval.py has it: decoded without special tokens
    (the end of turn among them), stripped."""
    return tokenizer.decode(tokens, skip_special_tokens=True).strip()


def spec_bench_prompts(tokenizer, questions: list[Question], max_new_tokens: int,
                       max_positions: int | None) -> tuple[list[list[int]], list[Conversation]]:  # fmt: skip
    """(first turns' prompt ids, conversations); InvalidRequestError for a first turn the model's context cannot
    answer with max_new_tokens."""
    if not getattr(tokenizer, "chat_template", None):
        print("specserve bench: the target's tokenizer has no chat template: questions are sent as plain "
              "'user: ...' transcripts, as the OpenAI chat endpoint does", file=sys.stderr)  # fmt: skip
    conversations = []
    for q in questions:
        ids = chat_prompt_ids(tokenizer, messages_for(q.turns, []))
        if max_positions is not None and len(ids) + max_new_tokens > max_positions:
            raise InvalidRequestError("spec_bench", f"question {q.question_id} ({q.source_category}): its first turn "
                                      f"is {len(ids)} tokens, and {max_new_tokens} new tokens after it exceed the "
                                      f"model's context of {max_positions} positions")  # fmt: skip
        conversations.append(Conversation(q, ids))
    return [c.first_ids for c in conversations], conversations


ConversationFn = Callable[[Conversation, SamplingParams], tuple[list[int], RoundCounts | None]]


def converse(tokenizer, fn: RowFn) -> ConversationFn:
    """A row's generate function over whole conversations: each turn generated by `fn` after the earlier turns and
    the answers `fn` gave them; returns every turn's tokens, in order, and their drafting rounds summed (None for a
    row without them)."""

    def run(conversation: Conversation, params: SamplingParams):
        turns = conversation.question.turns
        tokens: list[int] = []
        answers: list[str] = []
        stats = []
        for j in range(len(turns)):
            prompt = conversation.first_ids if j == 0 else chat_prompt_ids(tokenizer, messages_for(turns, answers))
            out, s = fn(prompt, params)
            tokens += out
            answers.append(answer_text(tokenizer, out))
            stats.append(s)
        if any(s is None for s in stats):
            return tokens, None
        merged = RoundCounts()
        for s in stats:
            merged.add(s)
        return tokens, merged

    return run


def category_figures(row: Row, base: Row, categories: list[str],
                     rounds: list[tuple[int, int]] | None = None) -> dict[str, dict]:  # fmt: skip
    """Per category (prompt i is in categories[i]): the row's tokens over its seconds on that category's questions,
    that over `base`'s on the same questions, and tokens per round (its accepted tokens over its rounds there, plus
    the bonus; None without `rounds`, each prompt's (accepted, rounds)); beside them the questions, tokens and
    seconds summed (the row's overall figures are those of all categories together)."""
    tokens = lambda r, idx: sum(len(r.outputs[i]) for i in idx)  # noqa: E731
    seconds = lambda r, idx: sum(r.seconds_by_prompt[i] for i in idx)  # noqa: E731
    figures = {}
    for name in ordered_categories(categories):
        idx = [i for i, c in enumerate(categories) if c == name]
        tokens_per_s = tokens(row, idx) / seconds(row, idx)
        n_rounds = sum(rounds[i][1] for i in idx) if rounds else 0
        figures[name] = {
            "tokens_per_s": tokens_per_s,
            "speedup": tokens_per_s / (tokens(base, idx) / seconds(base, idx)),
            "mean_accepted_length": 1 + sum(rounds[i][0] for i in idx) / n_rounds if n_rounds else None,
            "questions": len(idx),
            "tokens": tokens(row, idx),
            "seconds": seconds(row, idx),
        }
    return figures


def fill_categories(rows: list[Row], rounds: dict[int, list[tuple[int, int]]], categories: list[str]) -> None:
    """Every row's figures per category against the target-only row of its temperature; rounds: {id(row): each
    prompt's (accepted, rounds)} of the rows that draft."""
    for row in rows:
        base = next(r for r in rows if r.method == "target-only" and r.temperature == row.temperature)
        row.categories = category_figures(row, base, categories, rounds.get(id(row)))


def spec_bench_meta(path: str, per_category: int, conversations: list[Conversation]) -> dict:
    categories = [c.question.category for c in conversations]
    return {
        "file": path,
        "per_category": per_category,
        "questions": {name: categories.count(name) for name in ordered_categories(categories)},
        "turns": sum(len(c.question.turns) for c in conversations),
    }


def format_categories(rows: list[Row], meta: dict) -> list[str]:
    """The per-category table: each row's speedup over target-only in that category (tokens per round in brackets
    for rows that draft), target-only's tok/s, and overall (all questions' tokens over all their time)."""
    rows = [r for r in rows if r.categories]
    if not rows:
        return []
    names = list(rows[0].categories)
    lines = [["row", *names, "overall"]]
    for r in rows:
        figures = [r.categories[n] for n in names]
        if r.method == "target-only":
            cells = [f"{f['tokens_per_s']:.1f} tok/s" for f in figures] + [f"{r.tokens_per_s:.1f} tok/s"]
        else:
            cells = [_cell(f) for f in figures] + [f"{r.speedup:.2f}x"]
        lines.append([r.name, *cells])
    widths = [max(len(line[i]) for line in lines) for i in range(len(lines[0]))]
    out = ["| " + " | ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=True)) + " |" for line in lines]
    out.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    s = meta.get("spec_bench", {})
    asked = ", ".join(f"{n} {name}" for name, n in s.get("questions", {}).items())
    return [
        f"Spec-Bench by category ({asked}; {s.get('turns', '?')} turns, each turn up to {meta['max_new_tokens']} new "
        "tokens): speedup over target-only greedy on the same questions, (tokens per round); target-only: its tok/s",
        *out,
    ]


def _cell(figures: dict) -> str:
    cell = f"{figures['speedup']:.2f}x"
    return cell if figures["mean_accepted_length"] is None else f"{cell} ({figures['mean_accepted_length']:.2f})"
