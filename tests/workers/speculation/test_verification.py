"""Verification math alone: exact greedy cases, rejection sampling edge cases, determinism, distribution."""

import pytest
import torch

from specserve.workers.speculation.sampling import exponential_noise, make_generator, uniform_noise
from specserve.workers.speculation.verification import greedy_verify, rejection_verify


def _t(rows):
    return torch.tensor(rows, dtype=torch.long)


@pytest.mark.parametrize(
    "draft, target_argmax, accepted, next_token",
    [
        ([[5, 6, 7]], [[5, 6, 7, 9]], 3, 9),  # all accepted -> bonus token
        ([[5, 6, 7]], [[4, 6, 7, 9]], 0, 4),  # first rejected -> recovered token at position 0
        ([[5, 6, 7]], [[5, 8, 7, 9]], 1, 8),  # middle rejected; later matches do not count
        ([[5, 6, 7]], [[5, 6, 1, 9]], 2, 1),  # last rejected
        ([[]], [[3]], 0, 3),  # nothing drafted: plain decoding, bonus from position 0
    ],
)
def test_greedy_exact_cases(draft, target_argmax, accepted, next_token):
    draft_t = _t(draft) if draft != [[]] else torch.zeros(1, 0, dtype=torch.long)
    out = greedy_verify(draft_t, _t(target_argmax))
    assert out.accepted.tolist() == [accepted]
    assert out.next_token.tolist() == [next_token]
    assert (out.accepted == draft_t.shape[1]).tolist() == [accepted == draft_t.shape[1]]


def test_greedy_batch_rows_are_independent():
    out = greedy_verify(_t([[1, 2], [1, 2], [3, 3]]), _t([[1, 2, 0], [2, 2, 0], [3, 4, 5]]))
    assert out.accepted.tolist() == [2, 0, 1]
    assert out.next_token.tolist() == [0, 2, 4]


def _one_hot(tokens, V):
    return torch.nn.functional.one_hot(_t(tokens), V).float()


def test_rejection_identical_distributions_accept_everything():
    V, k = 6, 3
    p = torch.softmax(torch.randn(1, k + 1, V, generator=torch.Generator().manual_seed(0)), -1)
    draft = _t([[1, 2, 3]])
    u = torch.full((1, k), 0.999)
    noise = torch.ones(1, V)
    out = rejection_verify(draft, p[:, :k].clone(), p, u, noise)
    assert out.accepted.tolist() == [k]
    assert out.next_token.tolist() == [int(p[0, k].argmax())]  # bonus drawn from p_k (noise 1 -> argmax)


def test_rejection_token_the_target_cannot_produce_is_rejected_and_recovered_elsewhere():
    V = 4
    p = torch.tensor([[[0.0, 1.0, 0.0, 0.0], [0.25, 0.25, 0.25, 0.25]]])  # [1, 2, V]
    q = _one_hot([[2]], V)  # draft proposed token 2, which p gives 0
    out = rejection_verify(_t([[2]]), q, p, torch.zeros(1, 1), torch.ones(1, V))
    assert out.accepted.tolist() == [0]
    assert out.next_token.tolist() == [1]  # recovered from norm(max(0, p - q)) = one-hot(1)


def test_rejection_zero_draft_probability_is_rejected_not_divided():
    V = 3
    p = torch.tensor([[[0.5, 0.5, 0.0], [1.0, 0.0, 0.0]]])
    q = torch.tensor([[[1.0, 0.0, 0.0]]])  # token 1 has q = 0: it cannot have been drawn, reject it
    out = rejection_verify(_t([[1]]), q, p, torch.zeros(1, 1), torch.ones(1, V))
    assert out.accepted.tolist() == [0]
    assert torch.isfinite(out.next_token.float()).all()


def _verify_with_seed(seed, draft, q, p):
    g = make_generator(seed)
    u = uniform_noise(draft.shape[1], [g])
    e = exponential_noise(p.shape[-1], [g])
    return rejection_verify(draft, q, p, u, e)


def test_rejection_seeded_determinism():
    V, k = 50, 4
    gen = torch.Generator().manual_seed(3)
    p = torch.softmax(torch.randn(1, k + 1, V, generator=gen), -1)
    q = torch.softmax(torch.randn(1, k, V, generator=gen), -1)
    draft = torch.multinomial(q[0], 1, generator=gen).T  # [1, k]
    outs = [_verify_with_seed(7, draft, q, p) for _ in range(3)]
    assert all(o.accepted.item() == outs[0].accepted.item() for o in outs)
    assert all(o.next_token.item() == outs[0].next_token.item() for o in outs)
    others = {
        (_verify_with_seed(s, draft, q, p).accepted.item(), _verify_with_seed(s, draft, q, p).next_token.item())
        for s in range(20)
    }
    assert len(others) > 1  # the seed matters


def test_rejection_sampling_output_follows_target_distribution():
    """The first committed token (accepted draft or recovered token) is distributed as p_0, whatever q is; when the
    draft is accepted the bonus token is distributed as p_1. Checked on 200k rows at once."""
    torch.manual_seed(0)
    B, V = 200_000, 5
    p0 = torch.tensor([0.05, 0.4, 0.3, 0.2, 0.05])
    p1 = torch.tensor([0.6, 0.1, 0.1, 0.1, 0.1])
    q0 = torch.tensor([0.3, 0.1, 0.1, 0.1, 0.4])  # deliberately far from p0
    target = torch.stack([p0, p1]).expand(B, 2, V)
    draft_probs = q0.expand(B, 1, V)
    draft = torch.multinomial(q0, B, replacement=True).unsqueeze(1)  # [B, 1] drawn from q
    u = torch.rand(B, 1)
    e = torch.empty(B, V).exponential_()
    out = rejection_verify(draft, draft_probs, target, u, e)

    first = torch.where(out.accepted == 1, draft[:, 0], out.next_token)
    freq = torch.bincount(first, minlength=V).float() / B
    assert (freq - p0).abs().sum() / 2 < 0.01, freq

    bonus = out.next_token[out.accepted == 1]
    freq_bonus = torch.bincount(bonus, minlength=V).float() / len(bonus)
    assert (freq_bonus - p1).abs().sum() / 2 < 0.02, freq_bonus
    # Acceptance probability is sum_x min(p(x), q(x)) (Leviathan et al., eq. 1).
    expected_accept = torch.minimum(p0, q0).sum()
    assert abs(out.accepted.float().mean() - expected_accept) < 0.01
