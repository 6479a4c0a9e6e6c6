import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, Qwen2Config, Qwen2ForCausalLM

from specserve.workers.config.settings import KVCacheConfig, ModelConfig
from specserve.workers.runtime.lean_forward import _agrees, _lean, full_forward, lean_forward
from specserve.workers.runtime.loading import load_model
from specserve.workers.runtime.ragged import single_row_mask
from specserve.workers.runtime.runner import ForwardRow, ModelRunner


@pytest.fixture(scope="module")
def target(tiny_target):
    return load_model(ModelConfig(path=tiny_target, device="cpu"))


def _qwen2() -> Qwen2ForCausalLM:
    torch.manual_seed(3)
    config = Qwen2Config(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)  # fmt: skip
    return Qwen2ForCausalLM(config).eval()


def _runner_pair(loaded) -> tuple[ModelRunner, ModelRunner]:
    lean, full = ModelRunner(loaded, KVCacheConfig()), ModelRunner(loaded, KVCacheConfig())
    full._forward = full_forward(loaded.model)
    return lean, full


def test_lean_path_is_taken_for_llama(target):
    assert ModelRunner(target, KVCacheConfig()).lean


def test_runner_logits_are_identical_with_and_without_the_lean_path(target):
    lean, full = _runner_pair(target)
    assert lean.lean
    steps = [
        [ForwardRow("a", list(range(3, 30)), 1)],  # prefill
        [ForwardRow("a", list(range(3, 30)) + [40, 41, 42], 4)],  # verify 3 drafted tokens
        [ForwardRow("a", list(range(3, 30)) + [40, 50], 2), ForwardRow("b", list(range(60, 70)), 3)],  # ragged batch
        [ForwardRow("b", list(range(60, 71)), 1), ForwardRow("a", list(range(3, 30)) + [40, 50, 51], 1)],  # decode
    ]
    for rows in steps:
        for got, want in zip(lean.logits_for_batch(rows), full.logits_for_batch(rows), strict=True):
            assert torch.equal(got, want)


def test_other_llama_shaped_architectures_take_it():
    model = _qwen2()
    forward = lean_forward(model)
    assert forward is not None
    ids = torch.tensor([[5, 9, 2, 7]])
    positions = torch.arange(4).unsqueeze(0)
    mask = single_row_mask(0, 4, model.dtype, "cpu")
    with torch.inference_mode():
        want = model(
            input_ids=ids, position_ids=positions, attention_mask=mask, use_cache=False, logits_to_keep=2
        ).logits
        assert torch.equal(forward(ids, positions, mask, None, 2), want)


def test_other_architectures_keep_the_full_forward():
    model = GPT2LMHeadModel(GPT2Config(vocab_size=50, n_embd=16, n_layer=1, n_head=2, n_positions=64)).eval()
    assert lean_forward(model) is None


def test_a_hook_on_a_skipped_module_keeps_the_full_forward():
    model = _qwen2()
    handle = model.model.register_forward_hook(lambda module, args, out: out)
    assert lean_forward(model) is None
    handle.remove()
    assert lean_forward(model) is not None


def test_the_probe_rejects_a_path_that_differs():
    model = _qwen2()
    lean = _lean(model)  # runs both layers
    assert _agrees(model, lean)
    model.config.num_hidden_layers = 1  # the model's own forward now runs only the first
    assert not _agrees(model, lean)
