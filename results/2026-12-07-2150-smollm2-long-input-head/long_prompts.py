"""What window.py and merge.py share: the target (teacher forcing's features) and its packaged head, and long-input
prompts of our own: openings of 500-1,100 tokens of Python's pydoc topics (seeded), asked for a summary or a
question over the passage in turn."""

import pydoc_data.topics as T
import random

import torch

from specserve.workers.models.catalog import resolve_model
from specserve.workers.models.packaged_heads import resolve_head
from specserve.workers.speculation.eagle.checkpoint import load_head
from specserve.workers.training.eagle_target import EagleTarget

torch.set_num_threads(2)
path = resolve_model("smollm2-135m-instruct", progress=False)
tgt = EagleTarget(path)
head = load_head(
    resolve_head("eagle", path), None, tgt.hidden_size, tgt.vocab_size, target_num_layers=tgt.num_hidden_layers
)
layers = list(head.config.feature_layers)
KINDS = [
    ("Summarize the following text in a few sentences.\n\n{p}", "sum"),
    ("{p}\n\nBased on the passage above, what is the main purpose of the feature it describes?", "rag"),
    ("Write a short summary of this documentation:\n\n{p}", "sum"),
]


def long_prompts(n: int) -> tuple[list[list[int]], list[str]]:
    """n prompts (chat-templated ids) and their kinds ("sum" or "rag")."""
    keys = sorted(T.topics)
    random.Random(0).shuffle(keys)
    prompts, kinds = [], []
    for i, k in enumerate(keys):
        ids = tgt.tokenizer(T.topics[k])["input_ids"]
        if len(ids) < 400:
            continue
        p = tgt.tokenizer.decode(ids[: random.Random(i).randint(500, 1100)])
        tmpl, kind = KINDS[len(prompts) % 3]
        prompts.append(tgt.chat_prompt(tmpl.format(p=p)))
        kinds.append(kind)
        if len(prompts) >= n:
            break
    return prompts, kinds
