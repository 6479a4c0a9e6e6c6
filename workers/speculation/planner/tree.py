"""How many of a drafted tree's nodes to verify (eagle-tree with k = 'auto'), from the head's own confidence.

EAGLE-2's observation: a head's probability of a path predicts whether the target accepts it. So the expected
accepted length of the tree made of the b best nodes is about c * sum of exp(score) over them (score: the path's
log-probability; c: the request's calibration, accepted / predicted over its verified rounds, from a cautious
prior), and a round verifies the b with the most committed tokens per second, or none (a plain step) when no b pays.

Per second of what: the round's whole time, its verify forward T(width) and what else a round spends (its drafting,
the hops, the scheduler: `fixed_s`, measured). The drafting is spent when b is chosen, but the best b for the long run
is the one that maximises the round's rate with it counted (Dinkelbach: a b that pays against T alone can lose
against the rate the rounds achieve); leaving it out verified trees too small (served, 1 stream: 2.44 tokens a round
where 8-node trees committed 2.68, results/2026-11-28-0957-smollm2-load).

And of whose round: a target worker verifies its requests' trees in one packed forward, so the b best nodes of each
request cost the batch T(rows, mean width + 1), not this row's own width alone. Pruned one by one, each at its own
width (when rows were still padded to the widest), a batch of 4 trees paid a 17-wide forward for one confident
request while the others cut theirs to 2-3 nodes (2.20 tokens a round against 2.70 for fixed 8-node trees at the same
verify time, same run). So the node count is the batch's: one cap for every tree row of the worker (`TreeRow`: the
others as their last trees were), chosen for the batch's committed tokens per second, as the chain planner chooses
the batch's width (goodput.py). Pure functions and small per-request state (`TreePruning`), shared by the in-process
engine (a batch of one) and the distributed scheduler.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from specserve.workers.runtime.tree_rows import ROOT
from specserve.workers.speculation.draft_tree import DraftTree
from specserve.workers.speculation.planner.acceptance import expected_accepted
from specserve.workers.speculation.planner.costs import ChunkBeside, VerifyCosts

MAX_TREE_NODES = 16  # the tree drafted for k='auto', pruned each round


MAX_PLAIN_ROUNDS = 16  # the longest run of plain steps between trees that pay for no node

# Plain steps after a tree round that lost to them (its drafting cost more than its nodes saved): as many as keep a
# later probe's loss within PROBE_SHARE of the time they take, doubling while probes keep losing, at most
# MAX_LOSING_ROUNDS. A probe is how a change shows (a lighter load, a better-accepted topic). On the H200
# (2026-12-04) an eager bf16 head drafted 13 ms a token beside a 4 ms graphed target step, and the default drafting
# ran 0.17x target-only because nothing compared drafting a tree with not drafting one.
PROBE_SHARE = 0.05
MAX_LOSING_ROUNDS = 512

# What the next tree commits is judged from the recent trees as verified, not from the one just drafted: a tree the
# head is unsure of says little of the next (served, one stream, 2026-12-05: backing off after each tree judged by
# its own expected nodes made a quarter of the rounds plain, 612 rounds for what 529 took without any backoff,
# results/2026-12-05-2137-smollm2-tree-backoff). A decayed mean over about ten trees, a pruned-to-nothing one as 0.
RECENT_DECAY = 0.9


@dataclass
class RecentTrees:
    """A decayed mean of a request's drafted trees as verified: accepted nodes and verified nodes a tree (None
    before the first)."""

    accepted: float | None = None
    width: float = 0.0
    decay: float = RECENT_DECAY
    scores: tuple[float, ...] = ()  # the latest tree's nodes' path log-probabilities, best first

    def observe(self, accepted: int, width: int) -> None:
        if self.accepted is None:
            self.accepted, self.width = float(accepted), float(width)
            return
        self.accepted = self.decay * self.accepted + (1.0 - self.decay) * accepted
        self.width = self.decay * self.width + (1.0 - self.decay) * width


@dataclass
class TreeCalibration:
    """accepted / predicted over a request's verified trees, starting from a prior worth a round or two."""

    predicted: float = 2.0
    accepted: float = 1.0  # the prior takes the head's probabilities at half their word

    @property
    def factor(self) -> float:
        return self.accepted / self.predicted

    def observe(self, predicted: float, accepted: int) -> None:
        self.predicted += predicted
        self.accepted += accepted


