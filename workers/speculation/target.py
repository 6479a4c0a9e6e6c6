"""The target side of a round: one forward pass over the drafted tokens, then verification."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from specserve.workers.config.request import SamplingParams
from specserve.workers.runtime.runner import ForwardRow, ModelRunner, RowOutput
from specserve.workers.runtime.tree_rows import TreeRow
from specserve.workers.speculation.codec import normalise
from specserve.workers.speculation.grammar import Grammars, apply_mask
from specserve.workers.speculation.grammar_rows import constrain_chain, constrain_tree
from specserve.workers.speculation.logits_controls import controlled_logits
from specserve.workers.speculation.logprobs import TokenLogprob, token_logprobs
from specserve.workers.speculation.sampling import exponential_noise, logits_to_probs, uniform_noise
from specserve.workers.speculation.tree_verification import greedy_tree_verify, rejection_tree_verify
from specserve.workers.speculation.verification import VerifyOutput, greedy_verify, rejection_verify


class VerifyRow(NamedTuple):
    """One request's drafted chain to verify: its committed tokens, how to sample, the noise source."""

    request_id: str
    tokens: Sequence[int]  # the committed sequence
    drafted: Sequence[int]  # the chain to verify as its continuation (none: a plain target step)
    # [len(drafted), V] the distributions the drafted tokens were drawn from (truncated; normalised here), or None
    # for one-hot (deterministic drafters, and greedy requests, where only the tokens matter)
    draft_probs: torch.Tensor | None
    params: SamplingParams
    generator: torch.Generator
    # The logprobs of committed tokens 1.. with this many alternatives (the prompt's, on the call that prefills it):
    # the forward computes the whole sequence and keeps every position's logits; None: not asked
    prompt_logprobs: int | None = None
    prefix_at_most: int | None = None  # a request new to the cache: the most positions taken from a cached prefix
    expected_len: int | None = None  # the length its sequence soon reaches (a chunked prompt's): its KV run's size


@dataclass(frozen=True)
class Verdict:
    """One row's verification, a chain's or a tree's: the round commits the accepted drafted tokens (a tree's: the
    path's), then next_token."""

    accepted: int
    next_token: int  # recovered or bonus
    features: torch.Tensor | None  # [m, F]: the features of committed positions feature_start.. (when captured)
    feature_start: int
    logprobs: list[TokenLogprob] | None = None  # of the accepted tokens and next_token, when params.logprobs is set
    path: list[int] | None = None  # a tree's accepted nodes, root-down (accepted of them); None for a chain
    prompt_logprobs: list[TokenLogprob] | None = None  # of committed tokens 1.. with ranks, when the row asks


@dataclass(frozen=True)
class TreeCall:
    """One request's tree to verify: the tree (its committed tokens included), how to sample, the noise source."""

    tree: TreeRow
    params: SamplingParams
    generator: torch.Generator


