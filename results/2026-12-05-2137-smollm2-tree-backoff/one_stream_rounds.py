import json
import sys

from transformers import AutoTokenizer

from specserve.cluster.bench.concurrency import LoadConfig, load_rows
from specserve.cluster.bench.rows import HELD_OUT_QUESTIONS, question_prompt_ids
from specserve.cluster.bench.serve import model_status
from specserve.workers.models.catalog import resolve_model

target = resolve_model("smollm2-135m-instruct")
tok = AutoTokenizer.from_pretrained(target)
prompts = [question_prompt_ids(tok, q) for q in list(HELD_OUT_QUESTIONS)[:12]]
out = {}


def then(client):
    for _ in range(2):
        for p in prompts:
            client.generate(p, max_new_tokens=48)
    out["default"] = model_status()
    for p in prompts:
        client.generate(p, max_new_tokens=48, k=4)
    out["after_k4"] = model_status()


cfg = LoadConfig(levels=[1], fixed_ks=(), fixed_k_levels=(), pairs=1, segment_s=2.0, settle_s=1.0, burst=0)
load_rows(target, None, prompts, cfg, "cpu", "float32", then=then)
json.dump(out, open(sys.argv[1], "w"), indent=1, default=str)
