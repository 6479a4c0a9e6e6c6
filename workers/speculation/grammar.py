"""Structured output: each request's grammar matcher, and the masks it puts on the target's distribution at every
verified position (the issue's response_format: a JSON object, or JSON valid against a schema).

The grammar engine is xgrammar (vLLM's and SGLang's default): CPU wheels on the package index, JSON schemas compiled
against a tokenizer's vocabulary in milliseconds, token masks in microseconds, and a matcher that rolls back (which
speculation needs: drafted tokens are tried, then rejected ones are taken back). llguidance and outlines-core were the
alternatives; xgrammar is the one both big servers ship by default, and its matcher API is exactly the one speculative
verification needs (`fill_next_token_bitmask`, `accept_token`, `rollback`, `is_terminated`).

Where the matcher lives: on the target worker, next to the request's KV state (docs/serving.md#structured-output). The
request's format travels in its SamplingParams (a few hundred bytes, validated once per request by the worker's
sampling cache); the worker keeps a `RequestGrammar` per request, brings it up to the committed tokens it is told of
(`sync`), masks the verified positions itself and takes the drafted tokens back after verification. So nothing per
position crosses the wire, and a request that moves to another worker re-syncs from its committed tokens there.

Semantics, the same in process and served:
- the mask applies to the target's logits at every verified position, after the logits controls: what the grammar
  forbids gets probability 0 (greedy: the argmax among the allowed tokens);
- drafted tokens are checked before verification: the first forbidden one ends a chain (a sampled chain with draft
  probabilities keeps it as its last, certainly rejected, token so the recovered token is drawn from the residual, as
  rejection sampling requires), and prunes a tree with its subtree (a tree's candidates are deterministic: pruning a
  child the target gives probability 0 changes nothing);
- EOS (the model's end tokens) is allowed exactly where the grammar is complete; once it is accepted the grammar is
  terminated and only EOS stays allowed (with ignore_eos, the output goes on with EOS tokens);
- where the controls and the grammar together leave no token (min_tokens masking EOS where the grammar allows only
  EOS), the grammar wins: that position takes the grammar's mask on the raw logits.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence

import torch

from specserve.workers.config.request import ResponseFormat
from specserve.workers.errors import InvalidRequestError
from specserve.workers.speculation.grammar_formats import FIELD, MAX_WHITESPACE, not_enforceable, schema_text, xgrammar

_BITS = 32  # xgrammar's bitmask words are int32
_xgr = xgrammar


def unpack(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """xgrammar's bitmask [P, ceil(V / 32)] int32 -> [P, vocab] bool: which tokens the grammar allows."""
    shifts = torch.arange(_BITS, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1  # [P, W, 32]
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab].bool()


def apply_mask(logits: torch.Tensor, raw: torch.Tensor, allowed: torch.Tensor | None) -> torch.Tensor:
    """logits [P, V] (after the controls) with what the grammar forbids at -inf; a position where nothing is left takes
    the grammar's mask on its raw logits [P, V] (the grammar wins over min_tokens / logit_bias)."""
    if allowed is None:
        return logits
    allowed = allowed.to(logits.device)
    masked = logits.masked_fill(~allowed, float("-inf"))
    empty = ~torch.isfinite(masked).any(-1, keepdim=True)  # [P, 1]
    if bool(empty.any()):
        masked = torch.where(empty, raw.float().masked_fill(~allowed, float("-inf")), masked)
    return masked


