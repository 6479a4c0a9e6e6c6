"""How well an EAGLE-3 head drafts for its target, measured the way it will be used: greedy decoding in the
in-process engine on the bench's held-out chat questions, chains of k drafts, acceptance counted per position.

Two numbers per position j (1-based): `reach` j, the fraction of rounds drafting j or more tokens whose first j were
all accepted; and `given` j, the acceptance at j of rounds whose first j-1 were accepted (what the k policy weighs).
"""

from __future__ import annotations

from dataclasses import dataclass

from specserve.workers.config.request import SamplingParams, SpecParams
from specserve.workers.models.chat_questions import HELD_OUT_QUESTIONS, question_prompt_ids
from specserve.workers.speculation.engine import SpecEngine

MIN_ROUNDS = 30  # rounds reaching a position before its acceptance counts as measured


@dataclass(frozen=True)
class ChainAcceptance:
    method: str
    k: int
    rounds: int  # target forwards, the prefill's included
    drafted: int
    accepted: int
    reached_by_position: tuple[int, ...]
    accepted_by_position: tuple[int, ...]

    @property
    def reach(self) -> list[float]:
        return [a / r if r else 0.0 for a, r in zip(self.accepted_by_position, self.reached_by_position, strict=True)]

    @property
    def given(self) -> list[float]:
        """Acceptance at each position given the previous one accepted (every round drafts k, but the last few of a
        request, which the budget cuts short and which barely move the ratios)."""
        before = (self.reached_by_position[0],) + self.accepted_by_position[:-1] if self.reached_by_position else ()
        out: list[float] = []
        for a, b in zip(self.accepted_by_position, before, strict=True):
            # A position few rounds reached repeats the one before: 1 of 2 is no estimate of 0.5.
            out.append(a / b if b >= MIN_ROUNDS or not out else out[-1])
        return out

    @property
    def mean_accepted(self) -> float:
        """Accepted drafts per round that drafted (a head drafts nothing in a request's first round, the prefill)."""
        rounds = self.reached_by_position[0] if self.reached_by_position else 0
        return self.accepted / rounds if rounds else 0.0

    @property
    def per_drafted(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0


def held_out_acceptance(
    engine: SpecEngine, method: str, k: int, questions: int, max_new_tokens: int
) -> ChainAcceptance:
    """Greedy answers to the first `questions` held-out chat questions, drafting k per round with `method`."""
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0)
    rounds = drafted = accepted = 0
    reached, hits = [0] * k, [0] * k
    for question in HELD_OUT_QUESTIONS[:questions]:
        prompt = question_prompt_ids(engine.tokenizer, question)
        result = engine.generate(prompt, params, SpecParams(method=method, k=k))
        stats = result.stats
        rounds, drafted, accepted = rounds + stats.rounds, drafted + stats.drafted, accepted + stats.accepted
        for j, (r, a) in enumerate(zip(stats.reached_by_position, stats.accepted_by_position, strict=True)):
            reached[j] += r
            hits[j] += a
    return ChainAcceptance(method, k, rounds, drafted, accepted, tuple(reached), tuple(hits))


def format_acceptance(rows: list[ChainAcceptance]) -> str:
    k = max(row.k for row in rows)
    head = f"{'method':<12} {'k':>2} {'per drafted':>11} {'per round':>9}  " + " ".join(
        f"{'pos ' + str(j + 1):>7}" for j in range(k)
    )
    lines = [head, "-" * len(head)]
    for row in rows:
        cells = " ".join(f"{a:>7.3f}" for a in row.reach)
        lines.append(f"{row.method:<12} {row.k:>2} {row.per_drafted:>11.3f} {row.mean_accepted:>9.2f}  {cells}")
    lines.append("pos j: the fraction of rounds whose first j drafts were all accepted")
    return "\n".join(lines)
