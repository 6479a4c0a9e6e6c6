"""Linear layers on oneDNN's packed weights (workers/runtime/packed_linear.py): the same products as F.linear, swapped
in by load_model for float32 models on a CPU (the output embedding kept whole, the other layers' original weights
dropped), off on request and for other dtypes; a head packed for drafting leaves the caller's head as it was."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from specserve.workers.config.settings import ModelConfig
from specserve.workers.runtime.loading import load_model
from specserve.workers.runtime.packed_linear import PackedLinear, pack_linears, packing_works
from specserve.workers.speculation.eagle.loading import load_eagle_drafter
from tests.helpers.eagle_heads import random_head
from tests.helpers.workers import save_tiny_llama


def _op_exists() -> bool:
    """Whether this torch build has oneDNN's packed linear op at all. Only its absence skips the module: an op that
    runs and computes something else than F.linear fails the tests below (packing_works also answers False then, so
    it must not decide the skip)."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        PackedLinear(nn.Linear(4, 4), keep_weight=False)(torch.randn(1, 4))
    except (RuntimeError, AttributeError):
        return False
    return True


pytestmark = pytest.mark.skipif(not _op_exists(), reason="this torch build has no oneDNN packed linear")


def test_packing_works_here_and_refuses_an_op_that_disagrees(monkeypatch):
    assert packing_works(torch.device("cpu"), torch.float32)
    forward = PackedLinear.forward
    monkeypatch.setattr(PackedLinear, "forward", lambda self, x: forward(self, x) * (1 + 1e-3))
    assert not packing_works(torch.device("cpu"), torch.float32)
    assert pack_linears(nn.Sequential(nn.Linear(4, 4))) == 0  # the model keeps PyTorch's modules


@pytest.mark.parametrize("bias", [True, False])
def test_a_packed_layer_computes_what_f_linear_does(bias):
    linear = nn.Linear(64, 200, bias=bias)
    packed = PackedLinear(linear, keep_weight=False)
    for shape in ((64,), (1, 64), (3, 64), (2, 5, 64), (1, 17, 64)):
        x = torch.randn(*shape)
        torch.testing.assert_close(packed(x), F.linear(x, linear.weight, linear.bias), rtol=1e-5, atol=1e-5)
    assert packed.weight is None and "in_features=64, out_features=200" in repr(packed)


def test_load_model_packs_a_cpu_float32_model_and_keeps_its_output_embedding(tiny_target):
    packed = load_model(ModelConfig(path=tiny_target, device="cpu"))
    plain = load_model(ModelConfig(path=tiny_target, device="cpu", packed_linears=False))
    layers = [m for m in packed.model.modules() if isinstance(m, PackedLinear)]
    assert len(layers) == sum(isinstance(m, nn.Linear) for m in plain.model.modules()) > 0
    assert not any(isinstance(m, nn.Linear) for m in packed.model.modules())
    output = packed.model.get_output_embeddings()
    assert isinstance(output, PackedLinear) and output.weight is not None and packed.vocab_size == plain.vocab_size
    assert all(m.weight is None for m in layers if m is not output)  # their memory is the packed copy's only
    ids = torch.tensor([[1, 5, 9, 13, 2, 7, 30]])
    with torch.no_grad():
        torch.testing.assert_close(packed.model(ids).logits, plain.model(ids).logits, rtol=1e-4, atol=1e-4)
    bf16 = load_model(ModelConfig(path=tiny_target, device="cpu", dtype="bfloat16"))
    assert not any(isinstance(m, PackedLinear) for m in bf16.model.modules())


def test_a_head_in_memory_is_packed_as_a_copy(models_dir):
    path = save_tiny_llama(models_dir / "packed_head_target", seed=4, layers=4, hidden=32)
    target = load_model(ModelConfig(path=path, device="cpu"))
    head = random_head(target.model.config, 64, seed=1, std=0.3)
    drafter = load_eagle_drafter(target, head)
    assert drafter.head is not head and isinstance(drafter.head.lm_head, PackedLinear)
    assert type(head.lm_head) is nn.Linear  # the caller's head stays trainable
    assert pack_linears(nn.Sequential(nn.Linear(4, 4).to(torch.bfloat16))) == 0  # not float32: nothing packed
