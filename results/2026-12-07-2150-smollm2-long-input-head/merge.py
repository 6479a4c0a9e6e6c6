import os
import pickle
import pydoc_data.topics as T
import random

import torch

from specserve.workers.models.catalog import resolve_model
from specserve.workers.models.packaged_heads import resolve_head
from specserve.workers.speculation.eagle import head as H
from specserve.workers.speculation.eagle.checkpoint import load_head
from specserve.workers.speculation.ngram import ngram_match
from specserve.workers.training.eagle_target import EagleTarget

torch.set_num_threads(2)
path = resolve_model("smollm2-135m-instruct", progress=False)
tgt = EagleTarget(path)
head = load_head(
    resolve_head("eagle", path), None, tgt.hidden_size, tgt.vocab_size, target_num_layers=tgt.num_hidden_layers
)
layers = list(head.config.feature_layers)
cache = "/tmp/exp/answers.pkl"
if os.path.exists(cache):
    prompts, kinds, answers = pickle.load(open(cache, "rb"))
else:
    keys = sorted(T.topics)
    random.Random(0).shuffle(keys)
    KINDS = [
        ("Summarize the following text in a few sentences.\n\n{p}", "sum"),
        ("{p}\n\nBased on the passage above, what is the main purpose of the feature it describes?", "rag"),
        ("Write a short summary of this documentation:\n\n{p}", "sum"),
    ]
    prompts, kinds = [], []
    for i, k in enumerate(keys):
        ids = tgt.tokenizer(T.topics[k])["input_ids"]
        if len(ids) < 400:
            continue
        p = tgt.tokenizer.decode(ids[: random.Random(i).randint(500, 1100)])
        tmpl, kind = KINDS[len(prompts) % 3]
        prompts.append(tgt.chat_prompt(tmpl.format(p=p)))
        kinds.append(kind)
        if len(prompts) >= 12:
            break
    answers = [tgt.generate([p], 64, None, 0)[0] for p in prompts]
    pickle.dump((prompts, kinds, answers), open(cache, "wb"))
K = 4
stats = {}
with torch.no_grad():
    for p, a, kind in zip(prompts, answers, kinds, strict=False):
        seq = p + a
        L = len(seq)
        ids = torch.tensor(seq)
        feats, _ = tgt.features([seq], layers, 8192)
        T_ = L - 1 - K
        steps = [ids[1 + j : 1 + j + T_][None] for j in range(K)]
        hs = H.ttt_forward(head, tgt.model.get_input_embeddings().weight, feats[None, :T_].float(), steps)
        preds = torch.stack([head.draft_to_target(head.logits(h[0]).argmax(-1)) for h in hs])
        truth = torch.stack([ids[2 + j : 2 + j + T_] for j in range(K)])
        hacc = (preds == truth).long().cumprod(0).sum(0)  # [T_] accepted of entry t (drafting tokens t+2..)
        s = stats.setdefault(kind, {"n": 0, "head": 0, "look": 0, "max": 0, "fires": 0, "fire_head": 0, "fire_look": 0})
        for t in range(len(p) - 2, T_):
            # committed prefix = seq[:t+2]; drafts predict seq[t+2:]
            n, cont = ngram_match(seq[: t + 2], K, 4, 1)
            la = 0
            for j, c in enumerate(cont):
                if t + 2 + j < L and c == seq[t + 2 + j]:
                    la += 1
                else:
                    break
            h = int(hacc[t])
            s["n"] += 1
            s["head"] += h
            s["look"] += la
            s["max"] += max(h, la)
            if cont and n >= 2:
                s["fires"] += 1
                s["fire_head"] += h
                s["fire_look"] += la
for kind, s in stats.items():
    n = s["n"]
    print(kind, {k: (round(v / n, 3) if k in ("head", "look", "max") else v) for k, v in s.items()})
