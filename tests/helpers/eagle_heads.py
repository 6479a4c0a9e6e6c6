"""Random EAGLE-3 heads for a tiny target, and the target's features as Hugging Face's own forward computes them (the
reference for every test of captured features)."""

import torch

from specserve.workers.speculation.eagle.config import Eagle3Config, default_feature_layers
from specserve.workers.speculation.eagle.head import Eagle3Head, vocab_maps


def random_head(model_config, draft_vocab: int, seed: int, std: float | None = None) -> Eagle3Head:
    """A random head; std: re-initialise every weight with it (peaked logits, so some proposals are accepted)."""
    torch.manual_seed(seed)
    head = Eagle3Head(Eagle3Config.for_target(model_config, draft_vocab))
    if std is not None:
        for p in head.parameters():
            torch.nn.init.normal_(p, std=std)
    head.set_vocab_maps(*vocab_maps(torch.randperm(model_config.vocab_size).float(), draft_vocab))
    return head.eval()


def hf_features(model, sequence: list[int]) -> torch.Tensor:
    """The target's features [T, 3H] of every position, from Hugging Face's own forward without a cache."""
    with torch.no_grad():
        hidden = model(torch.tensor([sequence], device=model.device), output_hidden_states=True).hidden_states
    return torch.cat([hidden[i][0] for i in default_feature_layers(model.config.num_hidden_layers)], dim=-1)


def draft_greedy(drafting, rows: list[tuple[str, torch.Tensor, list[int]]], k: int) -> list[list[int]]:
    """Through an Eagle3Drafting's cache: extend each (request id, features, tokens) row, then draft k greedy tokens
    per row (target ids)."""
    step = drafting.extend(rows)
    tokens = drafting.head.draft_to_target(step.logits.argmax(-1))  # [B]
    drafted = [tokens]
    chain = drafting.chain([request_id for request_id, _, _ in rows], step)
    for _ in range(k - 1):
        step = chain.step(tokens)
        tokens = drafting.head.draft_to_target(step.logits.argmax(-1))
        drafted.append(tokens)
    return torch.stack(drafted, dim=1).tolist()  # [B, k]
