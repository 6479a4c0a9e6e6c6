"""The rows of `specserve bench`: which rows a run measures on which prompts, and the generate call behind each.

Two suites. `demo`: the demo family's rows (draft-model speculation at several k, Hugging Face assisted generation with
the same draft, one n-gram row). `target`: any target, with or without a draft model: prompt lookup on both sides
(specserve's n-gram drafting at k = 1..8 and auto, Hugging Face's prompt-lookup decoding, its peer), an EAGLE-3 head's
rows (eagle and eagle+ngram at k = 1..8 and auto) when a head is loaded, and the draft model's rows (and HF assisted
generation) only when a draft model is loaded. `--methods` and `--k` narrow the target suite's speculative rows
(`selected_sweeps`); its target-only and HF rows always run."""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal, get_args

import torch

from specserve.workers.config.request import MAX_K, SamplingParams, SpecMethod, SpecParams
from specserve.workers.errors import InvalidRequestError
from specserve.workers.models.chat_questions import HELD_OUT_QUESTIONS, question_prompt_ids, read_questions
from specserve.workers.speculation.engine import SpecEngine
from specserve.workers.speculation.methods import HEAD_CHAIN_METHODS, METHODS, NONE
from specserve.workers.speculation.suffix import SuffixCache

NGRAM_KS = tuple(range(1, 9))  # the target suite's n-gram sweep
EAGLE_KS = tuple(range(1, 9))  # and its EAGLE-3 head's, alone and with n-gram (with a head)
TREE_KS = (4, 8, 16)  # the head's trees: nodes per round
PROMPT_LOOKUP_N = 10  # Hugging Face's usual prompt_lookup_num_tokens
SAMPLED_NGRAM_K = 4


@dataclass
class BenchConfig:
    prompts: int = 6
    prompt_tokens: int = 96  # text-file prompts: the first this many tokens (chat prompts are whole questions)
    max_new_tokens: int = 128
    ks: tuple[int, ...] = (1, 2, 4, 6)  # draft-model rows
    temperature: float = 0.8
    seed: int = 1234
    hf_rows: bool = True
    suite: Literal["demo", "target"] = "demo"  # see the module docstring
    sampled: bool = True  # the sampled section (at `temperature`) after the greedy rows
    methods: tuple[str, ...] | None = None  # --methods: only these speculative methods' rows (None: all)
    only_ks: tuple[int | str, ...] | None = None  # --k: only these k (None: all); target-only and HF rows stay


QUICK = BenchConfig(prompts=2, prompt_tokens=64, max_new_tokens=48, ks=(2, 4))
# A real target: ~60 ms a token for a 135M model on 2 CPU cores; quick stays under 15 min, the full run ~30-40 min.
TARGET_QUICK = BenchConfig(prompts=4, max_new_tokens=64, ks=(2, 4), suite="target")
TARGET_FULL = BenchConfig(prompts=12, max_new_tokens=128, suite="target")


@dataclass
class Row:
    name: str
    # target-only | hf-generate | hf-assisted | hf-prompt-lookup | draft | ngram | eagle | eagle+ngram | disaggregated
    # | serve
    method: str
    k: float | str | None
    temperature: float
    tokens: int = 0
    seconds: float = 0.0
    tokens_per_s: float = 0.0
    speedup: float | None = 1.0  # over one stream of in-process target-only; None for rows of several streams
    streams: int = 1  # concurrent requests (several: throughput only; the load bench compares them like for like)
    acceptance_rate: float | None = None
    mean_accepted_length: float | None = None
    t_draft_ms: float | None = None
    t_target_ms: float | None = None
    t_verify_ms: float | None = None
    leviathan_bound: float | None = None
    bound: float | None = None
    ratio_to_bound: float | None = None
    identical: bool | None = None  # greedy rows: same tokens as target-only; sampling rows: None (compare laws)
    identical_share: float | None = None  # greedy rows: the share of prompts whose tokens were target-only's
    default: bool = False  # the drafting a served model gets unless a request names one (its method at k='auto')
    # Position j: the fraction of rounds drafting j+1 or more tokens whose first j+1 drafts were all accepted.
    acceptance_by_position: list[float] | None = None
    # Spec-Bench runs: {category: {tokens_per_s, speedup, mean_accepted_length}} (cluster/bench/spec_bench.py)
    categories: dict[str, dict] | None = None
    outputs: list[list[int]] = field(default_factory=list, repr=False)
    seconds_by_prompt: list[float] = field(default_factory=list, repr=False)


