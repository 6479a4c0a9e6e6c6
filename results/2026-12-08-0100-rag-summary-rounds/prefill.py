"""The prefill's share (README section 1): per question of one Spec-Bench category (first 10, first turns), in
process and cold, target-only and the default each at 1, 2 and 128 new tokens: `python prefill.py question.jsonl rag`
prints per question [prompt tokens, off 1 / 2 / 128 s, tokens, rounds, default 1 / 2 / 128 s, tokens, rounds] and
the totals."""

import sys
import time

from specserve.cluster.bench.spec_bench import read_spec_bench, select_per_category
from specserve.workers.config.request import SamplingParams, SpecParams
from specserve.workers.config.settings import ModelConfig
from specserve.workers.models.catalog import resolve_model
from specserve.workers.models.chat import ChatMessage, chat_prompt_ids
from specserve.workers.models.packaged_heads import resolve_head
from specserve.workers.runtime.loading import load_model
from specserve.workers.speculation.engine import SpecEngine

path = resolve_model("smollm2-135m-instruct", progress=False)
target = load_model(ModelConfig(path=path, device="cpu", dtype="float32"))
engine = SpecEngine(target, eagle_head=resolve_head("eagle", path))
tok = target.tokenizer
questions = [q for q in select_per_category(read_spec_bench(sys.argv[1]), 10) if q.category == sys.argv[2]]


def run(arm, prompt, n):
    engine.forget_prefixes()
    spec = SpecParams(method="none") if arm == "off" else SpecParams(method="eagle-tree+ngram", k="auto")
    t = time.perf_counter()
    r = engine.generate(prompt, SamplingParams(max_new_tokens=n, temperature=0.0), spec)
    return time.perf_counter() - t, r


hello = chat_prompt_ids(tok, [ChatMessage(role="user", content="Hello, how are you?")])
run("off", hello, 8)
run("default", hello, 8)
totals = {}
for q in questions:
    prompt = chat_prompt_ids(tok, [ChatMessage(role="user", content=q.turns[0])])
    row = [len(prompt)]
    for arm in ("off", "default"):
        for n in (1, 2, 128):
            s, r = run(arm, prompt, n)
            row.append(round(s, 3))
            totals[(arm, n)] = totals.get((arm, n), 0) + s
        row += [len(r.token_ids), r.stats.rounds]
    print(q.question_id, row, flush=True)
print({k: round(v, 2) for k, v in totals.items()})
