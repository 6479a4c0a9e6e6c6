"""The target's side of EAGLE-3 training data: the questions it writes, its answers, and its features along them.

Questions and answers are generated in `gen_dtype` (fp32, or bf16 where the CPU or GPU has native bf16: faster there,
and its greedy token equals the fp32 argmax at ~98% of positions), in batches with left padding and position
ids counted from each row's first token, so a padded row decodes as it would alone. Features and the final normed
state come from one fp32 forward over prompt + answer (right padding), so the trainer's labels are the fp32 target's.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache
from transformers.utils import logging as hf_logging

from specserve.workers.errors import ModelLoadError
from specserve.workers.models.chat_questions import HELD_OUT_QUESTIONS, TRAIN_QUESTIONS, question_prompt_ids
from specserve.workers.training.eagle_prompts import (
    LANGUAGES,
    PASSAGE_TASKS,
    TOPICS,
    QuestionFilter,
    passage_prompt,
    question_prefix,
)

log = logging.getLogger(__name__)

_FP16_MAX = 65504.0
_NUCLEUS_CANDIDATES = 512
_BARREN_ROUNDS = 5  # question rounds in a row with no usable question: the target does not write questions


class Sampling:
    """Temperature and nucleus for sampled generation; None in its place means greedy."""

    def __init__(self, temperature: float, top_p: float = 1.0):
        self.temperature = temperature
        self.top_p = top_p


class EagleTarget:
    """A target loaded twice: `gen_model` in `gen_dtype` for generation, `model` in fp32 for features."""

    def __init__(self, path: str | Path, gen_dtype: str = "float32", device: str = "cpu"):
        self.path = str(path)
        self.device = torch.device(device)
        bars_were_on = hf_logging.is_progress_bar_enabled()
        hf_logging.disable_progress_bar()  # two sub-second loads: their bars would only push the data bar around
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(self.path, local_files_only=True)
            self.model = AutoModelForCausalLM.from_pretrained(self.path, local_files_only=True, dtype=torch.float32)
            dtype = getattr(torch, gen_dtype)
            self.gen_model = (
                self.model
                if dtype == torch.float32
                else AutoModelForCausalLM.from_pretrained(self.path, local_files_only=True, dtype=dtype)
            )
        except (OSError, ValueError) as err:
            raise ModelLoadError(f"cannot load the target {self.path!r}: {err}") from err
        finally:
            if bars_were_on:
                hf_logging.enable_progress_bar()
        self.model.to(self.device).eval()
        self.gen_model.to(self.device).eval()
        config = self.model.config
        self.num_hidden_layers, self.hidden_size, self.vocab_size = (
            config.num_hidden_layers,
            config.hidden_size,
            config.vocab_size,
        )
        self.eos_ids = _eos_ids(self.tokenizer, self.model)
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.eos_ids[0]
        self.templated = bool(getattr(self.tokenizer, "chat_template", None))
        self.filter = QuestionFilter(HELD_OUT_QUESTIONS, list(self.tokenizer.all_special_tokens))
        # A question that starts a new paragraph has turned into a document: stop it there (and drop it) rather
        # than decode the rest of it.
        texts = self.tokenizer.batch_decode([[i] for i in range(len(self.tokenizer))])
        self.paragraph_ids = tuple(i for i, text in enumerate(texts) if "\n\n" in text)

    @torch.no_grad()
    def generate(
        self, rows: list[list[int]], max_new: int, sampling: Sampling | None, seed: int, stop_ids: tuple[int, ...] = ()
    ) -> list[list[int]]:
        """Each row's new tokens, through its first EOS (kept: the drafter learns to end answers) or stop token, or
        `max_new` of them.

        Rows leave the batch (and the KV cache) as they end: HF `generate` computes finished rows to the end."""
        width = max(len(r) for r in rows)
        ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, row in enumerate(rows):
            ids[i, width - len(row) :] = torch.tensor(row)
            mask[i, width - len(row) :] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)  # left padding: each row counts from its first token
        cache = DynamicCache(config=self.gen_model.config)
        generator = torch.Generator(device=self.device).manual_seed(seed)
        ends = torch.tensor([*self.eos_ids, *stop_ids], device=self.device)
        live, new = torch.arange(len(rows), device=self.device), [[] for _ in rows]
        logits = self._step(ids, mask, positions, cache)
        next_position = positions[:, -1:] + 1
        for step in range(max_new):
            tokens = _pick(logits, sampling, generator)
            for row, token in zip(live.tolist(), tokens.tolist(), strict=True):
                new[row].append(token)
            going = ~torch.isin(tokens, ends)
            if step == max_new - 1 or not going.any():
                break
            if not going.all():
                keep = going.nonzero().squeeze(1)
                for layer in cache.layers:
                    layer.batch_select_indices(keep)
                live, tokens, mask, next_position = live[keep], tokens[keep], mask[keep], next_position[keep]
            mask = torch.cat([mask, torch.ones((len(live), 1), dtype=mask.dtype, device=self.device)], dim=1)
            logits = self._step(tokens[:, None], mask, next_position, cache)
            next_position = next_position + 1
        return new

    def _step(self, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, cache) -> torch.Tensor:
        out = self.gen_model(input_ids=ids, attention_mask=mask, position_ids=positions, cache=cache, logits_to_keep=1)
        return out.logits[:, -1].float()

    def questions(self, count: int, rng: np.random.Generator, max_new_tokens: int, batch: int) -> list[str]:
        """`count` distinct Magpie questions: the target continues a topic's chat rendering cut where the user's
        words begin (after a few opening words), at temperature 1. Unfinished, degenerate or held-out ones are
        dropped."""
        kept: list[str] = []
        barren = 0
        while len(kept) < count:
            rows = min(batch, 2 * (count - len(kept)) + 2)
            topics = rng.integers(len(TOPICS), size=rows)
            openings = [TOPICS[t].openings[rng.integers(len(TOPICS[t].openings))] for t in topics]
            prefixes = [
                question_prefix(self.tokenizer, TOPICS[t].system, o) for t, o in zip(topics, openings, strict=True)
            ]
            encoded = [self._encode(p) for p in prefixes]
            before = len(kept)
            new_rows = self.generate(encoded, max_new_tokens, Sampling(1.0), _seed(rng), self.paragraph_ids)
            for opening, new in zip(openings, new_rows, strict=True):
                if not new or new[-1] not in self.eos_ids:
                    continue  # ran out of tokens: not a finished question
                text = (opening + self.tokenizer.decode(new[:-1], skip_special_tokens=False)).strip()
                if self.filter.keep(text) and text not in kept and len(kept) < count:
                    kept.append(text)
            barren = 0 if len(kept) > before else barren + 1
            if barren >= _BARREN_ROUNDS:
                raise ModelLoadError(
                    f"the target {self.path!r} wrote no usable question in {_BARREN_ROUNDS} rounds of {rows}: "
                    "EAGLE-3 data needs an instruct model that ends its turns with its EOS token"
                )
        return kept

    def answers(
        self,
        prompts: list[list[int]],
        sampled: list[bool],
        max_new: int,
        sampling: Sampling,
        rng: np.random.Generator,
        batch: int,
        on_batch: Callable[[int], None] | None = None,
    ) -> list[list[int]]:
        """The target's answer to each prompt: greedy, or sampled with `sampling` where `sampled[i]`. Rows of a
        batch have similar prompt lengths (less padding); `on_batch(answer tokens)` reports progress."""
        answers: list[list[int]] = [[] for _ in prompts]
        for mode in (False, True):
            group = sorted((i for i in range(len(prompts)) if sampled[i] == mode), key=lambda i: len(prompts[i]))
            for start in range(0, len(group), batch):
                chunk = group[start : start + batch]
                new = self.generate([prompts[i] for i in chunk], max_new, sampling if mode else None, _seed(rng))
                for i, tokens in zip(chunk, new, strict=True):
                    answers[i] = tokens
                if on_batch is not None:
                    on_batch(sum(len(t) for t in new))
        return answers

    def chat_prompt(self, question: str) -> list[int]:
        """The bench's rendering of `question` (the template's default system prompt)."""
        return question_prompt_ids(self.tokenizer, question)

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=not self.templated)["input_ids"])

    @torch.no_grad()
    def features(
        self, sequences: list[list[int]], layers: list[int], batch_tokens: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """fp16 [T, len(layers) * H] hidden_states[layers] concatenated and fp16 [T, H] hidden_states[-1] (the final
        normed state) over the concatenated sequences, from fp32 forwards of length-sorted, right-padded batches."""
        starts = np.concatenate([[0], np.cumsum([len(s) for s in sequences])])
        features = torch.empty((int(starts[-1]), len(layers) * self.hidden_size), dtype=torch.float16)
        last = torch.empty((int(starts[-1]), self.hidden_size), dtype=torch.float16)
        for chunk in _token_batches(sequences, batch_tokens):
            width = max(len(sequences[i]) for i in chunk)
            ids = torch.full((len(chunk), width), self.pad_id, dtype=torch.long)
            mask = torch.zeros((len(chunk), width), dtype=torch.long)
            for row, i in enumerate(chunk):
                ids[row, : len(sequences[i])] = torch.tensor(sequences[i])
                mask[row, : len(sequences[i])] = 1
            ids, mask = ids.to(self.device), mask.to(self.device)
            out = self.model.model(input_ids=ids, attention_mask=mask, output_hidden_states=True, use_cache=False)
            hidden = torch.cat([out.hidden_states[layer] for layer in layers], dim=-1)
            for row, i in enumerate(chunk):
                n, at = len(sequences[i]), int(starts[i])
                features[at : at + n] = _half(hidden[row, :n]).cpu()
                last[at : at + n] = _half(out.last_hidden_state[row, :n]).cpu()
        return features, last


def _eos_ids(tokenizer, model) -> list[int]:
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    configured = getattr(model.generation_config, "eos_token_id", None)
    ids |= set(configured) if isinstance(configured, list) else ({configured} if configured is not None else set())
    if not ids:
        raise ModelLoadError(f"the target {model.name_or_path!r} names no EOS token: its answers could not end")
    return sorted(ids)


def _pick(logits: torch.Tensor, sampling: Sampling | None, generator: torch.Generator) -> torch.Tensor:
    """The next token of each row: the argmax, or a sample at `sampling`'s temperature from its top-p nucleus."""
    if sampling is None:
        return logits.argmax(-1)
    probs = torch.softmax(logits / sampling.temperature, dim=-1)
    if sampling.top_p >= 1.0:
        return torch.multinomial(probs, 1, generator=generator).squeeze(1)
    # The nucleus from the top candidates: sorting every row's whole vocabulary made a sampled step 1.5x a greedy one.
    top, order = probs.topk(min(_NUCLEUS_CANDIDATES, probs.shape[-1]), dim=-1)
    if bool((top.sum(-1) < sampling.top_p).any()):  # a flat row: its nucleus is wider than the candidates
        top, order = probs.sort(dim=-1, descending=True)
    outside = top.cumsum(-1) - top >= sampling.top_p  # the most likely token always stays
    pick = torch.multinomial(top.masked_fill(outside, 0.0), 1, generator=generator)
    return order.gather(-1, pick).squeeze(1)