RowFn = Callable[[list[int], SamplingParams], tuple[list[int], object | None]]  # -> (tokens, RequestStats | None)


def best_draft_k(cfg: BenchConfig) -> int:
    return 4 if 4 in cfg.ks else cfg.ks[-1]


def held_out_prompts(tokenizer, paths: list[str], n: int, length: int) -> list[list[int]]:
    """The first `length` tokens of the first n held-out files long enough to continue."""
    prompts = []
    for path in paths:
        with open(path, encoding="utf-8", errors="replace") as f:
            ids = tokenizer(f.read(), add_special_tokens=False)["input_ids"]
        if len(ids) >= length * 3:
            prompts.append(ids[:length])
        if len(prompts) == n:
            break
    return prompts


def bench_questions(args) -> list[str] | None:
    """The chat questions of this run: --chat-prompts, or the built-in held-out ones for a target given without
    --prompts-from; None: text-file prompts. Read before any model loads, so a bad file fails at once."""
    if args.chat_prompts:
        return read_questions(args.chat_prompts)
    if args.target and not args.prompts_from:
        return list(HELD_OUT_QUESTIONS)
    return None


def bench_prompts(tokenizer, cfg: BenchConfig, questions: list[str] | None,
                  held_out_files: list[str]) -> tuple[list[list[int]], str]:  # fmt: skip
    """(prompts, kind): the first cfg.prompts questions through the chat template ('chat'), or the openings of
    held-out text files ('text')."""
    if questions is None:
        prompts = held_out_prompts(tokenizer, held_out_files, cfg.prompts, cfg.prompt_tokens)
        if not prompts:
            raise InvalidRequestError("prompts_from", f"no file is {cfg.prompt_tokens * 3} tokens long or more")
        return prompts, "text"
    if not getattr(tokenizer, "chat_template", None):
        print("specserve bench: the target's tokenizer has no chat template: questions are sent as plain "
              "'user: ...' transcripts, as the OpenAI chat endpoint does", file=sys.stderr)  # fmt: skip
    return [question_prompt_ids(tokenizer, q) for q in questions[: cfg.prompts]], "chat"


def spec_fn(engine: SpecEngine, method: str, k) -> RowFn:
    # A row that drafts by suffix drafts from a cache of recent outputs of its own: the engine's, shared by the rows,
    # would hold the earlier rows' answers to the same prompt (a second pass, which no first request sees).
    cache = SuffixCache(engine.suffix_cache.config) if METHODS[method].suffix else None

    def run(prompt, params):
        if cache is not None:
            engine.suffix_cache = cache
        r = engine.generate(prompt, params, SpecParams(method=method, k=k))
        return r.token_ids, r.stats

    return run


def hf_stop_kwargs(engine: SpecEngine) -> dict:
    """eos and pad ids for HF generate: the same stop tokens as the engine's, given explicitly so generate neither
    guesses them nor warns about it."""
    eos = sorted(engine.target.eos_token_ids)
    pad = engine.tokenizer.pad_token_id
    if pad is None:
        pad = getattr(engine.target.model.generation_config, "pad_token_id", None)
    if pad is None and eos:
        pad = eos[0]
    return {"eos_token_id": eos or None, "pad_token_id": pad}


def hf_fn(engine: SpecEngine, assistant_k: int | None = None, assisted: bool = False,
          prompt_lookup: int | None = None) -> RowFn:  # fmt: skip
    """Hugging Face generate on the target: plain, assisted by the draft model (its default schedule, or a constant
    `assistant_k`), or prompt-lookup decoding proposing `prompt_lookup` tokens a round."""
    target = engine.target
    stop = hf_stop_kwargs(engine)

    def run(prompt, params):
        kwargs = dict(max_new_tokens=params.max_new_tokens, do_sample=not params.greedy, **stop)
        if not params.greedy:
            kwargs["temperature"] = params.temperature
            torch.manual_seed(params.seed or 0)
        if prompt_lookup is not None:
            kwargs["prompt_lookup_num_tokens"] = prompt_lookup
        if assisted:
            draft = engine.drafters["draft"].runner.loaded
            kwargs["assistant_model"] = draft.model
            gc = draft.model.generation_config
            saved = (getattr(gc, "num_assistant_tokens", None), getattr(gc, "num_assistant_tokens_schedule", None))
            if assistant_k is not None:
                gc.num_assistant_tokens, gc.num_assistant_tokens_schedule = assistant_k, "constant"
        try:
            ids = torch.tensor([prompt], device=target.device)
            with _quiet_hf_assistant() if assisted else contextlib.nullcontext():
                out = target.model.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
        finally:
            if assisted:
                gc.num_assistant_tokens, gc.num_assistant_tokens_schedule = saved
        return out[0, len(prompt) :].tolist(), None

    return run


