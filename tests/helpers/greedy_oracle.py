"""The greedy oracle: target-only greedy decoding written out with no specserve code, which every lossless greedy
test compares against, and the prompts the in-process greedy tests decode."""

import torch

PROMPTS = ["def fibonacci(n):\n    ", "import os\nimport sys\n\nclass Foo", "x = [i * i for i in range(10)]\nprint(x)"]


def own_greedy_loop(model, prompt_ids, max_new, eos_ids):
    """Target-only greedy decoding with a full recompute each step: no cache, no specserve code."""
    ids = list(prompt_ids)
    out = []
    with torch.no_grad():
        for _ in range(max_new):
            token = int(model(torch.tensor([ids], device=model.device)).logits[0, -1].argmax())
            ids.append(token)
            out.append(token)
            if token in eos_ids:
                break
    return out


def full_logits(model, seq) -> torch.Tensor:
    """Logits [len(seq), vocab] of one cache-free forward over `seq`, float32."""
    with torch.no_grad():
        return model(torch.tensor([seq], device=model.device)).logits[0].float()
