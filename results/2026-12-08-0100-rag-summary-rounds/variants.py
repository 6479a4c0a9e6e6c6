"""Three planner variants tried on Spec-Bench's summarization and RAG questions, each a patch over the code as it
is, on while `enable(True)` (ab.py's "new" arms). VARIANT picks one:

- extrapolate: a chain position no round has reached yet takes as its prior the rate estimated at the position
  before it (a lookup's record held 0.55 a position after a 3+-token match however well the first five accepted).
- shared: the in-process engine's lookups start from a model-wide record kept per method (as the served scheduler's
  `lookup_acceptance`), not from the prior each request.
- trie: a lookup round verifies prompt lookup's trie (every recent match's continuation, `ngram_tree`) cut to the
  chain's length plus EXTRA nodes, instead of the one match's continuation.
"""

import os

from specserve.workers.speculation.ngram import ngram_tree
from specserve.workers.speculation.planner import acceptance, chain
from specserve.workers.speculation.planner.round_plan import RoundPlan

VARIANT = os.environ.get("VARIANT", "trie")
EXTRA = int(os.environ.get("EXTRA", "3"))
ON = [False]

_rates = acceptance.PositionAcceptance.rates
_for_method = chain.ChainPlanner.for_method.__func__
_lookup_round = chain.ChainPlanner.lookup_round
_records: dict[str, dict] = {}


def extrapolated_rates(self, k):
    if not ON[0]:
        return _rates(self, k)
    out = []
    for j in range(k):
        a0 = self.prior[j] if j < len(self.prior) else (out[-1] if out else self.prior[-1])
        n, hits = (self.reached[j], self.accepted[j]) if j < len(self.reached) else (0, 0)
        out.append((hits + a0 * self.prior_weight) / (n + self.prior_weight))
    return out


def shared_for_method(cls, entry, suffix_cache=None, **kw):
    if ON[0]:
        kw.setdefault("lookup_shared", _records.setdefault(entry.name, acceptance.model_lookup_acceptance()))
    return _for_method(cls, entry, suffix_cache, **kw)


def trie_lookup_round(self, tokens, limit, head, cut=None):
    plan = _lookup_round(self, tokens, limit, head, cut)
    if not ON[0] or plan is None:
        return plan
    tree = ngram_tree(tokens, plan.chain.k + EXTRA, limit, self.ngram.max_ngram, self.ngram.min_ngram)
    return RoundPlan(plan.chain, nodes=len(tree.tokens), tree=tree, row=plan.row)


if VARIANT == "extrapolate":
    acceptance.PositionAcceptance.rates = extrapolated_rates
elif VARIANT == "shared":
    chain.ChainPlanner.for_method = classmethod(shared_for_method)
elif VARIANT == "trie":
    chain.ChainPlanner.lookup_round = trie_lookup_round


def enable(on: bool) -> None:
    ON[0] = on
