"""EAGLE-3 training data: the shard format, features equal to the target's, resumable runs, no held-out question."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from specserve.workers.errors import InvalidRequestError, ModelLoadError
from specserve.workers.models import gguf_store
from specserve.workers.models.chat_questions import HELD_OUT_QUESTIONS, TRAIN_QUESTIONS, question_prompt_ids
from specserve.workers.models.identity import target_identity
from specserve.workers.training import eagle_prompts, eagle_target
from specserve.workers.training.eagle_data import GenerationSettings, generate_data, read_manifest
from specserve.workers.training.eagle_prompts import QuestionFilter, Topic
from specserve.workers.training.eagle_target import EagleTarget, Sampling
from tests.helpers.gguf_files import write_tiny_gguf
from tests.helpers.workers import CHATTY_LAYERS, save_tiny_llama

LAYERS = CHATTY_LAYERS  # the `chatty_target` fixture's: feature layers 2, 4, 5
SMALL = GenerationSettings(
    shard_sequences=6, batch=4, max_question_tokens=48, max_answer_tokens=10, train_question_fraction=0.3,
    gen_dtype="float32",
)  # fmt: skip


@pytest.fixture(scope="module")
def one_run(chatty_target, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("data") / "one"
    manifest = generate_data(chatty_target, out, answer_tokens=100, settings=SMALL, progress=False)
    assert len(manifest.shards) >= 2
    return out


def _shards(out: Path) -> list[dict[str, torch.Tensor]]:
    return [load_file(str(out / s.file)) for s in read_manifest(out).shards]


def _sequences(shard: dict[str, torch.Tensor]) -> list[tuple[int, int]]:
    starts = shard["seq_starts"].tolist()
    return list(zip(starts[:-1], starts[1:], strict=True))


def _user_question(tokenizer, prompt: list[int]) -> str:
    text = tokenizer.decode(prompt)
    return text.split("<|im_start|>user\n", 1)[1].split("<|im_end|>", 1)[0]


def test_shards_have_the_documented_keys_dtypes_and_shapes(one_run, chatty_target):
    manifest = json.loads((one_run / "manifest.json").read_text())
    assert manifest["format"] == 1 and manifest["target"] == target_identity(chatty_target)
    assert manifest["num_hidden_layers"] == LAYERS and manifest["hidden_size"] == 32
    assert manifest["feature_layers"] == [2, 4, 5] and manifest["vocab_size"] == 259
    assert sum(s["answer_tokens"] for s in manifest["shards"]) >= 100
    for info, shard in zip(manifest["shards"], _shards(one_run), strict=True):
        t = int(shard["seq_starts"][-1])
        assert set(shard) == {"input_ids", "seq_starts", "loss_mask", "features", "last_hidden"}
        assert shard["input_ids"].dtype == torch.int32 and shard["input_ids"].shape == (t,)
        assert shard["seq_starts"].dtype == torch.int64 and shard["seq_starts"].shape == (SMALL.shard_sequences + 1,)
        assert shard["loss_mask"].dtype == torch.uint8 and shard["loss_mask"].shape == (t,)
        assert shard["features"].dtype == torch.float16 and shard["features"].shape == (t, 3 * 32)
        assert shard["last_hidden"].dtype == torch.float16 and shard["last_hidden"].shape == (t, 32)
        assert (info["sequences"], info["tokens"]) == (SMALL.shard_sequences, t)
        assert info["answer_tokens"] == int(shard["loss_mask"].sum())


def test_loss_mask_marks_exactly_the_answer_after_the_bench_prompt(one_run, chatty_target):
    tokenizer = AutoTokenizer.from_pretrained(chatty_target, local_files_only=True)
    for shard in _shards(one_run):
        for a, b in _sequences(shard):
            ids, mask = shard["input_ids"][a:b].tolist(), shard["loss_mask"][a:b].tolist()
            prompt_len = mask.index(1)
            assert mask == [0] * prompt_len + [1] * (b - a - prompt_len)  # one prompt, then only answer
            prompt, answer = ids[:prompt_len], ids[prompt_len:]
            assert prompt == question_prompt_ids(tokenizer, _user_question(tokenizer, prompt))
            assert 1 <= len(answer) <= SMALL.max_answer_tokens
            eos = [i for i, t in enumerate(answer) if t == tokenizer.eos_token_id]
            assert eos in ([], [len(answer) - 1])  # an answer ends at its first EOS, kept as its last token


def test_features_equal_an_fp32_forward_at_the_feature_layers(one_run, chatty_target):
    model = AutoModelForCausalLM.from_pretrained(chatty_target, local_files_only=True).eval()
    shard = _shards(one_run)[0]
    for a, b in _sequences(shard):
        with torch.no_grad():
            hs = model(shard["input_ids"][a:b].long()[None], output_hidden_states=True).hidden_states
        expected = torch.cat([hs[2], hs[4], hs[5]], dim=-1)[0]
        torch.testing.assert_close(shard["features"][a:b].float(), expected, rtol=2e-3, atol=2e-3)
        torch.testing.assert_close(shard["last_hidden"][a:b].float(), hs[-1][0], rtol=2e-3, atol=2e-3)
        assert not torch.allclose(shard["features"][a:b, :32].float(), hs[3][0], atol=1e-2)  # not any layer


def test_a_stopped_and_resumed_run_makes_the_shards_of_one_run(one_run, chatty_target, tmp_path):
    out = tmp_path / "resumed"
    first = generate_data(chatty_target, out, answer_tokens=1, settings=SMALL, progress=False)
    assert len(first.shards) == 1
    (out / ".shard-00001.safetensors.tmp").write_bytes(b"half a shard")  # a run killed mid-write
    resumed = generate_data(chatty_target, out, answer_tokens=100, settings=SMALL, progress=False)
    assert resumed.shards == read_manifest(one_run).shards
    assert not list(out.glob(".*.tmp"))
    for mine, theirs in zip(_shards(out), _shards(one_run), strict=True):
        for key in theirs:
            assert torch.equal(mine[key], theirs[key]), key


def test_data_that_is_already_enough_is_returned_without_loading_the_target(one_run, chatty_target, tmp_path,
                                                                           monkeypatch):  # fmt: skip
    out = tmp_path / "enough"
    shutil.copytree(one_run, out)

    def refuse(*args, **kwargs):
        raise AssertionError("the target was loaded")

    monkeypatch.setattr("specserve.workers.training.eagle_data.EagleTarget", refuse)
    have = read_manifest(one_run).answer_tokens
    assert generate_data(chatty_target, out, answer_tokens=have, settings=SMALL, progress=False).shards == (
        read_manifest(one_run).shards
    )
    with pytest.raises(InvalidRequestError, match="seed"):  # still checked
        generate_data(chatty_target, out, answer_tokens=have, seed=1, settings=SMALL, progress=False)
    with pytest.raises(AssertionError, match="loaded"):  # more is asked for: the target answers
        generate_data(chatty_target, out, answer_tokens=have + 1, settings=SMALL, progress=False)


def test_resuming_with_other_settings_or_target_is_refused(one_run, chatty_target, tmp_path, models_dir):
    out = tmp_path / "copy"
    shutil.copytree(one_run, out)
    with pytest.raises(InvalidRequestError, match="seed"):
        generate_data(chatty_target, out, answer_tokens=10**6, seed=1, settings=SMALL, progress=False)
    with pytest.raises(InvalidRequestError, match="max_answer_tokens"):
        other = GenerationSettings(**{**SMALL.__dict__, "max_answer_tokens": 11})
        generate_data(chatty_target, out, answer_tokens=10**6, settings=other, progress=False)
    other_target = save_tiny_llama(models_dir / "eagle_other", seed=4, layers=LAYERS, hidden=32)
    with pytest.raises(InvalidRequestError, match="holds data of target"):
        generate_data(other_target, out, answer_tokens=10**6, settings=SMALL, progress=False)


def test_greedy_answers_are_what_the_target_decodes_alone(models_dir):
    # A plain random target: its argmax depends on every position, so a padded row that saw its padding would differ.
    path = save_tiny_llama(models_dir / "eagle_plain", seed=6, layers=LAYERS, hidden=32)
    target = EagleTarget(path, "float32")
    prompts = [target.chat_prompt(q) for q in TRAIN_QUESTIONS[:6]]
    assert len({len(p) for p in prompts}) == 6  # every batch is padded
    with torch.no_grad():  # no padding, no batch, no EOS
        alone = [
            target.model.generate(torch.tensor([p]), do_sample=False, max_new_tokens=12, min_new_tokens=12,
                                  pad_token_id=0)[0, len(p) :].tolist()
            for p in prompts
        ]  # fmt: skip
    target.eos_ids = [alone[0][2]]  # a token some rows emit early: those rows leave their batch mid-way
    expected = [row[: row.index(target.eos_ids[0]) + 1] if target.eos_ids[0] in row else row for row in alone]
    assert 3 in {len(e) for e in expected} and 12 in {len(e) for e in expected}
    answers = target.answers(prompts, [False] * 6, 12, Sampling(0.7), np.random.default_rng(0), batch=4)
    assert answers == expected


def test_sampling_keeps_to_the_nucleus():
    logits = torch.tensor([[0.6, 0.3, 0.1]]).log().expand(2000, 3)
    generator = torch.Generator().manual_seed(0)
    counts = torch.bincount(eagle_target._pick(logits, Sampling(1.0, 0.7), generator), minlength=3)
    assert counts[2] == 0 and 1200 < counts[0] < 1600  # 0.6 / 0.9 of the draws
    assert (eagle_target._pick(logits, Sampling(1.0, 0.5), generator) == 0).all()
    assert (eagle_target._pick(logits, None, generator) == 0).all()
    flat = -torch.arange(4000.0).expand(200, 4000) * 1e-4  # a nucleus wider than the candidates looked at first
    picks = eagle_target._pick(flat, Sampling(1.0, 0.9), generator)
    assert len(set(picks.tolist())) > 150 and (picks >= 600).float().mean() > 0.6


def test_no_held_out_question_is_ever_asked(one_run, chatty_target, monkeypatch):
    tokenizer = AutoTokenizer.from_pretrained(chatty_target, local_files_only=True)
    held = [q.casefold() for q in HELD_OUT_QUESTIONS]
    asked = []
    for shard in _shards(one_run):
        for a, b in _sequences(shard):
            text = tokenizer.decode(shard["input_ids"][a:b].tolist()).casefold()
            assert not [q for q in held if q in text]
            mask = shard["loss_mask"][a:b].tolist()
            asked.append(_user_question(tokenizer, shard["input_ids"][a : a + mask.index(1)].tolist()))
    assert set(asked) & set(TRAIN_QUESTIONS) and set(asked) - set(TRAIN_QUESTIONS)  # both kinds were asked
    # A topic whose questions start as held-out ones: those are all dropped, the others kept.
    topic = Topic("bench", "You ask questions.", (HELD_OUT_QUESTIONS[0], HELD_OUT_QUESTIONS[5].upper(), "How"))
    monkeypatch.setattr(eagle_target, "TOPICS", (topic,))
    questions = EagleTarget(chatty_target, "float32").questions(6, np.random.default_rng(0), 48, 8)
    assert len(questions) == 6 and all(q.startswith("How") for q in questions)


def test_question_filter():
    keep = QuestionFilter(HELD_OUT_QUESTIONS, ["<|im_start|>", "<|im_end|>"]).keep
    assert all(keep(q) for q in TRAIN_QUESTIONS)
    assert not any(keep(q) for q in HELD_OUT_QUESTIONS)
    assert not keep("Quick one: " + HELD_OUT_QUESTIONS[3].lower().rstrip("?") + " please?")  # contains one
    assert not keep("   ") and not keep("Why?") and not keep("What is \ufffd\ufffd?")
    assert not keep("Explain this <|im_start|>assistant")
    assert not keep("How do I do it " * 4)  # a loop
    assert not keep("\n".join(f"line {i} of a document" for i in range(10)))
    assert not keep("1234 5678 90 + 7 = ?!")  # no words


def test_question_prefix_ends_where_the_users_words_begin(chatty_target):
    tokenizer = AutoTokenizer.from_pretrained(chatty_target, local_files_only=True)
    prefix = eagle_prompts.question_prefix(tokenizer, "Be brief.", "How")
    assert prefix == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHow"
    assert all(t.system and len(t.openings) > 5 for t in eagle_prompts.TOPICS)


def test_target_identity(tmp_path, chatty_target, models_dir):
    copy = tmp_path / "copy"
    shutil.copytree(chatty_target, copy)
    identity = target_identity(chatty_target)
    assert len(identity) == 64 and target_identity(copy) == identity  # bytes, not paths
    other = save_tiny_llama(models_dir / "identity_other", seed=5, layers=2, hidden=16)
    assert target_identity(other) != identity
    (copy / "config.json").write_text(
        (copy / "config.json").read_text().replace('"rms_norm_eps"', '"x": 1, "rms_norm_eps"')
    )
    assert target_identity(copy) != identity  # the config counts
    gguf = write_tiny_gguf(tmp_path / "tiny.gguf", seed=0)
    digest = gguf_store.file_sha256(gguf, progress=False)
    assert target_identity(gguf) == digest
    converted = tmp_path / "converted"
    shutil.copytree(chatty_target, converted)
    (converted / gguf_store.MARKER).write_text(json.dumps({"sha256": digest}))
    assert target_identity(converted) == digest  # a conversion is its GGUF
    (copy / "config.json").unlink()
    with pytest.raises(ModelLoadError, match="config.json"):
        target_identity(copy)
    with pytest.raises(ModelLoadError, match="neither"):
        target_identity(tmp_path / "missing")


def test_too_few_layers_is_refused(tiny_target, tmp_path):
    with pytest.raises(ModelLoadError, match="at least 7"):
        generate_data(tiny_target, tmp_path / "out", answer_tokens=10, settings=SMALL, progress=False)


def test_passage_prompts_quote_the_answer_and_skip_short_ones():
    long_answer = " ".join(f"Word{i} is here." for i in range(120))  # 360 words, 120 sentences
    assert eagle_prompts.passage_prompt(eagle_prompts.PASSAGE_TASKS[0], "Q?", "too short", "French") is None
    for task in eagle_prompts.PASSAGE_TASKS:
        prompt = eagle_prompts.passage_prompt(task, " What is it? ", long_answer, "German")
        assert prompt is not None and "{" not in prompt
        if "{passage}" in task.template:
            assert "Word0 is here." in prompt and "Word99 is" in prompt and "Word100 " not in prompt  # 300 words
        if "{excerpt}" in task.template:
            assert "Word2 is here." in prompt and "Word3 " not in prompt  # three sentences
        if "{question}" in task.template:
            assert "What is it?" in prompt
        if "{language}" in task.template:
            assert "German" in prompt


def test_passage_requests_follow_finished_answers_and_never_quote_a_held_out_question(chatty_target):
    target = EagleTarget(chatty_target)
    words = target.tokenizer(" ".join(["apple"] * 60), add_special_tokens=False)["input_ids"]
    finished, cut = [*words, target.eos_ids[0]], list(words)
    rng = np.random.default_rng(0)
    requests = eagle_target.passage_requests(target, ["Q1?", "Q2?"], [finished, cut], rng, 1.0)
    assert len(requests) == 1 and "apple apple" in requests[0]
    assert eagle_target.passage_requests(target, ["Q1?"], [finished], rng, 0.0) == []
    held_out = HELD_OUT_QUESTIONS[0]
    quoting = [t for t in eagle_prompts.PASSAGE_TASKS if "{question}" in t.template]
    requests = [eagle_prompts.passage_prompt(t, held_out, " ".join(["apple"] * 60), "French") for t in quoting]
    assert all(target.filter.is_held_out(r) for r in requests)  # passage_requests drops exactly these


def test_shards_hold_requests_over_their_own_answers(chatty_target, tmp_path, monkeypatch):
    monkeypatch.setattr(eagle_prompts, "_MIN_PASSAGE_WORDS", 1)
    settings = GenerationSettings(
        **{**SMALL.__dict__, "passage_fraction": 1.0, "train_question_fraction": 0.0, "max_answer_tokens": 64}
    )  # answers that end, so they can be passages
    manifest = generate_data(chatty_target, tmp_path / "d", answer_tokens=1, settings=settings, progress=False)
    shard = load_file(str(tmp_path / "d" / manifest.shards[0].file))
    assert manifest.shards[0].sequences > settings.shard_sequences  # the questions, then requests over answers
    tokenizer = AutoTokenizer.from_pretrained(chatty_target)
    starts = shard["seq_starts"].tolist()
    texts = [tokenizer.decode(shard["input_ids"][a:b].tolist()) for a, b in zip(starts, starts[1:], strict=False)]
    templates = [t.template.split("{")[0] for t in eagle_prompts.PASSAGE_TASKS if not t.template.startswith("{")]
    assert any(any(head and head in text for head in templates) for text in texts[settings.shard_sequences :])
    assert int(shard["loss_mask"].sum()) == manifest.shards[0].answer_tokens


def test_a_deadline_ends_the_data_after_a_whole_shard_and_old_manifests_had_no_passages(chatty_target, tmp_path):
    import time

    manifest = generate_data(chatty_target, tmp_path / "d", answer_tokens=10**6, settings=SMALL, progress=False,
                             deadline=time.monotonic())  # fmt: skip
    assert len(manifest.shards) == 1
    path = tmp_path / "d" / "manifest.json"
    data = json.loads(path.read_text())
    del data["generation"]["passage_fraction"]
    path.write_text(json.dumps(data))
    assert read_manifest(tmp_path / "d").settings.passage_fraction == 0.0


def test_token_ids_restore_to_the_same_shards_and_refuse_another_target(one_run, chatty_target, tmp_path, models_dir):
    """A lent GPU sends back token ids only; re-featured, they make the shards the run made (features included)."""
    from specserve.workers.training.eagle_tokens import RESTORED_SEED, restore_data, save_token_ids

    saved = save_token_ids([one_run], tmp_path / "tokens.npz")
    assert saved == read_manifest(one_run).answer_tokens
    target = EagleTarget(chatty_target)
    manifest = restore_data(tmp_path / "tokens.npz", target, tmp_path / "restored", SMALL.shard_sequences, 8192)
    assert manifest.seed == RESTORED_SEED and read_manifest(tmp_path / "restored").shards == manifest.shards
    originals = [s for shard in _shards(one_run) for s in _split(shard)]
    restored = [s for shard in _shards(tmp_path / "restored") for s in _split(shard)]
    assert len(originals) == len(restored)
    for mine, theirs in zip(restored, originals, strict=True):
        for key in theirs:
            torch.testing.assert_close(mine[key], theirs[key], rtol=0, atol=2e-3, msg=key)
    with pytest.raises(InvalidRequestError, match="seed"):  # generation cannot resume into restored data
        generate_data(chatty_target, tmp_path / "restored", answer_tokens=10**6, settings=SMALL, progress=False)
    other = EagleTarget(save_tiny_llama(models_dir / "not-chatty", seed=5, layers=LAYERS, hidden=32))
    with pytest.raises(ModelLoadError, match="token ids of target"):
        restore_data(tmp_path / "tokens.npz", other, tmp_path / "other", 4, 8192)


def _split(shard: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
    """A shard's sequences one by one (restored shards may cut the sequences at other places)."""
    return [{k: shard[k][a:b] for k in ("input_ids", "loss_mask", "features", "last_hidden")}
            for a, b in _sequences(shard)]  # fmt: skip
