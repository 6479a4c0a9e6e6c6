"""The methods registry (workers/speculation/methods.py): each entry consistent with itself, and the readers' views of
it (SpecParams, the gRPC edge's Literal, what a served model may run) derived from it."""

from typing import get_args

import pytest

from specserve.cluster.serve.public_proto import GrpcSpeculation
from specserve.workers.config.request import SpecMethod, SpecParams
from specserve.workers.speculation import methods
from specserve.workers.speculation.methods import METHODS, NAMES, REGISTRY

PROPOSERS = (methods.EAGLE, methods.DRAFT_MODEL, methods.NGRAM, methods.SUFFIX)
SOURCES = (methods.HEAD_CHAIN, methods.LOOKUP_CHAIN, methods.MODEL_CHAIN, methods.SUFFIX_CHAIN)


@pytest.mark.parametrize("entry", REGISTRY, ids=lambda m: m.name)
def test_each_method_declares_what_it_can_do_consistently(entry):
    assert entry.proposer is None or entry.proposer in PROPOSERS
    assert set(entry.chain_sources) <= set(SOURCES)
    if not entry.drafts:  # target-only
        assert not (entry.tree or entry.chain_sources or entry.draft_worker or entry.lookup)
    elif entry.tree:  # a tree comes from one proposer; beside a head's, only lookups' chains (no model)
        assert set(entry.chain_sources) <= {methods.LOOKUP_CHAIN, methods.SUFFIX_CHAIN}
        assert not entry.chain_sources or entry.needs_head
    else:
        assert entry.chain_sources
    assert entry.draft_worker == entry.needs_model  # a head or a draft model runs on the draft pool
    assert entry.lookup == (
        entry.proposer in (methods.NGRAM, methods.SUFFIX) or methods.LOOKUP_CHAIN in entry.chain_sources
    )
    assert entry.summary and entry.sampling and entry.disaggregated  # every method today


def test_the_configs_and_the_edges_list_the_registrys_methods_in_its_order():
    assert get_args(SpecMethod) == NAMES == tuple(m.name for m in REGISTRY)
    assert get_args(GrpcSpeculation.model_fields["method"].annotation) == ("", *NAMES)
    assert SpecParams().method == methods.DEFAULT_METHOD
    for name in (
        methods.NONE,
        methods.DEFAULT_METHOD,
        methods.HEAD_DEFAULT,
        methods.LOOKUP_DEFAULT,
        methods.MODEL_DEFAULT,
    ):
        assert name in METHODS
    assert methods.TREE_METHODS == ("eagle-tree", "eagle-tree+ngram", "ngram-tree")
    assert methods.HEAD_METHODS == ("eagle", "eagle+ngram", "eagle-tree", "eagle-tree+ngram")
    assert methods.HEAD_CHAIN_METHODS == ("eagle", "eagle+ngram")


def test_a_served_model_runs_the_methods_its_draft_pool_allows():
    lookups = ["ngram", "ngram-tree", "suffix", "none"]
    assert methods.servable(has_head=False, has_draft_model=False) == lookups
    assert methods.servable(has_head=False, has_draft_model=True) == ["draft", *lookups]
    assert methods.servable(has_head=True, has_draft_model=False) == [
        "eagle",
        "eagle+ngram",
        "eagle-tree",
        "eagle-tree+ngram",
        *lookups,
    ]
