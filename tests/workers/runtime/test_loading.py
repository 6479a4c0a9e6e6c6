import json

import pytest
import torch

from specserve.workers.config.settings import ModelConfig
from specserve.workers.errors import ModelLoadError
from specserve.workers.runtime.loading import check_compatible, load_model
from specserve.workers.speculation.engine import SpecEngine


def test_loads_local_model_in_eval_mode_without_grad(tiny_target):
    loaded = load_model(ModelConfig(path=tiny_target, device="cpu", dtype="float32"))
    assert not loaded.model.training
    assert all(not p.requires_grad for p in loaded.model.parameters())
    assert loaded.dtype == torch.float32 and loaded.device.type == "cpu"
    assert loaded.eos_token_ids == {loaded.tokenizer.eos_token_id}
    assert loaded.max_positions == 512


def test_bfloat16_dtype_is_applied(tiny_target):
    loaded = load_model(ModelConfig(path=tiny_target, device="cpu", dtype="bfloat16"))
    assert next(loaded.model.parameters()).dtype == torch.bfloat16
    assert loaded.kv_bytes_per_token == load_model(ModelConfig(path=tiny_target, device="cpu")).kv_bytes_per_token // 2


def test_missing_path_is_a_clear_error(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_model(ModelConfig(path=str(tmp_path / "nope")))


def test_directory_without_model_is_a_clear_error(tmp_path):
    with pytest.raises(ModelLoadError, match="not a Hugging Face model directory"):
        load_model(ModelConfig(path=str(tmp_path)))


def test_non_causal_lm_is_a_clear_error(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "vit", "hidden_size": 32}))
    with pytest.raises(ModelLoadError, match="'vit' model, which is not a causal LM"):
        load_model(ModelConfig(path=str(tmp_path)))


def test_incompatible_tokenizers_are_refused(tiny_target, tiny_vocab_target):
    target = load_model(ModelConfig(path=tiny_target))
    draft = load_model(ModelConfig(path=tiny_vocab_target))
    with pytest.raises(ModelLoadError, match="incompatible tokenizers"):
        check_compatible(target, draft)
    with pytest.raises(ModelLoadError, match="incompatible tokenizers"):
        SpecEngine(target, draft)


def test_padded_draft_vocabulary_is_compatible(tiny_target, tiny_draft):
    target, draft = load_model(ModelConfig(path=tiny_target)), load_model(ModelConfig(path=tiny_draft))
    assert draft.vocab_size == target.vocab_size + 5
    check_compatible(target, draft)


def test_cuda_request_without_cuda_is_a_clear_error(tiny_target):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA; the error path cannot occur")
    with pytest.raises(ModelLoadError, match="no CUDA device"):
        load_model(ModelConfig(path=tiny_target, device="cuda"))
