"""In process, one engine: per question target-only, default, default+graft (env SPEC_GRAFT toggled), every row cold."""

import json
import os
import sys
import time

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
qs = [json.loads(line) for line in open(sys.argv[1])]
maxnew = int(sys.argv[2]) if len(sys.argv) > 2 else 64
arms = sys.argv[3].split(",") if len(sys.argv) > 3 else ["off", "base", "graft"]
tok = target.tokenizer
params = SamplingParams(max_new_tokens=maxnew, temperature=0.0)
res = {}


def run(arm, prompt):
    engine.forget_prefixes()
    os.environ.pop("SPEC_GRAFT", None)
    if arm.startswith("graft"):
        os.environ["SPEC_GRAFT"] = arm[5:] or "1"  # graft-prototype.diff applied
    spec = (
        SpecParams(method="none")
        if arm == "off"
        else SpecParams(method=arm.split(":")[1] if ":" in arm else "eagle-tree+ngram", k="auto")
    )
    t = time.perf_counter()
    r = engine.generate(prompt, params, spec)
    s = time.perf_counter() - t
    return r.token_ids, s, r.stats


# warm up (cost probes)
w = chat_prompt_ids(tok, [ChatMessage(role="user", content="Hello, how are you?")])
for a in arms:
    run(a, w)
for q in qs:
    prompt = chat_prompt_ids(tok, [ChatMessage(role="user", content=q["turns"][0])])
    outs = {}
    for a in arms:
        ids, s, st = run(a, prompt)
        d = res.setdefault((q["category"], a), [0, 0.0, 0])
        d[0] += len(ids)
        d[1] += s
        d[2] += getattr(st, "rounds", 0) or 0
        outs[a] = ids
    assert all(o == outs["off"] for o in outs.values()), q["question_id"]
for cat in sorted({c for c, _ in res}):
    off = res[(cat, "off")]
    print(
        cat,
        " ".join(
            f"{a}: {res[(cat, a)][0] / res[(cat, a)][1]:.2f} tok/s {off[1] / res[(cat, a)][1]:.3f}x "
            f"tpr={res[(cat, a)][0] / max(res[(cat, a)][2], 1):.2f}"
            for a in arms
        ),
    )
