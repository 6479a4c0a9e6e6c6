"""Served load at N streams (argv[2]), default vs off only (no fixed-k segments interleaved): 8 pairs of 7.5 s.
Usage: python default_only.py OUT.json STREAMS"""

import json
import sys
from dataclasses import asdict

from transformers import AutoTokenizer

from specserve.cluster.bench.concurrency import LoadConfig, format_levels, levels_json, load_rows
from specserve.cluster.bench.rows import HELD_OUT_QUESTIONS, question_prompt_ids
from specserve.cluster.bench.runner import TARGET_FULL
from specserve.workers.models.catalog import resolve_model

target = resolve_model("smollm2-135m-instruct")
tok = AutoTokenizer.from_pretrained(target)
prompts = [question_prompt_ids(tok, q) for q in list(HELD_OUT_QUESTIONS)[: TARGET_FULL.prompts]]
cfg = LoadConfig(levels=[int(sys.argv[2])], fixed_ks=(), fixed_k_levels=(), burst=0)
rows, drafting, _ = load_rows(target, None, prompts, cfg, "cpu", "float32")
print(format_levels(rows))
json.dump({"config": asdict(cfg), "levels": levels_json(rows)}, open(sys.argv[1], "w"), indent=1)
for r in levels_json(rows):
    print(r["speculation"], r["vs_off"], r.get("pair_ratios"))
