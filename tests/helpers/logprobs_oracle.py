"""The logprobs oracle: what target-only decoding computes for given tokens, written with no specserve code (one
teacher-forced forward of the model over the prompt and the tokens, log_softmax in float32), and the comparison every
logprobs test makes, within a stated tolerance."""

import torch

ATOL = 1e-4  # float32: a cached, batched or tree forward rounds differently from one full forward, by ~1e-6


def target_logprobs(model, prompt_ids: list[int], tokens: list[int]) -> torch.Tensor:
    """[len(tokens), V]: the target's log-probabilities at the position each token was chosen at."""
    ids = torch.tensor([list(prompt_ids) + list(tokens)], device=model.device)
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt_ids) - 1 : -1].float()
    return torch.log_softmax(logits, dim=-1).cpu()


def assert_logprobs_match(tokens: list[int], logprobs, expected: torch.Tensor, top: int, atol: float = ATOL) -> None:
    """logprobs (TokenLogprobs, one per token) equal the oracle's rows: each token's own value, and its `top`
    alternatives (most likely first; compared as values, so near-ties may order either way)."""
    assert len(logprobs) == len(tokens) == expected.shape[0], (len(logprobs), len(tokens), expected.shape)
    for i, (token, got) in enumerate(zip(tokens, logprobs, strict=True)):
        row = expected[i]
        assert abs(got.logprob - float(row[token])) <= atol, (i, token, got.logprob, float(row[token]))
        assert len(got.top) == top, (i, got.top)
        values = [v for _, v in got.top]
        assert values == sorted(values, reverse=True), (i, got.top)
        for alt, value in got.top:
            assert abs(value - float(row[alt])) <= atol, (i, alt, value, float(row[alt]))
        best = torch.topk(row, top).values.tolist() if top else []
        assert all(abs(a - b) <= atol for a, b in zip(values, best, strict=True)), (i, values, best)
