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
