"""In process, one engine, per question every arm in turn (the order reversed every other question), every arm
cold: `python ab.py question.jsonl CATEGORIES PER_CATEGORY MAX_NEW` with ARMS (default off,base,new): off is
target-only, base the default method, new the default with variants.py's VARIANT on, m:METHOD / new:METHOD another
method without / with it. Prints each category's speed over off and tokens a round; asserts every output identical."""

import os
import sys
import time

import variants
from common import engine, prompt_ids

from specserve.cluster.bench.spec_bench import read_spec_bench, select_per_category
from specserve.workers.config.request import SamplingParams, SpecParams

src, cats, per, maxnew = sys.argv[1], sys.argv[2].split(","), int(sys.argv[3]), int(sys.argv[4])
questions = [q for q in select_per_category(read_spec_bench(src), per) if q.category in cats]
arms = os.environ.get("ARMS", "off,base,new").split(",")


def run(arm, prompt):
    engine.forget_prefixes()
    variants.enable(arm.startswith("new"))
    name = arm.split(":")[1] if ":" in arm else "eagle-tree+ngram"
    spec = SpecParams(method="none") if arm == "off" else SpecParams(method=name, k="auto")
    t = time.perf_counter()
    r = engine.generate(prompt, SamplingParams(max_new_tokens=maxnew, temperature=0.0), spec)
    return time.perf_counter() - t, r


hello = prompt_ids("Hello, how are you?")
for a in arms:
    run(a, hello)
res = {}
for i, q in enumerate(questions):
    prompt = prompt_ids(q.turns[0])
    outs = {}
    for a in arms if i % 2 == 0 else [arms[0], *arms[:0:-1]]:
        s, r = run(a, prompt)
        d = res.setdefault((q.category, a), [0, 0.0, 0])
        d[0], d[1], d[2] = d[0] + len(r.token_ids), d[1] + s, d[2] + (r.stats.rounds or 0)
        outs[a] = r.token_ids
    assert all(o == outs["off"] for o in outs.values()), q.question_id
for cat in cats:
    off = res[(cat, "off")]
    cells = []
    for a in arms:
        tokens, seconds, rounds = res[(cat, a)]
        cells.append(f"{a}: {off[1] / seconds:.3f}x tpr={tokens / max(rounds, 1):.2f}")
    print(cat, " ".join(cells))
