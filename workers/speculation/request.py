"""One request's decoding state and statistics, and how a verified round is committed to it.

Shared by the in-process engine and the distributed scheduler, so both stop, truncate and count identically.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from specserve.workers.config.request import SamplingParams
from specserve.workers.errors import InvalidRequestError
from specserve.workers.runtime.worker_state import check_token_ids
from specserve.workers.speculation.logprobs import TokenLogprob

FinishReason = Literal["stop", "length"]


@dataclass
class RequestStats:
    rounds: int = 0  # verification forward passes of the target
    drafted: int = 0  # tokens proposed by the drafter
    accepted: int = 0  # drafted tokens the target kept
    # Rounds that drafted position j (0-based) and rounds whose draft there was accepted (so were all before it).
    reached_by_position: list[int] = field(default_factory=list)
    accepted_by_position: list[int] = field(default_factory=list)

    def add_round(self, drafted: int, accepted: int, positions: int | None = None) -> None:
        """positions: how deep the round drafted (a tree's longest path; a chain's: all it drafted)."""
        positions = drafted if positions is None else positions
        self.rounds += 1
        self.drafted += drafted
        self.accepted += accepted
        while len(self.reached_by_position) < positions:
            self.reached_by_position.append(0)
            self.accepted_by_position.append(0)
        for j in range(positions):
            self.reached_by_position[j] += 1
            self.accepted_by_position[j] += 1 if j < accepted else 0

    def add(self, other: RequestStats) -> None:
        """Sum another request's counts into these (a replica's totals over the requests that ended there)."""
        self.rounds, self.drafted, self.accepted = (self.rounds + other.rounds, self.drafted + other.drafted,
                                                    self.accepted + other.accepted)  # fmt: skip
        for mine, theirs in ((self.reached_by_position, other.reached_by_position),
                             (self.accepted_by_position, other.accepted_by_position)):  # fmt: skip
            mine.extend([0] * (len(theirs) - len(mine)))
            for j, n in enumerate(theirs):
                mine[j] += n

    def by_position(self) -> list[float]:
        """Acceptance at each drafted position j: of the rounds that drafted j, those whose drafts up to j were all
        accepted (positions no round reached are left out)."""
        return [a / r for a, r in zip(self.accepted_by_position, self.reached_by_position, strict=True) if r]

    @property
    def acceptance_rate(self) -> float:
        """accepted / drafted (0 when nothing was drafted)."""
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens committed per round: accepted ones plus the recovered or bonus token (1.0 without speculation)."""
        return 1.0 + self.accepted / self.rounds if self.rounds else 0.0

    def to_dict(self) -> dict:
        return {
            "rounds": self.rounds,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "acceptance_rate": self.acceptance_rate,
            "mean_accepted_length": self.mean_accepted_length,
        }


@dataclass
class RequestState:
    request_id: str
    tokens: list[int]  # prompt followed by every committed generated token
    prompt_len: int
    max_new_tokens: int
    eos_token_ids: frozenset[int] = frozenset()
    stats: RequestStats = field(default_factory=RequestStats)
    finish_reason: FinishReason | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per generated token, when the request asks
    prompt_logprobs: list[TokenLogprob] | None = None  # the prompt's tokens 1..'s, once the target sent them

    @property
    def generated(self) -> list[int]:
        return self.tokens[self.prompt_len :]

    @property
    def remaining(self) -> int:
        return self.max_new_tokens - (len(self.tokens) - self.prompt_len)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def draft_budget(self, k: int) -> int:
        """How many tokens may be drafted this round: a round commits at most k + 1 tokens."""
        return max(0, min(k, self.remaining - 1))

    def commit_round(
        self,
        drafted: list[int],
        accepted: int,
        next_token: int,
        tree: tuple[int, int] | None = None,
        logprobs: Sequence[TokenLogprob] | None = None,
    ) -> list[int]:
        """Apply a verified round; returns the tokens actually committed (cut at EOS or the length limit). A tree
        round passes its accepted path as `drafted` and tree = (nodes, depth) for the stats. `logprobs`: the round's,
        one per accepted token and the next token; those of the committed tokens are kept."""
        if tree is None:
            self.stats.add_round(len(drafted), accepted)
        else:
            self.stats.add_round(tree[0], accepted, positions=tree[1])
        new = drafted[:accepted] + [next_token]
        committed: list[int] = []
        for token in new:
            if self.remaining <= 0:
                break
            if logprobs is not None:
                self.logprobs.append(logprobs[len(committed)])
            self.tokens.append(token)
            committed.append(token)
            if token in self.eos_token_ids:
                self.finish_reason = "stop"
                return committed
        if self.remaining <= 0:
            self.finish_reason = "length"
        return committed


def encode_prompt(tokenizer, prompt: str | Sequence[int]) -> list[int]:
    if isinstance(prompt, str):
        if not prompt:
            raise InvalidRequestError("prompt", "must not be empty")
        ids = list(tokenizer(prompt)["input_ids"])
    else:
        ids = [int(t) for t in prompt]
    if not ids:
        raise InvalidRequestError("prompt", "encodes to no tokens")
    return ids


def check_request(prompt_ids: list[int], params: SamplingParams, vocab_size: int, max_positions: int | None) -> None:
    check_token_ids("prompt", prompt_ids, vocab_size)
    if max_positions is not None and len(prompt_ids) + params.max_new_tokens > max_positions:
        room = max_positions - len(prompt_ids)
        raise InvalidRequestError(
            "max_new_tokens",
            f"{params.max_new_tokens} new tokens after a {len(prompt_ids)}-token prompt exceed the model's context "
            f"of {max_positions} positions" + (f" (at most {room})" if room > 0 else " (the prompt alone fills it)"),
        )
