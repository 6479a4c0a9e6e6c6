"""Tiny random-weight llama GGUF files for tests, written with the `gguf` package the way llama.cpp writes them."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import gguf
import numpy as np
from tokenizers import pre_tokenizers

# SmolLM2-Instruct's ChatML template, as its GGUF carries it.
CHATML_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2 as in SmolLM2: unk/bos/eos
# A few common English pairs, in merge order, on top of the 256 byte tokens: a real byte-level BPE, still tiny.
MERGES = [
    ("Ġ", "t"), ("h", "e"), ("i", "n"), ("Ġ", "a"), ("e", "r"), ("o", "n"), ("Ġt", "he"), ("r", "e"), ("Ġ", "s"),
    ("a", "t"), ("e", "n"), ("o", "r"), ("Ġ", "w"), ("e", "s"), ("Ġ", "o"), ("i", "s"), ("a", "n"), ("Ġ", "c"),
    ("e", "d"), ("Ġ", "b"), ("in", "g"), ("Ġ", "f"), ("Ġ", "p"), ("o", "u"), ("Ġ", "m"), ("l", "l"), ("Ġa", "n"),
    ("Ġ", "i"), ("a", "r"), ("Ġo", "f"),
]  # fmt: skip
_CONTROL, _NORMAL = 3, 1  # llama.cpp token types

Quant = Literal["F32", "Q8_0", "Q4_1"]


def tiny_vocab() -> tuple[list[str], list[int], list[str]]:
    """(tokens, token types, merges) of the tiny byte-level BPE vocabulary (289 tokens)."""
    tokens = list(SPECIALS) + sorted(pre_tokenizers.ByteLevel.alphabet())
    tokens += [a + b for a, b in MERGES]
    types = [_CONTROL] * len(SPECIALS) + [_NORMAL] * (len(tokens) - len(SPECIALS))
    return tokens, types, [f"{a} {b}" for a, b in MERGES]


def _llama_cpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    # llama.cpp interleaves the rotary halves of q/k rows; transformers undoes it when loading.
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_tiny_gguf(
    path: str | Path,
    seed: int = 0,
    quant: Quant = "Q8_0",
    layers: int = 2,
    hidden: int = 64,
    heads: int = 4,
    kv_heads: int = 2,
    ffn: int = 128,
    std: float = 0.2,
    tied: bool = True,
    arch: str = "llama",
    tokenizer_model: str = "gpt2",
    chat_template: str = CHATML_TEMPLATE,
) -> Path:
    """Write a random-weight llama GGUF at `path`; returns the path.

    quant: the type of the 2-D weights; under Q4_1 the embedding is Q8_0, as in SmolLM2's Q4_1 file, so both
    dequantizers run. Norms stay F32, as llama.cpp writes them. tied: no output.weight (the embedding is the head).
    arch, tokenizer_model: the `general.architecture` and `tokenizer.ggml.model`, so a test can write a file
    transformers cannot load. std is larger than an init's so greedy argmaxes have clear margins."""
    path = Path(path)
    tokens, types, merges = tiny_vocab()
    vocab, head_dim = len(tokens), hidden // heads
    rng = np.random.default_rng(seed)
    qtype = gguf.GGMLQuantizationType[quant]
    embed_qtype = gguf.GGMLQuantizationType.Q8_0 if quant == "Q4_1" else qtype

    w = gguf.GGUFWriter(path, arch)
    w.add_name("tiny-llama")
    w.add_file_type({"F32": gguf.LlamaFileType.ALL_F32, "Q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
                     "Q4_1": gguf.LlamaFileType.MOSTLY_Q4_1}[quant])  # fmt: skip
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    w.add_context_length(512)
    w.add_embedding_length(hidden)
    w.add_block_count(layers)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(vocab)
    w.add_tokenizer_model(tokenizer_model)
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_pad_token_id(2)
    w.add_add_bos_token(False)
    w.add_add_space_prefix(False)
    w.add_chat_template(chat_template)

    def matrix(name: str, rows: int, cols: int, t: gguf.GGMLQuantizationType = qtype) -> None:
        data = (rng.standard_normal((rows, cols)) * std).astype(np.float32)
        if ".attn_q." in name:
            data = _llama_cpp_permute(data, heads)
        elif ".attn_k." in name:
            data = _llama_cpp_permute(data, kv_heads)
        if t == gguf.GGMLQuantizationType.F32:
            w.add_tensor(name, data)
        else:
            w.add_tensor(name, gguf.quants.quantize(data, t), raw_dtype=t)

    def norm(name: str) -> None:
        w.add_tensor(name, (1.0 + 0.1 * rng.standard_normal(hidden)).astype(np.float32))

    matrix("token_embd.weight", vocab, hidden, embed_qtype)
    for i in range(layers):
        norm(f"blk.{i}.attn_norm.weight")
        matrix(f"blk.{i}.attn_q.weight", hidden, hidden)
        matrix(f"blk.{i}.attn_k.weight", kv_heads * head_dim, hidden)
        matrix(f"blk.{i}.attn_v.weight", kv_heads * head_dim, hidden)
        matrix(f"blk.{i}.attn_output.weight", hidden, hidden)
        norm(f"blk.{i}.ffn_norm.weight")
        matrix(f"blk.{i}.ffn_gate.weight", ffn, hidden)
        matrix(f"blk.{i}.ffn_up.weight", ffn, hidden)
        matrix(f"blk.{i}.ffn_down.weight", hidden, ffn)
    norm("output_norm.weight")
    if not tied:
        matrix("output.weight", vocab, hidden)

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
