"""Served load, STREAMS streams: default and fixed k = 4 and 8 (a 4- or 8-node tree every round), each against
off, 8 pairs of 7.5 s each, one run; the default judged against each k by their segments of each round (judge_k).
Usage: python default_and_fixed_k.py OUT.json STREAMS"""

import json
import sys
from dataclasses import asdict

from transformers import AutoTokenizer

from specserve.cluster.bench.concurrency import LoadConfig, levels_json, load_rows
from specserve.cluster.bench.load_report import format_levels
from specserve.cluster.bench.rows import HELD_OUT_QUESTIONS, question_prompt_ids
from specserve.cluster.bench.runner import TARGET_FULL
from specserve.workers.models.catalog import resolve_model

target = resolve_model("smollm2-135m-instruct")
tok = AutoTokenizer.from_pretrained(target)
prompts = [question_prompt_ids(tok, q) for q in list(HELD_OUT_QUESTIONS)[: TARGET_FULL.prompts]]
streams = int(sys.argv[2])
cfg = LoadConfig(levels=[streams], fixed_ks=(4, 8), fixed_k_levels=(streams,), fixed_k_pairs=8, burst=0)
rows, drafting, _ = load_rows(target, None, prompts, cfg, "cpu", "float32")
print(format_levels(rows))
json.dump({"config": asdict(cfg), "levels": levels_json(rows)}, open(sys.argv[1], "w"), indent=1)
for r in levels_json(rows):
    print(r["speculation"], r["vs_off"], r.get("pair_ratios"), r.get("vs_best_fixed_k"), r.get("best_fixed_k"))
