"""EAGLE-3 drafting and training: the cached, batched drafting steps equal a recomputation without cache; the
acceptance the trainer measures is what drafting through the cache accepts; a few seconds of training-time-test
training on tiny data lowers the loss and raises held-out acceptance; an interrupted run resumes to the same head."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from specserve.workers.errors import InvalidRequestError, ModelLoadError
from specserve.workers.speculation.eagle.checkpoint import load_head
from specserve.workers.speculation.eagle.config import Eagle3Config
from specserve.workers.speculation.eagle.drafting import Eagle3Drafting
from specserve.workers.speculation.eagle.head import Eagle3Head, ttt_forward, vocab_maps
from specserve.workers.training import eagle_train
from specserve.workers.training.eagle_acceptance import chain_acceptance, target_weights
from specserve.workers.training.eagle_manifest import read_manifest, shard_paths
from specserve.workers.training.eagle_shards import answer_token_counts, load_shard, make_batch
from specserve.workers.training.eagle_train import train_head, ttt_loss
from tests.helpers.eagle_data import write_tiny_eagle_data
from tests.helpers.eagle_heads import draft_greedy
from tests.helpers.workers import save_tiny_llama

K = 3  # drafted tokens, and TTT steps


def random_head(seed: int, vocab: int = 50, draft_vocab: int = 20) -> Eagle3Head:
    torch.manual_seed(seed)
    head = Eagle3Head(Eagle3Config(32, 64, 4, 2, 8, vocab, draft_vocab, 32)).eval()
    for p in head.parameters():
        torch.nn.init.normal_(p, std=0.3)  # peaked logits: argmaxes with clear margins
    head.set_vocab_maps(*vocab_maps(torch.randperm(vocab).float(), draft_vocab))
    return head


def recomputed(head, embed, features, tokens, drafted) -> list[torch.Tensor]:
    """Logits of the newest entry and of each chained step, recomputed over the whole sequence without a cache.
    features [n, 3H] of positions 0..n-1, tokens [n] the tokens at 1..n, drafted: the chain's input tokens."""
    n = features.shape[0]
    padded = torch.cat([tokens, torch.tensor(drafted, dtype=torch.long)])
    steps = [padded[j : j + n][None] for j in range(len(drafted) + 1)]
    with torch.no_grad():
        return [head.logits(h[0, -1]) for h in ttt_forward(head, embed, features[None], steps)]


def test_cached_batched_drafting_equals_a_recomputation_without_cache():
    head, embed = random_head(0), torch.randn(50, 32)
    g = torch.Generator().manual_seed(1)
    sequences = {
        r: (torch.randn(n, 96, generator=g) * 4, torch.randint(0, 50, (n,), generator=g))
        for r, n in (("a", 11), ("b", 4), ("c", 17))
    }
    drafting = Eagle3Drafting(head, embed)
    committed = {"a": 6, "b": 1, "c": 9}
    drafting.extend([(r, sequences[r][0][:n], sequences[r][1][:n].tolist()) for r, n in committed.items()])
    # a second round of different lengths per request, b with nothing new
    order = ("c", "a", "b")
    rows = [(r, sequences[r][0][committed[r] :], sequences[r][1][committed[r] :].tolist()) for r in ("c", "a")]
    step = drafting.extend([*rows, ("b", torch.zeros(0, 96), [])])
    assert [drafting.length(r) for r in "abc"] == [11, 1, 17]

    chain_inputs = [[7, 3, 9], [1, 2, 4]]  # per chained step, the token fed to rows c, a, b
    chain = drafting.chain(order, step)
    logits = [step.logits] + [chain.step(torch.tensor(tokens)).logits for tokens in chain_inputs]
    for row, r in enumerate(order):
        features, tokens = (x[: drafting.length(r)] for x in sequences[r])
        expected = recomputed(head, embed, features, tokens, [tokens_in[row] for tokens_in in chain_inputs])
        for got, want in zip(logits, expected, strict=True):
            torch.testing.assert_close(got[row], want, atol=1e-5, rtol=1e-5)
    drafting.extend([("b", sequences["b"][0][1:], sequences["b"][1][1:].tolist())])  # b alone, later
    assert [drafting.length(r) for r in "abc"] == [11, 4, 17]  # the chain never commits

    drafting.rollback("a", 5)  # rejected: the request goes on from position 5 with other tokens
    other = torch.randint(0, 50, (6,), generator=g)
    step = drafting.extend([("a", sequences["a"][0][5:], other.tolist())])
    expected = recomputed(head, embed, sequences["a"][0], torch.cat([sequences["a"][1][:5], other]), [])
    torch.testing.assert_close(step.logits[0], expected[0], atol=1e-5, rtol=1e-5)
    with pytest.raises(InvalidRequestError, match="length"):
        drafting.rollback("a", 12)
    drafting.rollback("a", 3)
    with pytest.raises(InvalidRequestError, match="no newest entry"):
        drafting.extend([("a", torch.zeros(0, 96), [])])


