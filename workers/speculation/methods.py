"""The speculation methods, one entry each (torch-free, plain data): what a method drafts with and what it can do.

Every reader asks this registry rather than comparing method names: the configs and the edges (`SpecMethod`, the
public proto's and the OpenAI API's `speculation.method`), `prepare.py` (what a served model can run), the in-process
engine (which proposer, chains or trees) and the scheduler and its pipeline (which drafters a chain's planner weighs,
what comes from a draft worker, what is looked up next to the committed tokens). Adding a method is one entry here and
its proposer's file (docs/architecture.md, "Adding a drafting method").

It sits on the configs' floor (tests/test_structure.py), below everything that reads it, and imports nothing of
specserve.
"""

from __future__ import annotations

from dataclasses import dataclass

# The proposers, one module each under workers/speculation/ (the in-process engine's drafters by these names).
EAGLE, DRAFT_MODEL, NGRAM, SUFFIX = "eagle", "draft", "ngram", "suffix"
# The drafters a chain's goodput planner chooses from each round (planner/chain.py, planner/goodput.py's Option.source).
HEAD_CHAIN, LOOKUP_CHAIN, MODEL_CHAIN, SUFFIX_CHAIN = "head", "ngram", "draft", "suffix"


@dataclass(frozen=True)
class Method:
    """One speculation method. A method drafts chains (k tokens a round, its planner choosing among `chain_sources`)
    or trees (k nodes verified at once), or nothing (target-only)."""

    name: str
    summary: str  # what it does, for SpecParams' description
    proposer: str | None  # EAGLE | DRAFT_MODEL | NGRAM | SUFFIX; None: no drafting
    tree: bool = False  # drafted as trees
    chain_sources: tuple[str, ...] = ()  # chains: the drafters its planner may choose from, each round (a tree
    # method's: the lookups whose chain a round may verify instead of its tree)
    draft_worker: bool = False  # disaggregated, its drafts come from a draft worker (its model or head)
    lookup: bool = False  # disaggregated, some of its drafts are looked up in the scheduler (no draft call)
    sampling: bool = True  # serves sampled requests (temperature > 0), losslessly
    disaggregated: bool = True  # runs on the Serve app's pools as well as in-process

    @property
    def drafts(self) -> bool:
        return self.proposer is not None

    @property
    def needs_head(self) -> bool:
        """Drafts with an EAGLE-3 head (the draft pool's model is a head; its verifies return features)."""
        return self.proposer == EAGLE

    @property
    def needs_draft_model(self) -> bool:
        return self.proposer == DRAFT_MODEL

    @property
    def needs_model(self) -> bool:
        """Drafts with a model (a head or a draft model) whose cost k='auto' weighs; lookups cost nothing."""
        return self.needs_head or self.needs_draft_model

    @property
    def suffix(self) -> bool:
        """Drafts from the request's and the model's earlier text (suffix.py's lookup, kept per scheduler/engine)."""
        return SUFFIX_CHAIN in self.chain_sources


REGISTRY: tuple[Method, ...] = (  # the order the edges list them in
    Method("eagle", "an EAGLE-3 head", EAGLE, chain_sources=(HEAD_CHAIN,), draft_worker=True),
    Method(
        "eagle+ngram",
        "the head's chain or the prompt lookup's continuation, whichever is expected to accept more",
        EAGLE,
        chain_sources=(HEAD_CHAIN, LOOKUP_CHAIN),
        draft_worker=True,
        lookup=True,
    ),
    Method(
        "eagle-tree",
        "a tree of the head's likeliest continuations, k nodes, verified at once",
        EAGLE,
        tree=True,
        draft_worker=True,
    ),
    Method(
        "eagle-tree+ngram",
        "each round the head's tree, or prompt lookup's continuation where it is expected to commit more (no draft "
        "call)",
        EAGLE,
        tree=True,
        chain_sources=(LOOKUP_CHAIN,),
        draft_worker=True,
        lookup=True,
    ),
    Method("draft", "a draft model proposes", DRAFT_MODEL, chain_sources=(MODEL_CHAIN,), draft_worker=True),
    Method("ngram", "prompt lookup", NGRAM, chain_sources=(LOOKUP_CHAIN,), lookup=True),
    Method(
        "ngram-tree",
        "prompt lookup's continuations of every recent match as a tree of k nodes",
        NGRAM,
        tree=True,
        lookup=True,
    ),
    Method(
        "suffix",
        "the continuation of the longest earlier match in the request or in the model's recent outputs "
        "(suffix decoding)",
        SUFFIX,
        chain_sources=(SUFFIX_CHAIN,),
        lookup=True,
    ),
    Method("none", "off", None),
)
METHODS: dict[str, Method] = {m.name: m for m in REGISTRY}
NAMES: tuple[str, ...] = tuple(METHODS)  # SpecMethod's values, in this order
NONE = "none"  # target-only
DEFAULT_METHOD = "draft"  # SpecParams' default
MODEL_DEFAULT = "draft"  # a model served with a draft model, unless the request says otherwise
HEAD_DEFAULT = "eagle-tree+ngram"  # a model served with an EAGLE-3 head, unless the request says otherwise
LOOKUP_DEFAULT = "ngram"  # a model served with `draft: ngram`
TREE_METHODS = tuple(m.name for m in REGISTRY if m.tree)  # drafted as trees
HEAD_METHODS = tuple(m.name for m in REGISTRY if m.needs_head)  # an EAGLE-3 head drafts for them (chains or trees)
HEAD_CHAIN_METHODS = tuple(m for m in HEAD_METHODS if not METHODS[m].tree)  # a head's chains


def method(name: str) -> Method:
    """The registry's entry for a validated method name (SpecParams.method)."""
    return METHODS[name]


def described() -> str:
    """Every method and what it does, in the registry's order (SpecParams.method's description)."""
    return "; ".join(f"{m.name}: {m.summary}" for m in REGISTRY) + "."


def servable(has_head: bool, has_draft_model: bool) -> list[str]:
    """The methods a served model can run: a head's only with a head, a draft model's only with a draft model."""
    return [m.name for m in REGISTRY if (has_head or not m.needs_head) and (has_draft_model or not m.needs_draft_model)]