def expected_accepted_by_size(scores: Sequence[float], factor: float) -> list[float]:
    """scores: the nodes' path log-probabilities, best first -> per b = 1.., the expected accepted nodes of the b
    best (never more than b)."""
    out, total = [], 0.0
    for b, score in enumerate(scores, start=1):
        total += factor * math.exp(score)
        out.append(min(total, float(b)))
    return out


@dataclass(frozen=True)
class TreeRow:
    """Another request of the worker's verify batch: a head's tree as its last one was drafted (`by_size`: expected
    accepted nodes of its b best, b = 1..; the cap applies to it), or a row that verifies a set width (a lookup's
    chain, a fixed k, a plain step: `width` positions beyond its first, `expected` accepted)."""

    by_size: tuple[float, ...] = ()
    width: float = 0.0
    expected: float = 0.0

    def at_cap(self, cap: int) -> tuple[float, float]:
        """(drafted positions, committed tokens expected) of the row when the batch's trees keep at most `cap`
        nodes."""
        if not self.by_size:
            return self.width, 1.0 + self.expected
        b = min(cap, len(self.by_size))
        return b, 1.0 + (self.by_size[b - 1] if b else 0.0)


def _round(cap: int, own: tuple[float, float], verify: VerifyCosts, others: Sequence[TreeRow], fixed_s: float,
           beside: ChunkBeside | None) -> tuple[float, float]:  # fmt: skip
    """(tokens committed, seconds) of the batch's round when its trees keep at most `cap` nodes (own: this row's
    drafted positions and committed tokens; a prompt's chunk `beside` counts its positions and seconds)."""
    chunk, chunk_s = (beside.positions, beside.seconds) if beside is not None else (0, 0.0)
    drafted, committed = own
    for row in others:
        width, commits = row.at_cap(cap)
        drafted, committed = drafted + width, committed + commits
    return committed + chunk, verify.mean_verify(drafted / (1 + len(others))) + fixed_s + chunk_s


def _tree_and_plain(count: int, own: tuple[float, float], verify: VerifyCosts, drafting: Sequence[TreeRow],
                    others: Sequence[TreeRow], fixed_s: float, plain_s: float,
                    beside: ChunkBeside | None) -> tuple[tuple[float, float], tuple[float, float]]:  # fmt: skip
    """(tokens, seconds) of the batch's round with this row's tree at `count` nodes (`own`; the other rows as they
    draft, `fixed_s` beyond the forward), and of one where no head tree row drafts (`plain_s` beyond it)."""
    return _round(count, own, verify, drafting, fixed_s, beside), _round(0, (0, 1.0), verify, others, plain_s, beside)


def _own_at(b: int, own: Sequence[float]) -> tuple[float, float]:
    """(drafted positions, committed tokens expected) of a row keeping its b best nodes (own: expected accepted
    nodes by size)."""
    return b, 1.0 + (own[b - 1] if b else 0.0)


def best_node_count(scores: Sequence[float], verify: VerifyCosts, factor: float, others: Sequence[TreeRow] = (),
                    fixed_s: float = 0.0, beside: ChunkBeside | None = None) -> int:  # fmt: skip
    """The cap b (0: none) on every tree row of the batch (this one's `scores` and the `others`) whose round commits
    the most tokens per second: sum of rows' (1 + E(b)) / (T(mean width) + fixed_s), `verify` the batch's cost per
    width (a packed pass: each row pays for its own positions); with a prompt's chunk `beside` in the pass, its
    positions and seconds count too. The request keeps its b best nodes."""
    own = expected_accepted_by_size(scores[: verify.max_k], factor)
    best, best_rate = 0, -1.0
    for b in range(0, len(own) + 1):
        committed, seconds = _round(b, _own_at(b, own), verify, others, fixed_s, beside)
        rate = committed / seconds
        if rate > best_rate * (1.0 + 1e-9):
            best, best_rate = b, rate
    return best


