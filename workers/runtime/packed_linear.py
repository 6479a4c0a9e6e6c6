"""Linear layers on oneDNN's prepacked weights, for float32 models on a CPU.

PyTorch's default CPU kernel for `F.linear` (MKL's sgemm) is fast for one row and slow for a few: on a 2-core AMD
EPYC, SmolLM2-135M's forward over 2, 5 and 9 new positions costs 1.4x, 1.5x and 1.8x a one-position step. Decoding
runs one-row products and verification runs few-row ones, so that curve is what speculation pays. oneDNN's kernels on
weights reordered once into its blocked layout (the op Inductor's CPU backend uses) cost 1.1x, 1.3x and 1.5x, and
the one-position step itself gets ~20% faster (the 49K-row lm_head twice as fast).

`pack_linears` swaps a model's nn.Linear modules for `PackedLinear` in place, after checking on this machine that
the op exists and agrees with `F.linear`; where it does not, the model keeps its modules. Inference only: the packed
op has no backward. Every path of a model runs through the same modules, so target-only decoding and verification
keep computing with the same kernels.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger(__name__)


class PackedLinear(nn.Module):
    """nn.Linear's forward over a weight in oneDNN's blocked layout. `weight`: the original parameter, kept where the
    caller needs it (an lm_head tied to the input embedding, a head's layers that other code reads), else None."""

    def __init__(self, linear: nn.Linear, keep_weight: bool):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), None)  # not a parameter
        self.bias = linear.bias
        self.weight = linear.weight if keep_weight else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        out = torch.ops.mkldnn._linear_pointwise(rows, self.packed, self.bias, "none", [], "")
        return out.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def packing_works(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether packed linears run here and agree with F.linear (float32 on a CPU with oneDNN only)."""
    if device.type != "cpu" or dtype != torch.float32 or not torch.backends.mkldnn.is_available():
        return False
    generator = torch.Generator().manual_seed(0)
    linear = nn.Linear(96, 80, bias=True)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(80, 96, generator=generator))
        linear.bias.copy_(torch.randn(80, generator=generator))
        x = torch.randn(2, 5, 96, generator=generator)
        try:
            got = PackedLinear(linear, keep_weight=False)(x)
        except (RuntimeError, AttributeError) as e:  # no mkldnn ops in this build
            log.info("linear layers keep PyTorch's kernels: oneDNN's packed op is unavailable (%s)", e)
            return False
        return torch.allclose(got, F.linear(x, linear.weight, linear.bias), rtol=1e-4, atol=1e-4)


def pack_linears(model: nn.Module, keep_weight: Callable[[str, nn.Linear], bool] = lambda name, m: True) -> int:
    """Swap every nn.Linear of `model` (on a CPU, float32) for a PackedLinear, in place; returns how many. A layer
    whose name `keep_weight(name, layer)` refuses drops its original weight (its memory is then the packed copy's
    only). Nothing is swapped where packing does not work here."""
    params = next(model.parameters(), None)
    if params is None or not packing_works(params.device, params.dtype):
        return 0
    swapped = 0
    with torch.no_grad():
        for parent_name, parent in list(model.named_modules()):
            for name, child in list(parent.named_children()):
                if type(child) is nn.Linear:
                    full = f"{parent_name}.{name}" if parent_name else name
                    setattr(parent, name, PackedLinear(child, keep_weight(full, child)))
                    swapped += 1
    return swapped