def _seed(rng: np.random.Generator) -> int:
    return int(rng.integers(2**62))


def _token_batches(sequences: list[list[int]], batch_tokens: int) -> list[list[int]]:
    """Indices in batches of similar lengths whose padded size stays within `batch_tokens` (one row at least)."""
    order = sorted(range(len(sequences)), key=lambda i: -len(sequences[i]))
    batches: list[list[int]] = []
    for i in order:
        if batches and len(sequences[batches[-1][0]]) * (len(batches[-1]) + 1) <= batch_tokens:
            batches[-1].append(i)
        else:
            batches.append([i])
    return batches


def _half(x: torch.Tensor) -> torch.Tensor:
    """fp16 as the format stores it; a value past fp16's range (none seen: SmolLM2's peak ~2.5e4) is clamped."""
    peak = float(x.abs().max()) if x.numel() else 0.0
    if peak > _FP16_MAX:
        log.warning("a feature of %.3g exceeds float16's range: clamped to %g", peak, _FP16_MAX)
    return x.clamp(-_FP16_MAX, _FP16_MAX).to(torch.float16)


def pick_questions(
    target: EagleTarget, count: int, rng: np.random.Generator, train_fraction: float, max_new_tokens: int, batch: int
) -> tuple[list[str], list[bool]]:
    """`count` questions, each a TRAIN_QUESTIONS entry with probability `train_fraction` (always answered sampled,
    so repeats get new answers) or a Magpie question of the target's; and whether each came from TRAIN_QUESTIONS."""
    from_train = list(rng.random(count) < train_fraction)
    fixed = [TRAIN_QUESTIONS[j] for j in rng.integers(len(TRAIN_QUESTIONS), size=sum(from_train))]
    magpie = iter(target.questions(count - len(fixed), rng, max_new_tokens, batch) if len(fixed) < count else [])
    fixed_iter = iter(fixed)
    return [next(fixed_iter) if t else next(magpie) for t in from_train], from_train


def passage_requests(
    target: EagleTarget, questions: list[str], answers: list[list[int]], rng: np.random.Generator, fraction: float
) -> list[str]:
    """For a `fraction` of the answers (those that ended and are long enough), a request over the answer's text: a
    summary, a question over it as a passage, a translation (eagle_prompts.PASSAGE_TASKS). Held-out questions never
    reach here, and a request that quotes one is dropped like a question would be."""
    requests = []
    for question, answer, pick in zip(questions, answers, rng.random(len(answers)) < fraction, strict=True):
        task = PASSAGE_TASKS[rng.integers(len(PASSAGE_TASKS))]
        language = LANGUAGES[rng.integers(len(LANGUAGES))]
        if not pick or not answer or answer[-1] not in target.eos_ids:
            continue
        text = target.tokenizer.decode(answer[:-1], skip_special_tokens=True)
        request = passage_prompt(task, question, text, language)
        if request is not None and not target.filter.is_held_out(request):
            requests.append(request)
    return requests
