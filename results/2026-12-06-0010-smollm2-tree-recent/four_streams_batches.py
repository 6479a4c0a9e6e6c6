import json, sys, threading
from transformers import AutoTokenizer
from specserve.cluster.bench.concurrency import LoadConfig, load_rows
from specserve.cluster.bench.rows import HELD_OUT_QUESTIONS, question_prompt_ids
from specserve.cluster.bench.serve import model_status
from specserve.workers.models.catalog import resolve_model

target = resolve_model("smollm2-135m-instruct")
tok = AutoTokenizer.from_pretrained(target)
prompts = [question_prompt_ids(tok, q) for q in list(HELD_OUT_QUESTIONS)[:12]]
out = {}
import time

def streams(client, **kw):
    def one(i):
        for p in prompts[i::4] * 2:
            client.generate(p, max_new_tokens=32, **kw)
    ts = [threading.Thread(target=one, args=(i,)) for i in range(4)]
    t0 = time.time(); [t.start() for t in ts]; [t.join() for t in ts]
    return time.time() - t0

def then(client):
    open("/tmp/batchtrace/marks", "a").write(f"default {time.perf_counter()}\n")
    out["default_s"] = streams(client)
    out["default"] = model_status()
    open("/tmp/batchtrace/marks", "a").write(f"off {time.perf_counter()}\n")
    out["off_s"] = streams(client, speculation="off") if False else None

cfg = LoadConfig(levels=[1], fixed_ks=(), fixed_k_levels=(), pairs=1, segment_s=2.0, settle_s=1.0, burst=0)
load_rows(target, None, prompts, cfg, "cpu", "float32", then=then)
json.dump(out, open(sys.argv[1], "w"), indent=1, default=str)
