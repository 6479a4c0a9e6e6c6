import os
import pickle

import torch
from long_prompts import head, layers, long_prompts, tgt

from specserve.workers.speculation.eagle import head as H
from specserve.workers.speculation.ngram import ngram_match

cache = "/tmp/exp/answers.pkl"
if os.path.exists(cache):
    prompts, kinds, answers = pickle.load(open(cache, "rb"))
else:
    prompts, kinds = long_prompts(12)
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