@contextlib.contextmanager
def _quiet_hf_assistant():
    """HF's assisted generation calls the assistant's generate with a generation_config and keyword arguments at once,
    and transformers then logs a deprecation of its own internals, which no caller can act on: that one message is
    dropped (any other warning still shows)."""
    hf_logger = logging.getLogger("transformers.generation.utils")

    def drop(record: logging.LogRecord) -> bool:
        return "together with generation-related arguments" not in record.getMessage()

    hf_logger.addFilter(drop)
    try:
        yield
    finally:
        hf_logger.removeFilter(drop)


def prompt_lookup_row(engine: SpecEngine, n: int, note: str = "") -> tuple[Row, RowFn]:
    row = Row(f"hf prompt-lookup N={n}{note} greedy", "hf-prompt-lookup", n, 0.0)
    return row, hf_fn(engine, prompt_lookup=n)


def hf_can_assist(engine: SpecEngine) -> bool:
    """Whether HF generate can use the draft model token for token: it takes a draft whose vocabulary size differs
    (a padded output layer) for another tokenizer and asks for universal assisted decoding, which re-tokenizes text
    between the models, no peer of token-level drafting. Says why when it cannot."""
    if "draft" not in engine.drafters:
        return False
    sizes = [loaded.model.config.get_text_config().vocab_size
             for loaded in (engine.target, engine.drafters["draft"].runner.loaded)]  # fmt: skip
    if sizes[0] != sizes[1]:
        print(f"specserve bench: no HF assisted rows: the draft's vocabulary size ({sizes[1]}) differs from the "
              f"target's ({sizes[0]}); HF generate then re-tokenizes text between them", file=sys.stderr)  # fmt: skip
        return False
    return True


def plan_rows(engine: SpecEngine, cfg: BenchConfig) -> list[tuple[Row, RowFn]]:
    """The rows a run measures, in table order: greedy first, then sampled at cfg.temperature."""
    assisted = cfg.hf_rows and hf_can_assist(engine)
    return _demo_plan(engine, cfg, assisted) if cfg.suite == "demo" else _target_plan(engine, cfg, assisted)


def _demo_plan(engine: SpecEngine, cfg: BenchConfig, assisted: bool) -> list[tuple[Row, RowFn]]:
    plan: list[tuple[Row, RowFn]] = []
    draft_k = best_draft_k(cfg)
    for temp in _temperatures(cfg):
        tag = "greedy" if temp == 0 else f"T={temp}"
        plan.append((Row(f"target-only {tag}", "target-only", None, temp), spec_fn(engine, "none", 1)))
        if cfg.hf_rows:
            plan.append((Row(f"hf generate {tag}", "hf-generate", None, temp), hf_fn(engine)))
        if assisted:
            plan.append((Row(f"hf assisted default {tag}", "hf-assisted", "hf-default", temp),
                         hf_fn(engine, assisted=True)))  # fmt: skip
            plan.append((Row(f"hf assisted k={draft_k} {tag}", "hf-assisted", draft_k, temp),
                         hf_fn(engine, draft_k, assisted=True)))  # fmt: skip
        for k in cfg.ks if temp == 0 else (draft_k,):
            plan.append((Row(f"specserve k={k} {tag}", "draft", k, temp), spec_fn(engine, "draft", k)))
        plan.append((Row(f"specserve k=auto {tag}", "draft", "auto", temp), spec_fn(engine, "draft", "auto")))
        if temp == 0:
            plan.append((Row(f"specserve ngram k={draft_k} {tag}", "ngram", draft_k, temp),
                         spec_fn(engine, "ngram", draft_k)))  # fmt: skip
    return plan