class TargetVerifier:
    """Verifies proposals for requests whose caches live in `runner`."""

    def __init__(self, runner: ModelRunner):
        self.runner = runner
        # Each structured-output request's grammar matcher, next to its KV cache (grammar.py)
        self.grammars = Grammars(runner.loaded.tokenizer, runner.vocab_size, runner.loaded.eos_token_ids)

    @property
    def vocab_size(self) -> int:
        return self.runner.vocab_size

    def verify(
        self,
        request_id: str,
        tokens: Sequence[int],
        drafted: Sequence[int],
        draft_probs: torch.Tensor | None,
        params: SamplingParams,
        generator: torch.Generator,
    ) -> Verdict:
        """Verify `drafted` as the continuation of committed `tokens` (one VerifyRow's fields): the round commits the
        Verdict's accepted drafted tokens, then its next_token. With nothing drafted this is plain target-only
        decoding: the next token is the bonus token from p."""
        return self.verify_rows([VerifyRow(request_id, tokens, drafted, draft_probs, params, generator)])[0]

    def verify_rows(self, rows: Sequence[VerifyRow], capture: bool = False) -> list[Verdict]:
        """Verify many requests' chains in one forward pass, each row alone with its own generator. With `capture`
        also the target's features (the runner's `capture_features` layers) of the positions this pass computed whose
        tokens are now committed: all but the drafted tokens it rejected (the position of the bonus or recovered
        token is not among them: the next pass computes it); else None. For rows whose params ask (`params.logprobs`)
        the committed tokens' logprobs, from the same raw logits. A row with a response_format verifies its drafted
        tokens up to the grammar's first forbidden one, under the grammar's mask (accepted counts within them). A row
        that asks for its prompt's logprobs (`prompt_logprobs`) keeps the logits of every position it feeds (only it:
        a packed pass keeps each row's own)."""
        return self.verify_mixed(rows, (), capture)[0]

    def verify_trees(self, calls: Sequence[TreeCall], capture: bool = False) -> list[Verdict]:
        """Verify many requests' drafted trees in one forward pass; the accepted path of each stays in its cache.
        Greedy: the path of argmax matches; sampled: recursive rejection sampling over each node's children (for
        candidates chosen deterministically, as a head's top children and prompt lookup's are). With `capture`, the
        features of the positions computed whose tokens are now committed (the uncached committed ones, then the
        path's), as `verify_rows`. A tree with a response_format loses its forbidden nodes (with their
        subtrees) before the forward pass and is verified under the grammar's mask; its path names the caller's
        nodes."""
        return self.verify_mixed((), calls, capture)[1]

    def verify_mixed(self, rows: Sequence[VerifyRow], calls: Sequence[TreeCall],
                     capture: bool = False) -> tuple[list[Verdict], list[Verdict]]:  # fmt: skip
        """`verify_rows` and `verify_trees` in one forward pass: a worker's chains (prompt chunks and plain steps
        among them) and trees share the reading of the weights."""
        constrained = [constrain_chain(self.grammars, row) for row in rows]
        rows, masks = [row for row, _ in constrained], [allowed for _, allowed in constrained]
        sequences = [
            ForwardRow(r.request_id, [*r.tokens, *r.drafted], _kept(r), r.prefix_at_most, r.expected_len) for r in rows
        ]
        pruned = [constrain_tree(self.grammars, call.tree, call.params) for call in calls]
        calls = [
            call if p is None else TreeCall(p.tree, call.params, call.generator)
            for call, p in zip(calls, pruned, strict=True)
        ]
        chained, treed = self.runner.forward_mixed(sequences, [call.tree for call in calls], capture=capture)
        return self._chain_verdicts(rows, masks, chained), self._tree_verdicts(calls, pruned, treed)

    def _chain_verdicts(self, rows: Sequence[VerifyRow], masks, outputs: Sequence[RowOutput]) -> list[Verdict]:
        verdicts = []
        for row, allowed, out in zip(rows, masks, outputs, strict=True):
            tokens, drafted, params = row.tokens, row.drafted, row.params
            raw = out.logits[-(len(drafted) + 1) :]  # [k + 1, V]
            logits = apply_mask(controlled_logits(raw, params, tokens, drafted), raw, allowed)
            verified = self._verify_row(list(drafted), row.draft_probs, params, row.generator, logits)
            accepted, token = int(verified.accepted[0]), int(verified.next_token[0])
            features, start = None, 0
            if out.features is not None:
                start = out.start
                features = out.features[: len(tokens) + accepted - start]  # computed and now committed
            logprobs = None
            if params.logprobs is not None:  # raw logits rows 0..accepted chose the accepted tokens and the next one
                logprobs = token_logprobs(raw[: accepted + 1], list(drafted[:accepted]) + [token], params.logprobs)
            prompt = None
            if row.prompt_logprobs is not None:  # rows 0..L-2 chose committed tokens 1..L-1
                prompt = token_logprobs(out.logits[: len(tokens) - 1], tokens[1:], row.prompt_logprobs, ranks=True)
            verdicts.append(Verdict(accepted, token, features, start, logprobs, prompt_logprobs=prompt))
        return verdicts

    def _tree_verdicts(self, calls: Sequence[TreeCall], pruned, outputs: Sequence[RowOutput]) -> list[Verdict]:
        verdicts = []
        for call, out, cut in zip(calls, outputs, pruned, strict=True):
            tree, logits = call.tree, out.logits  # [N + 1, V]
            parents = torch.tensor([list(tree.parents)], dtype=torch.long, device=logits.device)  # [1, N]
            tokens = torch.tensor([list(tree.tokens)], dtype=torch.long, device=logits.device)  # [1, N]
            valid = torch.ones_like(tokens, dtype=torch.bool)
            logits = controlled_logits(logits, call.params, tree.sequence, tree.tokens, tree.parents)
            logits = apply_mask(logits, out.logits, None if cut is None else cut.allowed)
            if call.params.greedy:
                result = greedy_tree_verify(parents, tokens, valid, logits.argmax(-1).unsqueeze(0))
            else:
                p = logits_to_probs(logits, call.params).unsqueeze(0)  # [1, N + 1, V]
                uniform = uniform_noise(tokens.shape[1], [call.generator], device=p.device)  # [1, N]
                noise = exponential_noise(p.shape[-1], [call.generator], device=p.device)  # [1, V]
                result = rejection_tree_verify(parents, tokens, valid, p, uniform, noise)
            path = result.accepted_nodes(0)
            self.runner.keep_path(tree.request_id, path)
            features = None
            if out.features is not None:
                tail = len(tree.sequence) - out.start
                features = torch.cat([out.features[:tail], out.features[[tail + node for node in path]]])
            next_token, logprobs = int(result.next_token[0]), None
            if call.params.logprobs is not None:  # raw logits row 0: after the root; row i + 1: after node i
                chosen = [tree.tokens[node] for node in path] + [next_token]
                rows = [0] + [node + 1 for node in path]
                logprobs = token_logprobs(out.logits[rows], chosen, call.params.logprobs)
            path = path if cut is None else [cut.kept[node] for node in path]  # the caller's node numbers
            verdicts.append(Verdict(len(path), next_token, features, out.start, logprobs, path))
        return verdicts

    def _verify_row(
        self,
        drafted: list[int],
        draft_probs: torch.Tensor | None,
        params: SamplingParams,
        generator: torch.Generator,
        logits: torch.Tensor,  # [k+1, V]
    ) -> VerifyOutput:
        """One row's verification, as a batch of one."""
        k = len(drafted)
        drafted_row = torch.tensor([drafted], dtype=torch.long, device=logits.device)  # [1, k]
        if params.greedy:
            return greedy_verify(drafted_row, logits.argmax(-1).unsqueeze(0))
        V = logits.shape[-1]
        p = logits_to_probs(logits, params).unsqueeze(0)  # [1, k+1, V]
        if draft_probs is None:
            q = torch.nn.functional.one_hot(drafted_row, V).float()  # [1, k, V]
        else:
            q = normalise(draft_probs.to(p.device, torch.float32)).unsqueeze(0)  # [1, k, V]
        uniform = uniform_noise(k, [generator], device=p.device)  # [1, k]
        noise = exponential_noise(V, [generator], device=p.device)  # [1, V]
        return rejection_verify(drafted_row, q, p, uniform, noise)

    def release(self, request_id: str) -> bool:
        self.grammars.release(request_id)
        return self.runner.release(request_id)


def _kept(row: VerifyRow) -> int:
    """The positions whose logits the row's forward keeps: the drafted ones and the one before them, or with
    prompt_logprobs every position (so the cache keeps nothing: the whole sequence is computed)."""
    return len(row.tokens) + len(row.drafted) if row.prompt_logprobs is not None else len(row.drafted) + 1