def best_chain_length(rates: Sequence[float], verify: VerifyCosts, others: Sequence[TreeRow] = (),
                      fixed_s: float = 0.0, beside: ChunkBeside | None = None) -> int:  # fmt: skip
    """How much of a chain drafted for nothing (a lookup's continuation; rates[j]: its acceptance at position j
    given j-1) to verify: the length (0: none) whose batch round commits the most tokens a second, the `others` as
    they are. Beside other rows a position costs what it adds to their packed pass, so a long continuation that
    rarely accepts pays alone and loses in a batch."""
    best, best_rate = 0, -1.0
    for b in range(0, min(len(rates), verify.max_k) + 1):
        committed, seconds = _round(verify.max_k, (b, 1.0 + expected_accepted(rates, b)), verify, others, fixed_s,
                                    beside)  # fmt: skip
        if committed / seconds > best_rate * (1.0 + 1e-9):
            best, best_rate = b, committed / seconds
    return best


@dataclass
class TreePruning:
    """One request's k='auto' trees: each drafted tree cut to the nodes that pay (`prune`), and the verified outcome
    back into its calibration (`observe`)."""

    verify: VerifyCosts
    calibration: TreeCalibration = field(default_factory=TreeCalibration)
    predicted: float = 0.0  # expected accepted nodes of the tree being verified
    plain_rounds: int = 0  # plain steps to take before drafting the next tree
    plain_beside: bool = False  # this round is plain beside a prompt's chunk (backed off, or its tree would not pay)
    backoff: int = 0  # plain steps after a losing tree (doubles if pruned to nothing, or lost before any verified)
    costly: bool = True  # drafting a tree costs model work (a head's); prompt lookup's trees cost nothing
    by_size: tuple[float, ...] = ()  # the last drafted tree's expected accepted nodes by size (a TreeRow to others)
    count: int = 0  # the nodes of the tree being verified
    recent: RecentTrees = field(default_factory=RecentTrees)  # the trees it is judged by (served: its worker's, shared)

    def wants_tree(self) -> bool:
        """Whether to draft a tree this round: not for a few rounds after trees that paid for no node (drafting one
        costs the head's levels for nothing), so that a load where no tree pays runs plain steps."""
        if self.plain_rounds > 0:
            self.plain_rounds -= 1
            return False
        return True

    def pays_beside(self, others: Sequence[TreeRow], fixed_s: float, beside: ChunkBeside, plain_s: float | None = None,
                    others_drafting: Sequence[TreeRow] | None = None) -> bool:  # fmt: skip
        """Before drafting, beside a prompt's chunk: whether the batch's round with a tree like the latest of its
        recent trees, cut as `prune` would cut it there (`fixed_s`: a tree round's seconds beyond its forward, its
        drafting included; the other rows `others_drafting` as in `prune`), commits more a second, the chunk's
        positions counted, than a plain round (the others at cap 0; `plain_s`: a plain round's seconds beyond its
        forward; None: unknown, only the cut is asked). One that does not is not drafted: its drafting would hold
        the chunk's pass (the worker's batcher waits for the rows expected back) for what a plain step commits. Unlike
        a backoff this is asked again every round, so trees resume as soon as the chunk leaves."""
        if not self.recent.scores:
            return True
        factor = self.calibration.factor
        count = best_node_count(self.recent.scores, self.verify, factor, others, fixed_s, beside)
        if not count or plain_s is None:
            return count > 0
        own = expected_accepted_by_size(self.recent.scores[: self.verify.max_k], factor)
        drafting = others if others_drafting is None else others_drafting
        (tree_tokens, tree_s), (plain_tokens, plain_round_s) = _tree_and_plain(
            count, _own_at(count, own), self.verify, drafting, others, fixed_s, plain_s, beside
        )
        return tree_tokens / tree_s > plain_tokens / plain_round_s

    def prune(self, tree: DraftTree, others: Sequence[TreeRow] = (), fixed_s: float = 0.0,
              beside: ChunkBeside | None = None, plain_s: float | None = None,
              others_drafting: Sequence[TreeRow] | None = None) -> DraftTree | None:  # fmt: skip
        """The tree's best nodes that pay for their verification in the batch (`others`: its other rows, `verify`
        its cost per width; `fixed_s`: a tree round's seconds beyond the verify forward, its drafting included;
        `beside`: a prompt's chunk in the pass), or None (a plain step) when none does.

        The drafting is spent by now, so it weighs on every b alike. Whether to draft the next trees is another
        question, the batch's: against `plain_s`, a plain round's seconds beyond its forward (measured; None:
        unknown), a round where the head's tree rows draft (`others_drafting`: the other rows then, those backed off
        as their recent trees were; None: `others`) that commits less a second than one where none does backs the
        head off for as many plain rounds as keep the next probe's loss small (PROBE_SHARE)."""
        scores = sorted(tree.scores, reverse=True)
        if self.costly:
            self.recent.scores = tuple(scores)
        self.by_size = tuple(expected_accepted_by_size(scores, self.calibration.factor))
        count = best_node_count(scores, self.verify, self.calibration.factor, others, fixed_s, beside)
        self.predicted, self.count = sum(math.exp(s) for s in scores[:count]), count
        # Backing off saves a head's levels; a lookup tree costs nothing to draft, and the next match may pay. Nor
        # beside a prompt's chunk: its prefill ends soon, and the trees that lose to it now pay again then.
        costly = self.costly and beside is None
        drafting = others if others_drafting is None else others_drafting
        losing = self._losing_rounds(count, drafting, others, fixed_s, plain_s) if costly else 0
        if losing:
            # Judged by its own expected nodes (no tree verified yet), a probe that loses again doubles the backoff;
            # judged by the recent trees, the loss itself sets it: near break-even probes come often, far from it
            # rarely, and a memory of losses is not counted twice.
            doubled = 2 * self.backoff if self.recent.accepted is None else 0
            self.backoff = min(MAX_LOSING_ROUNDS, max(losing, doubled))
        else:
            self.backoff = 0 if count or not costly else min(MAX_PLAIN_ROUNDS, max(1, 2 * self.backoff))
        self.plain_rounds = self.backoff
        if not count and self.costly:
            self.recent.observe(0, 0)  # its drafting spent for no node
        return tree.best(count) if count else None

    def _losing_rounds(self, count: int, drafting: Sequence[TreeRow], others: Sequence[TreeRow], fixed_s: float,
                       plain_s: float | None) -> int:  # fmt: skip
        """0 when the batch's round with this tree's `count` nodes (the other rows `drafting`) commits at least as
        much a second as one where no head tree row drafts (the `others` at cap 0; `plain_s`: a plain round's seconds
        beyond its forward; None: no comparison); otherwise the plain rounds that keep a probe's loss (its seconds
        less what plain rounds take for its tokens) within PROBE_SHARE of their time. A tree round is judged as the
        recent trees were verified (this tree's own expected nodes before any was)."""
        if plain_s is None:
            return 0
        if self.recent.accepted is None:
            own = _own_at(count, self.by_size)
        else:
            own = (self.recent.width, 1.0 + self.recent.accepted)
        (tree_tokens, tree_s), (plain_tokens, plain_round_s) = _tree_and_plain(
            count, own, self.verify, drafting, others, fixed_s, plain_s, None
        )
        plain_rate = plain_tokens / plain_round_s
        if tree_tokens / tree_s >= plain_rate:
            return 0
        loss_s = tree_s - tree_tokens / plain_rate
        return max(1, math.ceil(loss_s / (PROBE_SHARE * plain_round_s)))

    def observe(self, accepted: int) -> None:
        """The verified tree's accepted nodes."""
        self.calibration.observe(self.predicted, accepted)
        if self.costly:
            self.recent.observe(accepted, self.count)


