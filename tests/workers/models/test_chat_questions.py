"""The built-in chat questions and how a question becomes prompt ids."""

from collections.abc import Mapping

import pytest

from specserve.workers.errors import InvalidRequestError
from specserve.workers.models.chat_questions import (
    HELD_OUT_QUESTIONS,
    TRAIN_QUESTIONS,
    question_prompt_ids,
    read_questions,
)
from tests.helpers.workers import byte_tokenizer

# SmolLM2-Instruct's template (ChatML with a default system turn)
CHATML = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful assistant<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def test_question_halves_are_large_disjoint_and_without_duplicates():
    assert len(TRAIN_QUESTIONS) >= 25 and len(HELD_OUT_QUESTIONS) >= 25
    assert not {q.lower() for q in TRAIN_QUESTIONS} & {q.lower() for q in HELD_OUT_QUESTIONS}
    normalised = [q.strip().lower() for q in TRAIN_QUESTIONS + HELD_OUT_QUESTIONS]
    assert len(set(normalised)) == len(normalised)
    assert all(q.strip() == q and len(q) > 10 for q in normalised)


def test_question_prompt_ids_equal_the_templates_own_tokenization():
    tok = byte_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.chat_template = CHATML
    for system in (None, "Answer briefly."):
        messages = ([{"role": "system", "content": system}] if system else []) + [
            {"role": "user", "content": HELD_OUT_QUESTIONS[0]}
        ]
        expected = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        expected = expected["input_ids"] if isinstance(expected, Mapping) else expected
        ids = question_prompt_ids(tok, HELD_OUT_QUESTIONS[0], system=system)
        assert ids == list(expected)
        assert tok.decode(ids).endswith("assistant\n")  # ready for the reply
    assert tok.convert_tokens_to_ids("<|im_start|>") in ids  # special tokens are single ids, not spelled out


def test_without_a_chat_template_the_prompt_is_a_plain_transcript():
    tok = byte_tokenizer()
    assert not tok.chat_template
    ids = question_prompt_ids(tok, "Why is the sky blue?", system="Be brief.")
    assert ids == tok("system: Be brief.\nuser: Why is the sky blue?\nassistant:")["input_ids"]
    with pytest.raises(InvalidRequestError, match="question"):
        question_prompt_ids(tok, "  ")


def test_read_questions_skips_blank_lines_and_comments(tmp_path):
    path = tmp_path / "q.txt"
    path.write_text("# my questions\nWhat is 2 + 2?\n\n   \n  How do I tie a tie?  \n  # indented comment\n")
    assert read_questions(str(path)) == ["What is 2 + 2?", "How do I tie a tie?"]


@pytest.mark.parametrize("content", ["", "\n  \n# only a comment\n"])
def test_read_questions_of_an_empty_file_is_a_clear_error(tmp_path, content):
    path = tmp_path / "empty.txt"
    path.write_text(content)
    with pytest.raises(InvalidRequestError, match="empty.txt.*holds no questions"):
        read_questions(str(path))
    with pytest.raises(InvalidRequestError, match="cannot read .*missing.txt"):
        read_questions(str(tmp_path / "missing.txt"))
