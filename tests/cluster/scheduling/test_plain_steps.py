"""Plain rounds streamed from one Decode call where they are known ahead, beyond speculation off
(tests/cluster/scheduling/test_pipeline.py): a head's trees backed off stream their plain rounds, a lookup's match
or the backoff's end closes the stream, and every output is target-only's. The backoff is forced (the pruning's
decision patched after it is taken); the workers, the head, the scheduler and the streams are real."""

from specserve.cluster.scheduling.worker_clients import TargetClient
from specserve.workers.config.request import SamplingParams, SpecParams
from specserve.workers.speculation.engine import SpecEngine
from specserve.workers.speculation.planner.tree import TreePruning
from tests.helpers.greedy_oracle import PROMPTS
from tests.helpers.pipelines import run_keyed, served_models

MAX_NEW = 40
BACKOFF = 5


def test_a_heads_trees_backed_off_stream_their_plain_rounds_with_identical_output(tmp_path, monkeypatch):
    target, draft, head = served_models(tmp_path)
    prune = TreePruning.prune

    def backed_off(self, *args, **kw):
        tree = prune(self, *args, **kw)
        if self.costly:  # a head's tree: as if it had lost to plain steps
            self.plain_rounds = self.backoff = BACKOFF
        return tree

    monkeypatch.setattr(TreePruning, "prune", backed_off)
    steps = []  # each Decode stream's steps
    decode = TargetClient.decode

    def counted(client, call, params, n, ends):
        steps.append(n)
        return decode(client, call, params, n, ends)

    monkeypatch.setattr(TargetClient, "decode", counted)
    params = SamplingParams(max_new_tokens=MAX_NEW)
    keyed = {(prompt, method): (prompt, params, SpecParams(method=method, k="auto"))
             for prompt in PROMPTS for method in ("eagle-tree", "eagle-tree+ngram")}  # fmt: skip
    served = run_keyed(target, draft, head, "eagle head", keyed)
    engine = SpecEngine(target)
    for (prompt, method), req in served.items():
        expected = engine.generate(prompt, params, SpecParams(method="none")).token_ids
        assert req.state.generated == expected, (prompt, method)
    assert steps and max(steps) == BACKOFF  # the backoff's plain rounds, one stream
    assert sum(r.state.stats.drafted for r in served.values()) > 0  # trees between the backoffs
