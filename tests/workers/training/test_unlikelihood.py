"""Sequence-level unlikelihood: which tokens count as repeats, what the loss is, and that training stops a loop."""

import torch
from transformers import LlamaForCausalLM

from specserve.workers.training.demo_train import llama_config, train_lm
from specserve.workers.training.unlikelihood import (
    greedy_continuations,
    repeated_ngram_mask,
    unlikelihood_finetune,
    unlikelihood_loss,
)


def test_mask_marks_only_continuation_tokens_inside_a_repeated_ngram():
    #                    prefix      | continuation
    tokens = torch.tensor([[1, 2, 3, 4, 9, 1, 2, 3, 4, 5, 6]])
    mask = repeated_ngram_mask(tokens, start=4, n=4)
    # (1,2,3,4) recurs at index 5: indices 5..8 are repeats; 9, 5 and 6 are new.
    assert mask.tolist() == [[False] * 5 + [True] * 4 + [False] * 2]


def test_mask_catches_short_period_loops_and_ignores_the_prefix():
    tokens = torch.tensor([[7, 7, 7, 7, 7, 7], [1, 2, 3, 4, 5, 6]])
    mask = repeated_ngram_mask(tokens, start=2, n=4)
    # (7,7,7,7) first occurs at 0 and again at 1 and 2 (overlapping): every continuation position is a repeat,
    # prefix positions 0-1 never are.
    assert mask[0].tolist() == [False, False, True, True, True, True]
    assert not mask[1].any()


def test_loss_is_minus_log_one_minus_p_on_masked_positions_only():
    vocab = 4
    tokens = torch.tensor([[0, 1, 2]])  # positions 1 and 2 are predicted by logits 0 and 1
    logits = torch.zeros(1, 2, vocab)  # uniform: p = 1/4 everywhere
    mask = torch.tensor([[False, False, True]])
    loss = unlikelihood_loss(logits, tokens, mask, start=1)
    assert torch.isclose(loss, -torch.log(torch.tensor(0.75)) / 2)  # one penalised token over 2 continuation slots
    assert unlikelihood_loss(logits, tokens, torch.zeros_like(mask), start=1) == 0


def test_loss_grows_with_the_probability_of_the_repeat():
    tokens = torch.tensor([[0, 1]])
    mask = torch.tensor([[False, True]])
    low = unlikelihood_loss(torch.tensor([[[0.0, 0.0, 0.0]]]), tokens, mask, start=1)
    high = unlikelihood_loss(torch.tensor([[[0.0, 5.0, 0.0]]]), tokens, mask, start=1)
    assert high > low > 0


def test_finetuning_pushes_down_the_loop_the_model_generates():
    torch.manual_seed(0)
    model = LlamaForCausalLM(llama_config(16, 2, 64, 256, 0, 1))
    stream = torch.tensor([5, 6, 7, 8] * 300)  # plain training on one motif makes the model loop it confidently
    train_lm(model, stream, 80, 4, 32, 3e-3, 0)
    prefixes = torch.tensor([[5, 6, 7, 8, 5, 6, 7, 8], [7, 8, 5, 6, 7, 8, 5, 6]])
    loop = greedy_continuations(model, prefixes, 16)  # [2, 24]
    assert repeated_ngram_mask(loop, 8)[:, 8:].all()  # it loops

    def p_loop() -> float:  # mean probability the model gives its own loop's continuation tokens
        with torch.no_grad():
            probs = torch.softmax(model(input_ids=loop[:, :-1]).logits, -1).gather(-1, loop[:, 1:, None])[..., 0]
        return probs[:, 7:].mean().item()

    before = p_loop()
    losses = unlikelihood_finetune(model, stream, 15, 4, 32, 3e-3, 0, prefix=8, continuation=16)
    after = p_loop()
    assert before > 0.9
    assert after < before - 0.3, (before, after)
    assert len(losses) == 15 and not model.training