def test_greedy_drafts_are_target_ids_in_the_draft_vocabulary():
    head, embed = random_head(2), torch.randn(50, 32)
    drafting = Eagle3Drafting(head, embed)
    drafted = draft_greedy(drafting, [("r", torch.randn(5, 96), [1, 2, 3, 4, 5])], k=4)
    assert len(drafted) == 1 and len(drafted[0]) == 4
    assert all(head.t2d[t] for t in drafted[0])
    logits = torch.randn(2, 20)
    full = head.to_target_logits(logits)  # [2, 50]
    assert torch.equal(full.argmax(-1), head.draft_to_target(logits.argmax(-1)))
    assert torch.isinf(full[:, ~head.t2d]).all() and torch.equal(full[:, head.t2d], logits)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """A tiny-vocabulary target (peaked, so its greedy answers are learnable in seconds) and its data."""
    root = tmp_path_factory.mktemp("eagle_data")
    target = save_tiny_llama(root / "target", seed=3, layers=8, hidden=32, tiny_vocab=True, init_range=0.5)
    train = write_tiny_eagle_data(target, root / "train", sequences=64, seed=1)
    held_out = write_tiny_eagle_data(target, root / "held_out", sequences=24, seed=2)
    return target, train, held_out


def untrained_head(target: str, train, draft_vocab: int, seed: int = 0) -> Eagle3Head:
    weights = target_weights(target)
    manifest = read_manifest(train)
    torch.manual_seed(seed)
    head = Eagle3Head(Eagle3Config.for_target(weights.config, draft_vocab))
    head.set_vocab_maps(
        *vocab_maps(answer_token_counts(shard_paths(train, manifest), manifest.vocab_size), draft_vocab)
    )
    return head.eval()


def test_chain_acceptance_is_what_drafting_through_the_cache_accepts(data):
    target, train, _ = data
    head, weights = untrained_head(target, train, draft_vocab=6), target_weights(target)
    accepted, starts = torch.zeros(K, dtype=torch.int64), 0
    for path in shard_paths(train, read_manifest(train)):
        shard = load_shard(path, weights.lm_head, 32)
        for s in range(len(shard.seq_starts) - 1):
            first, end = int(shard.seq_starts[s]), int(shard.seq_starts[s + 1])
            for t in range(end - first - 1 - K):  # entry t drafts tokens t+2 .. t+1+K
                if not shard.loss_mask[first + t + 2 : first + t + 2 + K].all():
                    continue
                drafting = Eagle3Drafting(head, weights.embed)
                features, tokens = shard.features[first : first + t + 1], shard.input_ids[first + 1 : first + t + 2]
                drafted = torch.tensor(draft_greedy(drafting, [("r", features, tokens.tolist())], K)[0])
                greedy = shard.greedy[first + t + 1 : first + t + 1 + K]  # the target's tokens at t+2 ..
                accepted += (drafted == greedy).cumprod(0)
                starts += 1
    assert starts > 100
    measured = chain_acceptance(head, weights, train, K)
    assert measured == pytest.approx((accepted.double() / starts).tolist(), abs=1e-12)


def test_training_lowers_the_loss_and_raises_held_out_acceptance(data, tmp_path):
    target, train, held_out = data
    weights = target_weights(target)
    before = chain_acceptance(untrained_head(target, train, 6), weights, held_out, K)
    result = train_head(
        train,
        target,
        tmp_path / "head",
        epochs=12,
        ttt_steps=K,
        draft_vocab_size=6,
        lr=3e-3,
        batch_tokens=512,
        seed=0,
        eval_data_dir=held_out,
    )
    assert result.steps == 48 and result.head_dir == tmp_path / "head"
    assert result.acceptance[0] > before[0] + 0.2  # measured: 0.11 -> 0.46
    assert all(after > b for after, b in zip(result.acceptance, before, strict=True))

    trained = load_head(result.head_dir, target, target_hidden_size=32, vocab_size=8, target_num_layers=8)
    assert trained.config.feature_layers == (2, 4, 5)
    shard = load_shard(shard_paths(train, read_manifest(train))[0], weights.lm_head, 32)
    batch = make_batch(shard, list(range(16)), K, 2048)
    with torch.no_grad():
        loss_before = ttt_loss(untrained_head(target, train, 6), weights, batch, K, 0.8, bf16=False).loss
        loss_after = ttt_loss(trained, weights, batch, K, 0.8, bf16=False).loss
    assert loss_after < loss_before - 0.3


