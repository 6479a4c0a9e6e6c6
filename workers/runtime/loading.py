"""Load any Hugging Face causal LM and its tokenizer from a local path (never from a hub)."""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from specserve.workers.config.settings import ModelConfig
from specserve.workers.errors import ModelLoadError
from specserve.workers.runtime.eos import eos_ids
from specserve.workers.runtime.packed_linear import pack_linears

log = logging.getLogger(__name__)
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class LoadedModel:
    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    path: str
    device: torch.device
    dtype: torch.dtype
    enforce_eager: bool = False  # ModelConfig.enforce_eager: no CUDA graphs (runtime/graphs.py)

    @property
    def vocab_size(self) -> int:
        """Rows of the output layer (may exceed the tokenizer's vocabulary when padded)."""
        return int(self.model.get_output_embeddings().weight.shape[0])

    @property
    def max_positions(self) -> int | None:
        cfg = self.model.config
        for name in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
            value = getattr(cfg, name, None)
            if isinstance(value, int) and value > 0:
                return value
        return None

    @property
    def kv_bytes_per_token(self) -> int:
        cfg = self.model.config.get_text_config()
        layers = cfg.num_hidden_layers
        heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        return 2 * layers * heads * head_dim * torch.finfo(self.dtype).bits // 8

    @property
    def eos_token_ids(self) -> set[int]:
        return set(eos_ids(self.tokenizer, getattr(self.model.generation_config, "eos_token_id", None)))


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError("device 'cuda' was requested but torch sees no CUDA device")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[dtype]


def load_model(config: ModelConfig, distributed_config=None) -> LoadedModel:
    """Load a causal LM + tokenizer from `config.path`, in eval mode, on the configured device and dtype.
    distributed_config: a transformers DistributedConfig, to load this rank's tensor-parallel shard."""
    path = os.path.expanduser(config.path)
    if not os.path.isdir(path):
        raise ModelLoadError(f"model path {config.path!r} does not exist or is not a directory")
    try:
        hf_config = AutoConfig.from_pretrained(path, local_files_only=True)
    except Exception as e:  # noqa: BLE001 - transformers raises many kinds; all mean "not a model dir"
        raise ModelLoadError(f"{config.path!r} is not a Hugging Face model directory: {e}") from None
    if hf_config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise ModelLoadError(
            f"{config.path!r} holds a {hf_config.model_type!r} model, which is not a causal LM "
            "(AutoModelForCausalLM has no class for it)"
        )
    device = resolve_device(config.device)
    dtype = resolve_dtype(config.dtype, device)
    start = time.perf_counter()
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as e:  # noqa: BLE001
        raise ModelLoadError(f"no usable tokenizer in {config.path!r}: {e}") from None
    try:
        extra = {} if distributed_config is None else {"distributed_config": distributed_config}
        model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=dtype, **extra)
    except Exception as e:  # noqa: BLE001
        raise ModelLoadError(f"could not load causal LM weights from {config.path!r}: {e}") from None
    model.to(device).eval().requires_grad_(False)
    if device.type == "cpu":
        # transformers' SDPA path copies every layer's keys and values once per query-head group (repeat_kv) unless
        # told that the kernel takes grouped heads, which it assumes only on CUDA without a mask (where a masked GQA
        # falls back to the math kernel). torch's CPU kernel takes them with our masks: a 16-position chunk 2.8K deep
        # into SmolLM2 (9 query heads, 3 key/value heads) spent a quarter of its time in those copies.
        os.environ.setdefault("TRANSFORMERS_SDPA_FORCE_GQA", "1")
    packed = 0
    if config.packed_linears and distributed_config is None:  # a tensor-parallel shard's layers are transformers'
        output = model.get_output_embeddings()  # kept whole: it may be tied to the input embedding
        packed = pack_linears(model, keep_weight=lambda name, layer: layer is output)
    log.info("loaded %s (%s) on %s as %s in %.1f s%s", path, hf_config.model_type, device, dtype,
             time.perf_counter() - start, f", {packed} linear layers packed for oneDNN" if packed else "")  # fmt: skip
    return LoadedModel(model=model, tokenizer=tokenizer, path=path, device=device, dtype=dtype,
                       enforce_eager=config.enforce_eager)  # fmt: skip


def check_compatible(target: LoadedModel, draft: LoadedModel) -> None:
    """A draft can only propose for a target if both speak the same token ids."""
    t_vocab, d_vocab = target.tokenizer.get_vocab(), draft.tokenizer.get_vocab()
    if t_vocab != d_vocab:
        only_t = len(set(t_vocab.items()) - set(d_vocab.items()))
        only_d = len(set(d_vocab.items()) - set(t_vocab.items()))
        raise ModelLoadError(
            f"draft {draft.path!r} and target {target.path!r} have incompatible tokenizers: "
            f"{only_t} token->id entries only in the target's, {only_d} only in the draft's"
        )
    if draft.vocab_size < len(t_vocab) or target.vocab_size < len(t_vocab):
        raise ModelLoadError(
            f"model output layers are smaller than the tokenizer's vocabulary ({len(t_vocab)}): "
            f"target {target.vocab_size}, draft {draft.vocab_size}"
        )
