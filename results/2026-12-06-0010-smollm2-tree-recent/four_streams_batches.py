"""Four client threads, each 6 held-out chat questions twice (32 new tokens, the default drafting), against the Serve
app as the load bench starts it; the scheduler's status after. The batch trace needs a line added to
Batcher._run_one for the run (README)."""

import json
import sys
import threading
import time

from transformers import AutoTokenizer

from specserve.cluster.bench.concurrency import LoadConfig, load_rows
from specserve.cluster.bench.rows import HELD_OUT_QUESTIONS, question_prompt_ids
from specserve.cluster.bench.serve import model_status
from specserve.workers.models.catalog import resolve_model

target = resolve_model("smollm2-135m-instruct")
tok = AutoTokenizer.from_pretrained(target)
prompts = [question_prompt_ids(tok, q) for q in list(HELD_OUT_QUESTIONS)[:12]]
out = {}


def streams(client, **kw) -> float:
    def one(i):
        for p in prompts[i::4] * 2:
            client.generate(p, max_new_tokens=32, **kw)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(4)]
    start = time.time()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.time() - start


def then(client):
    with open("/tmp/batchtrace/marks", "a") as marks:
        marks.write(f"default {time.perf_counter()}\n")
    out["default_s"] = streams(client)
    out["default"] = model_status()


cfg = LoadConfig(levels=[1], fixed_ks=(), fixed_k_levels=(), pairs=1, segment_s=2.0, settle_s=1.0, burst=0)
load_rows(target, None, prompts, cfg, "cpu", "float32", then=then)
json.dump(out, open(sys.argv[1], "w"), indent=1, default=str)
