"""Drafting with an EAGLE-3 head in the in-process engine (drafting.py does the math; loading.py builds one).

The head reads the target's own features: after each verify the engine hands over those of the positions the target
just computed whose tokens are now committed (`add_features`); the next `propose` rolls the head's cache back to the
first of them, extends it, and chains k steps. Entry t takes the feature of position t and the token at t+1, so with
n+1 committed tokens the head holds n entries: the newest token's feature comes with the next verify. Before the
first verify (the prefill, which computes the prompt's features) there is nothing to draft from: the first round of
a request proposes nothing.

Tokens are drawn as ModelDrafter draws them: greedy, the argmax over the draft vocabulary mapped to its target id;
sampled, from `sparsify` of the request's distribution over the target vocabulary (the head's logits with -inf off
the draft vocabulary, so zero mass there), with the same per-position DRAFT_SALT noise. The proposal's probs are
exactly what was sampled from, so the target's rejection sampler stays lossless.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Sequence

import torch

from specserve.workers.config.request import SamplingParams
from specserve.workers.errors import InvalidRequestError
from specserve.workers.runtime.kv_cache import PREFIX_MIN_TOKENS, RETAINED_MAX
from specserve.workers.runtime.worker_state import common_prefix_length
from specserve.workers.speculation.draft_tree import DraftTree, TreeShape
from specserve.workers.speculation.drafter import DraftRow, Proposal, TreeDraftRow
from specserve.workers.speculation.eagle.drafting import DraftStep, Eagle3Drafting, RequestKV
from specserve.workers.speculation.eagle.head import Eagle3Head
from specserve.workers.speculation.eagle.tree import draft_trees
from specserve.workers.speculation.sampling import draw_token

log = logging.getLogger(__name__)


class EagleDrafter:
    """The Drafter interface over an EAGLE-3 head, plus `add_features` for the target's features.

    embed_weight [V, H]: the target's input embedding; feature_layers: the target layers whose inputs the head reads
    (the target's runner must capture these)."""

    def __init__(
        self, head: Eagle3Head, embed_weight: torch.Tensor, feature_layers: tuple[int, ...], max_support: int = 256
    ):
        self.head = head
        self.drafting = Eagle3Drafting(head, embed_weight)
        self.feature_layers = feature_layers
        self.max_support = max_support
        self._feature_size = 3 * head.config.target_hidden_size
        self._pending: dict[str, tuple[int, torch.Tensor]] = {}  # per request: features not yet in the head's cache
        # Released requests' caches with the tokens they were built from, for a later request that starts with the
        # same tokens: a target that served that request's prefix from its own cache sends no features for it.
        self._retained: OrderedDict[int, tuple[list[int], RequestKV, tuple[int, torch.Tensor] | None]] = OrderedDict()
        self._retained_count = 0
        # Running requests' tokens when their caches were first extended: a new request that shares them gets a copy
        # of the entries built from them (concurrent requests with one system prompt or document).
        self._first_tokens: dict[str, list[int]] = {}
        # positions new requests' targets sent no features for (served from their prefix caches), and of those found
        # in a released request's head cache
        self.prefix_queries = 0
        self.prefix_hits = 0

    @property
    def feature_size(self) -> int:
        """Values per position of the features the head reads (3 x the target's hidden size)."""
        return self._feature_size

    @property
    def device(self) -> torch.device:
        return self.head.fc.weight.device

    def add_features(self, request_id: str, start: int, features: torch.Tensor) -> None:
        """features [m, 3H]: the target's features of committed positions start..start+m-1. Features of positions
        already held (a target that recomputed them) replace the older ones from `start` on. Features that leave a
        gap after those held replace them all: the head then starts its cache again at `start` (a draft worker that
        lost the older ones)."""
        if features.shape[0] == 0:
            return
        pending = self._pending.get(request_id)
        if pending is not None and pending[0] <= start <= pending[0] + pending[1].shape[0]:
            held_start, held = pending
            features, start = torch.cat([held[: start - held_start], features]), held_start
        self._pending[request_id] = (start, features)

    def propose(self, request_id: str, tokens: Sequence[int], k: int, params: SamplingParams) -> Proposal:
        return self.propose_batch([DraftRow(request_id, tokens, k, params)])[0]

    def propose_batch(self, rows: Sequence[DraftRow]) -> list[Proposal]:
        """Draft for many requests at once: one head forward extends every request's cache, then one chained step per
        drafted token over all of them. A request without target features yet proposes nothing; a row of k = 0 with
        new features only extends its cache (a long prompt's chunk, fed ahead of its first draft)."""
        proposals = [Proposal(tokens=[], probs=None) for _ in rows]
        ready = []  # (index into rows, the row for Eagle3Drafting.extend)
        for b, (request_id, tokens, k, _) in enumerate(rows):
            extension = self._extension(request_id, tokens) if k > 0 or request_id in self._pending else None
            if extension is not None:
                ready.append((b, extension))
        if not ready:
            return proposals
        step = self.drafting.extend([extension for _, extension in ready])
        drafting = [i for i, (b, _) in enumerate(ready) if rows[b].k > 0]
        if not drafting:
            return proposals
        if len(drafting) < len(ready):
            ready = [ready[i] for i in drafting]
            index = torch.tensor(drafting, dtype=torch.long, device=step.hidden.device)
            step = DraftStep(step.logits.index_select(0, index), step.hidden.index_select(0, index))
        drafting_rows = [rows[b] for b, _ in ready]
        chain = self.drafting.chain([request_id for request_id, _, _, _ in drafting_rows], step)
        drafted: list[list[int]] = [[] for _ in ready]
        probs: list[list[torch.Tensor]] = [[] for _ in ready]
        for j in range(max(k for _, _, k, _ in drafting_rows)):
            if j:
                step = chain.step(torch.tensor([tokens[-1] for tokens in drafted]))
            for i, (token, q) in enumerate(self._draw(step.logits, drafting_rows, drafted)):
                drafted[i].append(token)
                if q is not None:
                    probs[i].append(q)
        for i, (b, _) in enumerate(ready):
            k = rows[b].k  # rows that wanted fewer drafted on with the others: their extra tokens are dropped
            proposals[b] = Proposal(tokens=drafted[i][:k], probs=torch.stack(probs[i][:k]) if probs[i] else None)
        return proposals

    def propose_tree(self, request_id: str, tokens: Sequence[int], shape: TreeShape) -> DraftTree | None:
        """A draft tree after the committed `tokens` (None before the target's first features)."""
        return self.propose_trees([TreeDraftRow(request_id, tokens, shape)])[0]

    def propose_trees(self, rows: Sequence[TreeDraftRow]) -> list[DraftTree | None]:
        """Trees for many requests: one head forward extends every request's cache, then one forward per level over
        the requests of each shape. A request without target features yet gets None."""
        trees: list[DraftTree | None] = [None] * len(rows)
        ready = []  # (index into rows, the row for Eagle3Drafting.extend)
        for b, row in enumerate(rows):
            extension = self._extension(row.request_id, row.tokens)
            if extension is not None:
                ready.append((b, extension))
        if not ready:
            return trees
        first = self.drafting.extend([extension for _, extension in ready])
        by_shape: dict[TreeShape, list[int]] = {}  # shape -> indices into ready
        for i, (b, _) in enumerate(ready):
            by_shape.setdefault(rows[b].shape, []).append(i)
        for shape, members in by_shape.items():
            index = torch.tensor(members, device=first.hidden.device)
            step = DraftStep(first.logits.index_select(0, index), first.hidden.index_select(0, index))
            request_ids = [rows[ready[i][0]].request_id for i in members]
            for i, tree in zip(members, draft_trees(self.drafting, request_ids, step, shape), strict=True):
                trees[ready[i][0]] = tree
        return trees

    def _extension(self, request_id: str, tokens: Sequence[int]) -> tuple[str, torch.Tensor, list[int]] | None:
        """The Eagle3Drafting.extend row that brings the request's head cache up to its committed `tokens` (rolled
        back first where new features start earlier, restarted where they start later than it holds), or None when
        no target features have come yet."""
        length, committed = self.drafting.length(request_id), len(tokens) - 1  # entries held, entries due
        start, features = self._pending.pop(request_id, (length, None))
        if features is None:
            features = torch.zeros(0, self._feature_size)
            if length == 0:
                return None  # before the first verify
        end = start + features.shape[0]
        if end != committed:
            raise InvalidRequestError(
                "features",
                f"{request_id!r}: the head holds {length} entries and has features of positions {start}..{end - 1}, "
                f"but {len(tokens)} committed tokens need entries 0..{committed - 1}",
            )
        if start > length and length == 0:  # a new request whose target took the start from its prefix cache
            self.prefix_queries += start
            start, features, length = self._reuse(request_id, tokens, start, features)
        if start > length:
            log.debug("request %r: the head lost positions %d..%d: its cache starts again at %d", request_id, length,
                      start - 1, start)  # fmt: skip
            self.drafting.restart(request_id, start)
        elif start < length:
            self.drafting.rollback(request_id, start)
        if request_id not in self._first_tokens:
            self._first_tokens[request_id] = list(tokens)
        return request_id, features, list(tokens[start + 1 : end + 1])

    def _draw(
        self, logits: torch.Tensor, rows: Sequence[DraftRow], drafted: Sequence[Sequence[int]]
    ) -> list[tuple[int, torch.Tensor | None]]:
        """logits [B, draft_vocab_size] of one drafting step -> per row, its token (target id) and the draft probs it
        was drawn from (None: greedy). `drafted`: each row's tokens drafted so far this round, before this step's.
        Greedy rows without logits controls take the head's argmax as it is; the others go through draw_token over
        the target vocabulary, under the request's controls."""
        greedy = self.head.draft_to_target(logits.argmax(-1)).tolist()
        out = []
        for i, (_, tokens, _, params) in enumerate(rows):
            if params.greedy and not params.has_logits_controls:
                out.append((greedy[i], None))
            else:
                target_logits = self.head.to_target_logits(logits[i].float())  # [V], -inf off the draft vocabulary
                position = len(tokens) + len(drafted[i])
                before = [*tokens, *drafted[i]] if params.has_logits_controls else ()  # copied only where counted
                out.append(draw_token(target_logits, params, position, self.max_support, before))
        return out

    def release(self, request_id: str, tokens: Sequence[int] | None = None) -> None:
        """Forget the request; with its committed `tokens`, its cache is retained for later requests that start with
        them (prefix caching, as the target's KV cache store does)."""
        state = self.drafting.release(request_id)
        self._first_tokens.pop(request_id, None)
        pending = self._pending.pop(request_id, None)  # the last rounds' features, never drafted from
        if tokens is not None and state is not None and state.offset == 0 and state.count >= PREFIX_MIN_TOKENS:
            self._retained[self._retained_count] = (list(tokens), state, pending)
            self._retained_count += 1
            while len(self._retained) > RETAINED_MAX:
                self._retained.popitem(last=False)

    def forget_retained(self) -> None:
        """Give up every retained cache (a bench's rows start cold)."""
        self._retained.clear()

    def held_prefix(self, tokens: Sequence[int]) -> int:
        """The most leading positions of `tokens` a retained or running request's cache holds entries for (with the
        features it was still to read): what a new request's target may serve from its own prefix cache without
        leaving the head a gap."""
        best = 0
        for held, state, pending in (*self._retained.values(), *self._running()):
            best = max(best, min(_reach(state, pending), common_prefix_length(held, tokens) - 1))
        return best

    def _running(self) -> list[tuple[list[int], RequestKV, None]]:
        """Running requests' caches that start at position 0, with the tokens they were first built from (their
        entries before those tokens' last depend on those tokens only)."""
        found = []
        for request_id, tokens in self._first_tokens.items():
            state = self.drafting.held(request_id)
            if state is not None and state.offset == 0:
                found.append((tokens, state, None))
        return found

    def _reuse(
        self, request_id: str, tokens: Sequence[int], start: int, features: torch.Tensor
    ) -> tuple[int, torch.Tensor, int]:
        """Install the retained cache that holds (with the features it was still to read) the entries of positions
        before `start` for these tokens: entry i reads the target's features of position i, which depend on tokens
        0..i, and token i + 1. Returns the (start, features) to extend it with and the entries it holds; (start,
        features, 0) unchanged when none does."""
        for key, (held, state, pending) in reversed(self._retained.items()):  # most recent first
            if _reach(state, pending) < start or common_prefix_length(held, tokens) < start + 1:
                continue
            del self._retained[key]
            self.drafting.install(request_id, state)
            self.prefix_hits += start
            if state.end >= start:
                self.drafting.rollback(request_id, start)
                return start, features, start
            missing = pending[1][: start - state.end].to(features.dtype)
            return state.end, torch.cat([missing, features]), state.end
        for held, state, _ in self._running():  # a running request's entries: copied, it goes on with its own
            if state.end >= start and common_prefix_length(held, tokens) >= start + 1:
                self.drafting.install(request_id, state.prefix_copy(start))
                self.prefix_hits += start
                return start, features, start
        return start, features, 0


def _reach(state: RequestKV, pending: tuple[int, torch.Tensor] | None) -> int:
    """The positions a retained head cache can give a new request: its entries, and the features it was still to read
    where they follow on."""
    return state.end + (pending[1].shape[0] if pending is not None and pending[0] == state.end else 0)