@dataclass
class RoundOverhead:
    """A round's seconds beyond its verify forward (a tree round's: the head's drafting, the hops, the scheduler's
    own, what `best_node_count` weighs as `fixed_s`; a plain round's: what `TreePruning.prune` weighs as `plain_s`):
    a decayed mean of measured rounds, 0 before any."""

    seconds: float = 0.0
    rounds: int = 0
    decay: float = 0.9

    def observe(self, seconds: float) -> None:
        seconds = max(0.0, seconds)
        self.seconds = seconds if not self.rounds else self.decay * self.seconds + (1.0 - self.decay) * seconds
        self.rounds += 1


@dataclass
class TreeYield:
    """Accepted nodes a round of a request's head trees, a decayed mean from a prior (a tree pruned to nothing counts
    0: its round committed one token): what the next head tree is expected to commit, against which a lookup's
    continuation competes (method eagle-tree+ngram)."""

    mean: float = 1.0
    decay: float = 0.8

    def observe(self, accepted: int) -> None:
        self.mean = self.decay * self.mean + (1.0 - self.decay) * accepted


def chain_tree(tokens: Sequence[int]) -> DraftTree:
    """A chain as a tree: each token the child of the one before (verified by the tree path, a prefix accepted)."""
    return DraftTree(list(tokens), [ROOT, *range(len(tokens) - 1)], [0.0] * len(tokens))
