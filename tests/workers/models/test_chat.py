import pytest

from specserve.workers.errors import InvalidRequestError
from specserve.workers.models.chat import ChatMessage, chat_prompt_ids, conversation
from tests.helpers.workers import byte_tokenizer

CHATML = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")  # fmt: skip


def test_a_template_renders_the_conversation_as_apply_chat_template_does():
    tok = byte_tokenizer()
    tok.chat_template = CHATML
    messages = conversation("What is 2 + 2?", system="Be brief.")
    rows = [{"role": m.role, "content": m.content} for m in messages]
    expected = tok.apply_chat_template(rows, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert chat_prompt_ids(tok, messages) == list(expected)
    assert tok.decode(chat_prompt_ids(tok, messages)).endswith("<|im_start|>assistant\n")


def test_without_a_template_a_plain_transcript_is_encoded_like_a_text_prompt():
    tok = byte_tokenizer()
    ids = chat_prompt_ids(tok, [ChatMessage("system", "be brief"), ChatMessage("user", "hi")])
    assert ids == tok("system: be brief\nuser: hi\nassistant:")["input_ids"]


@pytest.mark.parametrize(
    ("messages", "field"),
    [
        ([], "messages"),
        ([ChatMessage("robot", "x")], "messages[0].role"),
        ([ChatMessage("user", "ok"), ChatMessage("user", 3)], "messages[1].content"),
    ],  # fmt: skip
)
def test_bad_messages_name_the_field(messages, field):
    with pytest.raises(InvalidRequestError) as e:
        chat_prompt_ids(byte_tokenizer(), messages)
    assert e.value.field == field
