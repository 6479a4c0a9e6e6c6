"""Every round of the default method (eagle-tree+ngram, k auto) on one Spec-Bench category's first 10 questions, up
to 128 new tokens, in process and cold, beside target-only on the same question: `python trace.py question.jsonl
CATEGORY` writes trace-CATEGORY.json (per question: its prompt and answer ids, both times, and per round what was
drafted, what was accepted and the round's seconds). rounds.py reads it."""

import json
import sys
import time

from common import prompt_ids, questions, run, warm_up

from specserve.workers.speculation import engine as eng
from specserve.workers.speculation import round_drafting as rd

category = sys.argv[2]
trace, cur = [], {}
_round, _plan, _observe = eng.SpecEngine._tree_round, rd.TreeRounds.plan, rd.TreeRounds.observe


def plan(self, state):
    p = _plan(self, state)
    cur.clear()
    cur.update(pos=len(state.tokens), kind="lookup" if p.chain.k else "head" if p.nodes else "plain", k=p.chain.k,
               match=p.chain.match if p.chain.k else None)  # fmt: skip
    return p


def observe(self, p, tree, accepted):
    cur.update(acc=accepted, nodes=len(tree.tokens) if tree is not None else 0)
    return _observe(self, p, tree, accepted)


def tree_round(self, state, rounds, params, generator):
    t = time.perf_counter()
    _round(self, state, rounds, params, generator)
    cur["s"] = time.perf_counter() - t
    trace.append(dict(cur))


eng.SpecEngine._tree_round, rd.TreeRounds.plan, rd.TreeRounds.observe = tree_round, plan, observe


warm_up()
out = []
for q in questions(sys.argv[1], category):
    prompt = prompt_ids(q.turns[0])
    s0, r0 = run("off", prompt)
    trace.clear()
    s1, r1 = run("default", prompt)
    assert r1.token_ids == r0.token_ids, q.question_id
    out.append(dict(q=q.question_id, off=s0, d=s1, n=len(r0.token_ids), full=prompt + r0.token_ids, plen=len(prompt),
                    trace=list(trace)))  # fmt: skip
    print(q.question_id, len(prompt), round(s0, 2), round(s1, 2), len(trace), flush=True)
with open(f"trace-{category}.json", "w") as f:
    json.dump(out, f)
