"""On-policy draft distillation: the pool is the target's own greedy text, the loss counts only that text, and
training on it makes a draft agree with the target's argmax."""

import torch
from transformers import LlamaForCausalLM

from specserve.workers.training.demo_train import distillation_loss, llama_config, train_lm
from specserve.workers.training.onpolicy import POOL_CONTINUATION, continuation_pool, pool_batches, teacher_logprobs
from specserve.workers.training.unlikelihood import PREFIX


def _model(layers: int, seed: int) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    return LlamaForCausalLM(llama_config(32, layers, 64, 512, 0, 1)).eval()


def test_loss_is_kl_plus_weighted_argmax_cross_entropy_over_kept_positions():
    torch.manual_seed(0)
    draft, target = torch.log_softmax(torch.randn(2, 3, 5), -1), torch.log_softmax(torch.randn(2, 3, 5), -1)
    keep = torch.ones(2, 3, dtype=torch.bool)
    kl = torch.nn.functional.kl_div(draft.reshape(-1, 5), target.reshape(-1, 5), log_target=True,
                                    reduction="batchmean")  # fmt: skip
    assert torch.isclose(distillation_loss(draft, target, keep), kl)
    ce = torch.nn.functional.nll_loss(draft.reshape(-1, 5), target.argmax(-1).reshape(-1))
    assert torch.isclose(distillation_loss(draft, target, keep, argmax_weight=0.5), kl + 0.5 * ce)
    # Left-out positions change nothing: garbage there leaves the loss over the kept ones as it was.
    keep[0, 0] = False
    spoiled = draft.clone()
    spoiled[0, 0] = torch.log_softmax(torch.tensor([9.0, 0, 0, 0, 0]), -1)
    assert torch.isclose(distillation_loss(draft, target, keep, 1.0), distillation_loss(spoiled, target, keep, 1.0))


def test_pool_rows_are_corpus_prefixes_continued_greedily_by_the_teacher():
    teacher = _model(2, 0)
    stream = torch.randint(2, 32, (4000,), generator=torch.Generator().manual_seed(1))
    pool = continuation_pool(stream, teacher, 3, seed=5)
    assert pool.shape == (3, PREFIX + POOL_CONTINUATION)
    assert torch.equal(pool, continuation_pool(stream, teacher, 3, seed=5))  # seeded
    windows = {tuple(stream[s : s + PREFIX].tolist()) for s in range(len(stream) - PREFIX)}
    assert all(tuple(row[:PREFIX].tolist()) in windows for row in pool)
    with torch.no_grad():
        argmax = teacher(input_ids=pool[:, :-1]).logits.argmax(-1)  # [3, L-1]
    assert torch.equal(argmax[:, PREFIX - 1 :], pool[:, PREFIX:])  # every continuation token is the teacher's argmax


def test_pool_batches_leave_the_prefix_out_of_the_loss():
    pool = torch.arange(2 * (PREFIX + 10)).reshape(2, PREFIX + 10)
    inputs, labels = next(pool_batches(pool, 4, seed=0))
    assert inputs.shape == labels.shape == (4, PREFIX + 9)
    assert (labels[:, : PREFIX - 1] == -100).all()
    assert torch.equal(labels[:, PREFIX - 1 :], inputs[:, PREFIX - 1 :] + 1)  # the next token of the same row


def test_cached_teacher_logprobs_train_like_the_live_teacher():
    teacher = _model(2, 0)
    stream = torch.randint(2, 32, (4000,), generator=torch.Generator().manual_seed(1))
    pool = continuation_pool(stream, teacher, 5, seed=5)
    logprobs = teacher_logprobs(teacher, pool)
    assert logprobs.shape == (5, POOL_CONTINUATION, 32) and logprobs.dtype == torch.float16
    with torch.no_grad():
        live = torch.log_softmax(teacher(input_ids=pool[:, :-1]).logits[:, PREFIX - 1 :], -1)
    assert torch.allclose(logprobs.float(), live, atol=1e-2)
    inputs, labels, cached = next(pool_batches(pool, 3, seed=0, logprobs=logprobs))
    plain_inputs, plain_labels = next(pool_batches(pool, 3, seed=0))  # the same rows, with their own log-probs
    assert torch.equal(inputs, plain_inputs) and torch.equal(labels, plain_labels)
    rows = [next(i for i in range(len(pool)) if torch.equal(pool[i, :-1], row)) for row in inputs]
    assert torch.equal(cached, logprobs[rows])

    # Steps from the cached log-probs train a draft as the live teacher does (up to their fp16 rounding).
    live_draft, cached_draft = _model(1, 1), _model(1, 1)
    live_losses = train_lm(live_draft, stream, 5, 3, 64, 3e-3, 0, teacher=teacher, data=pool_batches(pool, 3, 0),
                           argmax_weight=0.3)  # fmt: skip
    cached_losses = train_lm(cached_draft, stream, 5, 3, 64, 3e-3, 0, data=pool_batches(pool, 3, 0, logprobs),
                             argmax_weight=0.3)  # fmt: skip
    # (Losses, not weights: Adam turns the fp16 rounding of tiny gradients into full-size steps of either sign.)
    assert torch.allclose(torch.tensor(cached_losses), torch.tensor(live_losses), rtol=1e-2)


def test_teacher_logprobs_into_a_file_match_in_memory(tmp_path):
    teacher = _model(2, 0)
    stream = torch.randint(2, 32, (4000,), generator=torch.Generator().manual_seed(1))
    pool = continuation_pool(stream, teacher, 3, seed=5)
    file = tmp_path / "logprobs.bin"
    mapped = teacher_logprobs(teacher, pool, file=file)
    assert torch.equal(mapped, teacher_logprobs(teacher, pool))
    assert file.stat().st_size == mapped.numel() * 2  # fp16, written through to the file
    again = torch.from_file(str(file), size=mapped.numel(), dtype=torch.float16).view(mapped.shape)
    assert torch.equal(again, mapped)


def _markov_stream(length: int, seed: int) -> torch.Tensor:
    """Tokens that mostly follow a fixed permutation (a target trained on it has varied, learnable greedy text)."""
    g = torch.Generator().manual_seed(seed)
    successor = torch.randperm(30, generator=g) + 2
    tokens = [2]
    for noise in torch.rand(length, generator=g).tolist():
        tokens.append(successor[tokens[-1] - 2].item() if noise < 0.8 else int(torch.randint(2, 32, (1,), generator=g)))
    return torch.tensor(tokens)


def test_onpolicy_distillation_makes_the_draft_follow_the_targets_greedy_text():
    target, draft = _model(2, 0), _model(1, 1)
    stream = _markov_stream(4000, 2)
    train_lm(target, stream, 60, 8, 64, 3e-3, 0)
    pool = continuation_pool(stream, target, 16, seed=3)
    assert len(set(pool[:, PREFIX:].flatten().tolist())) > 10  # the target's greedy text is not one token

    def agreement() -> float:
        with torch.no_grad():
            t = target(input_ids=pool[:, :-1]).logits[:, PREFIX - 1 :].argmax(-1)
            d = draft(input_ids=pool[:, :-1]).logits[:, PREFIX - 1 :].argmax(-1)
        return (t == d).float().mean().item()

    before = agreement()
    train_lm(draft, stream, 60, 8, 64, 3e-3, 0, teacher=target, data=pool_batches(pool, 8, 0), argmax_weight=1.0)
    after = agreement()
    assert after > max(0.8, before + 0.3), (before, after)