class Grammars:
    """One model's compiler (its vocabulary, built on first use) and its requests' matchers, by request id (at most
    `max_requests`: requests whose scheduler never released them age out)."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: Sequence[int], max_requests: int = 4096):
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self.stop_token_ids = sorted(stop_token_ids)
        self.max_requests = max_requests
        self._compiler = None
        self._lock = threading.Lock()
        self._requests: OrderedDict[str, RequestGrammar] = OrderedDict()

    def _compile(self, fmt: ResponseFormat):
        with self._lock:
            if self._compiler is None:
                xgr = _xgr()
                info = xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size,
                                                          stop_token_ids=self.stop_token_ids)  # fmt: skip
                self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_limit_bytes=64 << 20)
        try:
            return self._compiler.compile_json_schema(schema_text(fmt), any_whitespace=True,
                                                      max_whitespace_cnt=MAX_WHITESPACE)  # fmt: skip
        except (ValueError, RuntimeError, TypeError) as e:
            raise not_enforceable(e) from None

    def for_request(self, request_id: str, fmt: ResponseFormat) -> RequestGrammar:
        state = self._requests.get(request_id)
        if state is None or state.format != fmt:
            state = RequestGrammar(fmt, self._compile(fmt), self.vocab_size, self.stop_token_ids)
            self._requests[request_id] = state
            while len(self._requests) > self.max_requests:
                self._requests.popitem(last=False)
        self._requests.move_to_end(request_id)
        return state

    def release(self, request_id: str) -> None:
        self._requests.pop(request_id, None)

    def __len__(self) -> int:
        return len(self._requests)


class RequestGrammar:
    """One request's matcher, kept at the request's committed generated tokens between verifications."""

    def __init__(self, fmt: ResponseFormat, compiled, vocab_size: int, stop_token_ids: Sequence[int]):
        self.format = fmt
        self.matcher = _xgr().GrammarMatcher(compiled)
        self.vocab_size = vocab_size
        self.stop_token_ids = list(stop_token_ids)
        self.fed: list[int] = []  # the generated tokens the matcher's state covers
        self.held = 0  # how many of them the matcher accepted (the rest came after it terminated: EOS only)
        self._bitmask = _xgr().allocate_token_bitmask(1, vocab_size)

    def _accept(self, token: int) -> bool:
        if self.matcher.is_terminated():
            ok = token in self.stop_token_ids
        else:
            ok = self.matcher.accept_token(token)
            self.held += ok
        if ok:
            self.fed.append(token)
        return ok

    def _rollback(self, length: int) -> None:
        """Back to the first `length` fed tokens."""
        keep = min(self.held, length)
        if self.held > keep:
            self.matcher.rollback(self.held - keep)
            self.held = keep
        del self.fed[length:]

    def sync(self, generated: Sequence[int]) -> None:
        """Bring the matcher to the request's committed generated tokens (usually: accept the last round's)."""
        same = 0
        limit = min(len(self.fed), len(generated))
        while same < limit and self.fed[same] == generated[same]:
            same += 1
        self._rollback(same)
        for i in range(same, len(generated)):
            if not self._accept(int(generated[i])):
                raise InvalidRequestError(FIELD, f"committed token {generated[i]} (generated position {i}) is not "
                                          "allowed by the request's grammar")  # fmt: skip

    def _mask_row(self) -> torch.Tensor:
        """[1, V] bool: what may come next (after termination: EOS only)."""
        if self.matcher.is_terminated():
            row = torch.zeros(1, self.vocab_size, dtype=torch.bool)
            row[0, [t for t in self.stop_token_ids if t < self.vocab_size]] = True
            return row
        self.matcher.fill_next_token_bitmask(self._bitmask)
        return unpack(self._bitmask, self.vocab_size)

    def chain(self, drafted: Sequence[int], keep_forbidden: bool) -> tuple[int, torch.Tensor]:
        """(length, allowed): the chain to verify is drafted[:length] (up to its first forbidden token; with
        `keep_forbidden` that token too) and allowed [length + 1, V] the mask at each of its positions (the one after a
        kept forbidden token allows everything: verification never reaches it). The matcher ends where it began."""
        base, rows = len(self.fed), []
        for token in drafted:
            rows.append(self._mask_row())
            if not rows[-1][0, token] or not self._accept(int(token)):
                break
        else:
            rows.append(self._mask_row())
        usable = len(self.fed) - base
        self._rollback(base)
        length = usable
        if usable < len(drafted) and keep_forbidden:
            length += 1
            rows.append(torch.ones(1, self.vocab_size, dtype=torch.bool))
        return length, torch.cat(rows[: length + 1])

    def tree(self, tokens: Sequence[int], parents: Sequence[int]) -> tuple[list[int], torch.Tensor]:
        """(kept, allowed): the nodes the grammar allows on their path (their ancestors all kept; a pruned node takes
        its subtree with it), in order, and allowed [N + 1, V]: row 0 at the root, row i + 1 after node i (rows of
        pruned nodes are all False). The matcher ends where it began."""
        base, n = len(self.fed), len(tokens)
        children: list[list[int]] = [[] for _ in range(n + 1)]
        for i, parent in enumerate(parents):
            children[parent + 1].append(i)
        allowed = torch.zeros(n + 1, self.vocab_size, dtype=torch.bool)
        kept: list[int] = []
        stack = [(-1, base)]  # (node, fed length on its path); -1 is the root
        while stack:
            node, depth = stack.pop()
            self._rollback(depth)
            if node >= 0 and not self._accept(int(tokens[node])):
                continue
            if node >= 0:
                kept.append(node)
            allowed[node + 1] = self._mask_row()[0]
            stack.extend(
                (child, len(self.fed)) for child in reversed(children[node + 1]) if allowed[node + 1, tokens[child]]
            )
        self._rollback(base)
        return sorted(kept), allowed
