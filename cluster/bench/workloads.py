"""`specserve bench --load multi-turn` and `--load long-prompt`: the served traffic workloads beside the load bench's
single-turn chat (multi_turn.py, long_prompt.py). They run on their own, without the in-process rows: the bench's
target (or the demo family) served with its default drafting, through the public gRPC client."""

from __future__ import annotations

import json
from dataclasses import replace

import torch

from specserve.cluster.bench.long_prompt import QUICK_LONG_PROMPT, LongPromptConfig, format_long_prompt, run_long_prompt
from specserve.cluster.bench.multi_turn import QUICK_MULTI_TURN, MultiTurnConfig, format_multi_turn, run_multi_turn
from specserve.cluster.bench.report import machine_info
from specserve.cluster.bench.rows import bench_questions
from specserve.workers.models.chat_questions import question_prompt_ids

MULTI_TURN, LONG_PROMPT = "multi-turn", "long-prompt"


def main_workload(args, target_path: str) -> int:
    """Run args.load's workload on the served target; print its table, write its JSON (--json)."""
    from transformers import AutoConfig, AutoTokenizer

    from specserve.cluster.app_config import DEMO

    tokenizer = AutoTokenizer.from_pretrained(target_path, local_files_only=True)
    target, draft = (target_path, args.draft) if args.target else (DEMO, DEMO)
    if args.load == MULTI_TURN:
        cfg = QUICK_MULTI_TURN if args.quick else MultiTurnConfig()
        entry = run_multi_turn(target, draft, args.device, args.dtype, tokenizer, cfg)
        print(format_multi_turn(entry))
    else:
        cfg = QUICK_LONG_PROMPT if args.quick else LongPromptConfig()
        questions = bench_questions(args) or ["Write a short poem about the sea."]
        prompts = [question_prompt_ids(tokenizer, q) for q in questions]
        context = getattr(AutoConfig.from_pretrained(target_path, local_files_only=True), "max_position_embeddings", 0)
        if context and cfg.long_tokens > context - 256:  # a small model's context: as long as it takes
            cfg = replace(cfg, long_tokens=context - 256)
        entry = run_long_prompt(target, draft, args.device, args.dtype, tokenizer, prompts, cfg)
        print(format_long_prompt(entry))
    if args.json:
        cuda = args.device != "cpu" and torch.cuda.is_available()
        machine = machine_info(torch.device("cuda" if cuda else "cpu"), torch.bfloat16 if cuda else torch.float32)
        meta = {"workload": args.load, "target": args.target or "demo", args.load.replace("-", "_"): entry}
        with open(args.json, "w") as f:
            json.dump({"machine": machine, "meta": meta, "rows": []}, f, indent=2)
    return 0
