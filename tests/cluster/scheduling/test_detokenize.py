"""Incremental detokenization: per-round text deltas concatenate to decoding all tokens at once, for byte-level BPE
(the tests' byte tokenizer, and SmolLM2's real vocabulary, fetched once: tests/helpers/real_model.py) and a
SentencePiece-style tokenizer (leading-space strip, byte fallback), on random ids and on multi-byte texts; and each
step decodes only a window."""

import random
import string

import pytest
from tokenizers import Tokenizer, decoders, models, normalizers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from specserve.cluster.scheduling.detokenize import IncrementalText, byte_pieces
from tests.helpers.real_model import real_model_dir
from tests.helpers.workers import byte_tokenizer

TEXTS = [
    "héllo wörld, naïve café",
    "日本語のテキスト。改行も\nあります",
    "emoji 🎉🎉 and a flag 🇫🇷 and ZWJ 👩‍💻",
    "  two leading spaces\tand a tab",
    "def f(x):\n    return x  # ünïcödé",
    " a",
]


def sentencepiece_tokenizer() -> PreTrainedTokenizerFast:
    """Llama's tokenizer shape: '▁' for spaces, a prepended '▁', byte-fallback tokens for anything else, and a
    decoder that strips the leading space of the whole text (the case a naive per-token decode gets wrong)."""
    pieces = ["▁", *string.ascii_letters, *string.digits, *".,:#()"]
    merges = [("▁", "t"), ("h", "e"), ("▁t", "he"), ("▁", "a"), ("i", "n")]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"<0x{b:02X}>": 3 + b for b in range(256)}
    for piece in pieces + [a + b for a, b in merges]:
        vocab.setdefault(piece, len(vocab))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def smollm2_tokenizer():
    return AutoTokenizer.from_pretrained(real_model_dir(), local_files_only=True)


TOKENIZERS = {"byte": byte_tokenizer, "sentencepiece": sentencepiece_tokenizer, "smollm2": smollm2_tokenizer}


@pytest.fixture(scope="module", params=sorted(TOKENIZERS))
def tokenizer(request):
    tok = TOKENIZERS[request.param]()
    tok.held = byte_pieces(tok)  # once per tokenizer, as ModelTokenizer does
    return tok


def streamed(tokenizer, ids: list[int], rng: random.Random) -> list[str]:
    """Deltas for `ids` arriving a few tokens per round, as rounds commit them."""
    text, out, n = IncrementalText(tokenizer, tokenizer.held), [], 0
    while n < len(ids):
        n = min(len(ids), n + rng.randint(1, 5))
        out.append(text.delta(ids[:n], final=n == len(ids)))
    return out


def test_deltas_of_multibyte_texts_add_up_to_the_whole_decode(tokenizer):
    rng = random.Random(0)
    for source in TEXTS:
        ids = tokenizer.encode(source, add_special_tokens=False)
        for _ in range(20):
            deltas = streamed(tokenizer, ids, rng)
            assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=True), source
            assert not any("\ufffd" in d for d in deltas)  # a character is never cut in two


def test_deltas_of_random_ids_add_up_to_the_whole_decode(tokenizer):
    rng = random.Random(1)
    for _ in range(300):
        ids = [rng.randrange(len(tokenizer)) for _ in range(rng.randint(1, 60))]
        assert "".join(streamed(tokenizer, ids, rng)) == tokenizer.decode(ids, skip_special_tokens=True), ids


def test_an_incomplete_character_is_held_back_until_its_last_byte():
    tok = byte_tokenizer()
    ids = tok.encode("a€b", add_special_tokens=False)  # '€' is three byte tokens
    assert len(ids) == 5
    text = IncrementalText(tok)
    assert [text.delta(ids[:n], final=False) for n in range(1, 6)] == ["a", "", "", "€", "b"]
    text = IncrementalText(tok)
    assert text.delta(ids[:1], final=False) == "a" and text.delta(ids[:3], final=True) == "\ufffd"  # cut off: as is


def test_a_run_of_byte_pieces_is_held_back_until_a_piece_closes_it():
    tok = sentencepiece_tokenizer()
    held = byte_pieces(tok)
    assert len(held) == 256 and not byte_pieces(byte_tokenizer())
    euro = [tok.convert_tokens_to_ids(f"<0x{b:02X}>") for b in "€".encode()]
    bad = tok.convert_tokens_to_ids("<0xFF>")
    a = tok.convert_tokens_to_ids("a")
    text = IncrementalText(tok, held)
    # '€' is complete after its third byte, but a fourth byte would make the whole run four U+FFFDs: held until 'a'
    deltas = [text.delta(ids, final=False) for ids in (euro, euro + [bad], euro + [bad, a])]
    assert deltas == ["", "", "\ufffd" * 4 + "a"]
    assert tok.decode(euro + [bad, a]) == "\ufffd" * 4 + "a"


class CountingTokenizer:
    """Wraps a tokenizer, recording how many ids each decode call gets."""

    def __init__(self, tokenizer):
        self.tokenizer, self.sizes = tokenizer, []

    def decode(self, ids, **kwargs):
        self.sizes.append(len(ids))
        return self.tokenizer.decode(ids, **kwargs)


def test_each_step_decodes_a_window_not_the_whole_text():
    counting = CountingTokenizer(byte_tokenizer())
    ids = counting.tokenizer.encode("the quick brown fox jumps " * 40, add_special_tokens=False)
    text = IncrementalText(counting)
    out = [text.delta(ids[:n], final=n >= len(ids)) for n in range(4, len(ids) + 4, 4)]
    assert "".join(out) == counting.tokenizer.decode(ids)
    assert len(ids) > 1000 and max(counting.sizes) <= 8  # two rounds of 4 tokens, however long the text grows
