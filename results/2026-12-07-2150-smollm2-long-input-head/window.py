"""Head acceptance on long-input prompts (own passages from pydoc topics), teacher-forced, full vs windowed
attention."""

import sys
import time

import torch
from long_prompts import head, layers, long_prompts, tgt

from specserve.workers.speculation.eagle import head as H

N = int(sys.argv[1]) if len(sys.argv) > 1 else 12
prompts, kinds = long_prompts(N)
t0 = time.time()
answers = [tgt.generate([p], 64, None, 0)[0] for p in prompts]
print("gen", time.time() - t0, [len(p) for p in prompts], flush=True)


def attn_window(W):
    def ttt_attention(q, keys, values, step_kv):
        groups = q.shape[1] // keys.shape[1]
        L = keys.shape[2]
        scale = q.shape[-1] ** -0.5
        scores = (q @ keys.repeat_interleave(groups, 1).transpose(-1, -2)) * scale
        i = torch.arange(L)
        ok = i[None, :] <= i[:, None]
        if W:
            ok &= (i[:, None] - i[None, :]) < W
        scores = scores.masked_fill(~ok, float("-inf"))
        if step_kv:
            diag = [(q * k.repeat_interleave(groups, 1)).sum(-1) * scale for k, _ in step_kv]
            scores = torch.cat([scores, torch.stack(diag, -1)], -1)
        w = scores.float().softmax(-1).to(q.dtype)
        out = w[..., :L] @ values.repeat_interleave(groups, 1)
        for j, (_, v) in enumerate(step_kv):
            out = out + w[..., L + j, None] * v.repeat_interleave(groups, 1)
        return out

    return ttt_attention


K = 4
orig = H.ttt_attention
res = {}
with torch.no_grad():
    for W in (0, 512, 256, 128, 64):
        H.ttt_attention = attn_window(W)
        acc = {"sum": torch.zeros(K), "rag": torch.zeros(K)}
        n = {"sum": 0, "rag": 0}
        for p, a, kind in zip(prompts, answers, kinds, strict=False):
            seq = p + a
            feats, _ = tgt.features([seq], layers, 8192)
            L = len(seq)
            ids = torch.tensor(seq)
            # entry t: feature t, token t+1, predicts t+2 (step j predicts t+2+j); greedy == data (greedy answers)
            T_ = L - 1 - K
            steps = [ids[1 + j : 1 + j + T_][None] for j in range(K)]
            hs = H.ttt_forward(head, tgt.model.get_input_embeddings().weight, feats[None, :T_].float(), steps)
            preds = torch.stack([head.draft_to_target(head.logits(h[0]).argmax(-1)) for h in hs])  # [K, T_]
            truth = torch.stack([ids[2 + j : 2 + j + T_] for j in range(K)])
            hits = (preds == truth).long().cumprod(0)
            sel = torch.arange(T_) >= len(p) - 2  # entries predicting answer tokens
            acc[kind] += hits[:, sel].sum(1).float()
            n[kind] += int(sel.sum())
        for kind in acc:
            print(
                f"W={W} {kind} n={n[kind]} reach={[round(x, 3) for x in (acc[kind] / max(n[kind], 1)).tolist()]} "
                f"mean_accepted_k4={float(acc[kind].sum() / max(n[kind], 1)):.3f}",
                flush=True,
            )