def test_training_reads_several_data_directories_and_measures_acceptance_as_it_goes(data, tmp_path):
    """Data restored from an earlier run beside new data: one run over both, held-out acceptance every few steps."""
    target, train, held_out = data
    shutil.copytree(train, tmp_path / "again")
    settings = dict(steps=8, ttt_steps=2, draft_vocab_size=6, lr=3e-3, batch_tokens=256, progress=False)
    one = train_head(train, target, tmp_path / "one", **settings)
    both = train_head([train, tmp_path / "again"], target, tmp_path / "both", eval_data_dir=held_out,
                      eval_every_steps=3, **settings)  # fmt: skip
    assert [step for step, _ in both.acceptance_by_step] == [3, 6, 8]
    assert both.acceptance == both.acceptance_by_step[-1][1] and len(both.acceptance) == 2
    assert one.acceptance is None and one.acceptance_by_step == []
    a = load_head(one.head_dir, target, 32, 8).state_dict()
    b = load_head(both.head_dir, target, 32, 8).state_dict()
    assert any(not torch.equal(a[name], b[name]) for name in a)  # twice the shards: another batch order


def test_an_interrupted_run_resumes_to_the_same_head(data, tmp_path, monkeypatch):
    target, train, _ = data
    settings = dict(steps=6, ttt_steps=2, draft_vocab_size=6, lr=3e-3, batch_tokens=256, seed=4, progress=False)
    straight = train_head(train, target, tmp_path / "straight", **settings)

    calls = {"n": 0}
    real_loss = eagle_train.ttt_loss

    def failing_on_the_fourth(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 4:
            raise RuntimeError("interrupted")
        return real_loss(*args, **kwargs)

    monkeypatch.setattr(eagle_train, "ttt_loss", failing_on_the_fourth)
    with pytest.raises(RuntimeError, match="interrupted"):
        train_head(train, target, tmp_path / "resumed", checkpoint_every_s=0.0, **settings)
    monkeypatch.setattr(eagle_train, "ttt_loss", real_loss)
    resumed = train_head(train, target, tmp_path / "resumed", **settings)
    assert resumed.steps == 6
    a = load_head(straight.head_dir, target, 32, 8).state_dict()
    b = load_head(resumed.head_dir, target, 32, 8).state_dict()
    assert all(torch.equal(a[name], b[name]) for name in a)

    with pytest.raises(InvalidRequestError, match=r"train-state\.pt was written with"):
        train_head(train, target, tmp_path / "resumed", **(settings | {"draft_vocab_size": 5}))


def test_data_of_another_target_is_refused(data, tmp_path):
    target, train, _ = data
    other = save_tiny_llama(tmp_path / "other", seed=9, layers=8, hidden=32, tiny_vocab=True)
    with pytest.raises(ModelLoadError, match=r"manifest\.json was generated for another target"):
        train_head(train, other, tmp_path / "head", steps=1)
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "manifest.json").write_text(json.dumps({"format": 1}))
    with pytest.raises(ModelLoadError, match="not an EAGLE-3 data manifest"):
        train_head(tmp_path / "empty", target, tmp_path / "head", steps=1)


def test_the_recipe_packs_a_checkpoint_into_two_files_that_join_to_the_head(data, tmp_path):
    """A lent GPU's run that is cut short still sends back its newest checkpoint, as two files of under 16 MB."""
    from specserve.workers.training.eagle_recipe import WEIGHTS_PARTS, join_weights, pack

    target, train, _ = data
    trained = train_head(train, target, tmp_path / "work" / "head", steps=3, ttt_steps=2, draft_vocab_size=6,
                         lr=3e-3, batch_tokens=256, progress=False)  # fmt: skip
    assert pack(tmp_path / "work", tmp_path / "out")
    parts = [load_file(str(tmp_path / "out" / name)) for name in WEIGHTS_PARTS]
    assert set(parts[1]) == {"lm_head.weight"} and "lm_head.weight" not in parts[0]
    join_weights(tmp_path / "out", tmp_path / "joined")
    (tmp_path / "joined" / "config.json").write_text((tmp_path / "out" / "config.json").read_text())
    a = load_head(trained.head_dir, target, 32, 8).state_dict()
    b = load_head(tmp_path / "joined", target, 32, 8).state_dict()
    assert set(a) == set(b) and all(torch.equal(a[name], b[name]) for name in a)
    assert not pack(tmp_path / "nothing", tmp_path / "out2")