def _target_plan(engine: SpecEngine, cfg: BenchConfig, assisted: bool) -> list[tuple[Row, RowFn]]:
    has_draft, has_head = "draft" in engine.drafters, "eagle" in engine.drafters
    draft_k = best_draft_k(cfg)
    plan: list[tuple[Row, RowFn]] = []
    add = lambda name, method, k, temp, fn: plan.append((Row(name, method, k, temp), fn))  # noqa: E731
    for temp in _temperatures(cfg):
        tag, greedy = ("greedy" if temp == 0 else f"T={temp}"), temp == 0
        add(f"target-only {tag}", "target-only", None, temp, spec_fn(engine, "none", 1))
        if greedy and cfg.hf_rows:
            add("hf generate greedy", "hf-generate", None, temp, hf_fn(engine))
            plan.append(prompt_lookup_row(engine, PROMPT_LOOKUP_N))
        chain = (*NGRAM_KS, "auto") if greedy else (SAMPLED_NGRAM_K, "auto")
        sweeps: dict[str, tuple] = {"ngram": chain}
        if has_head:
            trees = (*TREE_KS, "auto") if greedy else (8,)
            sweeps |= {m: chain for m in HEAD_CHAIN_METHODS} | {"eagle-tree": trees}
            sweeps["eagle-tree+ngram"] = trees if greedy else ("auto",)
        sweeps["ngram-tree"] = (*TREE_KS, "auto") if greedy else ()
        if has_draft:
            sweeps["draft"] = (*cfg.ks, "auto") if greedy else (draft_k, "auto")
        for method, ks in selected_sweeps(sweeps, cfg, greedy).items():
            for k in ks:
                add(f"specserve {method} k={k} {tag}", method, k, temp, spec_fn(engine, method, k))
        if greedy and assisted:
            add("hf assisted default greedy", "hf-assisted", "hf-default", temp, hf_fn(engine, assisted=True))
            add(f"hf assisted k={draft_k} greedy", "hf-assisted", draft_k, temp, hf_fn(engine, draft_k, True))
    return plan


def _temperatures(cfg: BenchConfig) -> tuple[float, ...]:
    return (0.0, cfg.temperature) if cfg.sampled else (0.0,)


# The registry's drafting methods (workers/speculation/methods.py): what --methods may name
SPEC_METHODS = tuple(m for m in get_args(SpecMethod) if m != NONE)


def selected_sweeps(sweeps: dict[str, tuple], cfg: BenchConfig, greedy: bool) -> dict[str, tuple]:
    """The k values each speculative method's rows run at: the suite's sweeps, narrowed to --methods (a named
    method the suite has no sweep for gets the chain sweep; one whose drafter is not loaded fails in the warm-up,
    saying what it needs), and with --k the greedy rows at exactly those k (the sampled ones: those of their own k
    that --k names)."""
    chosen = {m: ks for m, ks in sweeps.items() if cfg.methods is None or m in cfg.methods}
    for method in cfg.methods or ():
        chosen.setdefault(method, (*NGRAM_KS, "auto") if greedy else (SAMPLED_NGRAM_K, "auto"))
    if cfg.only_ks is not None:
        chosen = {m: cfg.only_ks if greedy else tuple(k for k in ks if k in cfg.only_ks) for m, ks in chosen.items()}
    return chosen


def parse_methods(text: str | None) -> tuple[str, ...] | None:
    """--methods: a comma list of the registry's methods (None: every row)."""
    if text is None:
        return None
    names = tuple(dict.fromkeys(n.strip() for n in text.split(",") if n.strip()))
    unknown = [n for n in names if n not in SPEC_METHODS]
    if not names or unknown:
        what = f"unknown method {', '.join(map(repr, unknown))}" if unknown else "no method named"
        raise InvalidRequestError("methods", f"{what} (a comma list of: {', '.join(SPEC_METHODS)})")
    return names


def parse_ks(text: str | None) -> tuple[int | str, ...] | None:
    """--k: a comma list of k values (1..MAX_K) and 'auto' (None: each method's own sweep)."""
    if text is None:
        return None
    ks: list[int | str] = []
    for part in (p.strip() for p in text.split(",")):
        k = "auto" if part == "auto" else int(part) if part.isdigit() else None
        if k is None or (k != "auto" and not 1 <= k <= MAX_K):
            raise InvalidRequestError("k", f"{part!r} is neither 'auto' nor a whole number 1..{MAX_K} (e.g. 4,auto)")
        if k not in ks:
            ks.append(k)
    return tuple(ks)


def compare_outputs(row: Row, base: Row) -> None:
    """A greedy row against target-only's: identical, and the share of prompts that were (bf16 on a GPU is not
    batch-invariant: a forward over several positions may flip a near-tie)."""
    row.identical = row.outputs == base.outputs
    same = [a == b for a, b in zip(row.outputs, base.outputs, strict=False)]
    row.identical_share = sum(same) / len(same) if same else None
