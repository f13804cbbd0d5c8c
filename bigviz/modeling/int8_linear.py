"""int8 weight-only linear layers that run on torch's packed CPU kernel, in bfloat16.

A torchao ``Int8Tensor`` weight (``quantization="int8"``, or a checkpoint transformers stored
with ``TorchAoConfig(Int8WeightOnlyConfig())``) runs through torchao's ``F.linear`` override,
which on a CPU converts the whole int8 weight to the activation dtype at every call and then
multiplies: it writes the widened weight and reads it again, so int8 is slower than the float
model it replaces. torch ships the kernel made for this case, ``torch._weight_int8pack_mm``
(gpt-fast's int8 path: each row of int8 values is read once, widened in registers, scaled
after the dot product), and none of the libraries bigviz uses calls it for torchao's current
``Int8Tensor``: that is the reason for this module. Its bfloat16 path is the fast one; in
float32 and float16 it is slower than torchao's own (measured on this 2-core AVX-512 CPU, one
``24576 x 6144`` layer, 1 token / 16 tokens: float32 weights 33 / 143 ms, bfloat16 weights
17 / 29 ms, torchao int8 in bfloat16 106 / 122 ms, this kernel in bfloat16 6.3 / 39 ms, in
float32 63 / 1411 ms).

:class:`Int8Linear` is ``nn.Linear`` with one change: when its weight is a per-row, weight-only
``Int8Tensor`` (no activation quantization, one scale per output row, zero points all zero:
what ``Int8WeightOnlyConfig`` makes) and the input is a bfloat16 CPU tensor whose rows are a
multiple of 16 values (torch's kernel crashes on others), ``forward`` calls that kernel with
the weight's own ``qdata`` and ``scale`` (an operand that does not start on
:data:`KERNEL_ALIGN` bytes, as a weight read in place from a file may not, is copied first: the
kernel crashes on it). Anything else (float32 inputs: load with ``dtype=torch.bfloat16`` for the
fast path; another device, another format, a float weight) goes to ``F.linear`` as before, bit
for bit. The weights and their bytes are torchao's,
unchanged: saving, offloading and streaming them is untouched, and a model made this way
still loads in transformers. Only the order of the additions differs from torchao's path:
outputs agree to bfloat16 rounding (tested), not bit for bit.

Example:
    >>> import torch
    >>> from bigviz.core.quant import QuantConfig
    >>> from bigviz.modeling.quant import quantize_weight
    >>> layer = Int8Linear(32, 8, bias=False, dtype=torch.bfloat16)
    >>> weight = quantize_weight(torch.randn(8, 32, dtype=torch.bfloat16), QuantConfig("int8"))
    >>> layer.weight = torch.nn.Parameter(weight, requires_grad=False)
    >>> x = torch.randn(3, 32, dtype=torch.bfloat16)
    >>> runs_packed(layer.weight, x), runs_packed(layer.weight, x.float())
    (True, False)
    >>> reference = torch.nn.functional.linear(x, layer.weight)  # torchao's path
    >>> bool((layer(x) - reference).abs().max() <= 0.02 * reference.abs().max())
    True
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor, nn
from torch.nn import functional as F

__all__ = ["Int8Linear", "runs_packed", "use_int8_kernel"]


def runs_packed(weight: object, x: Tensor) -> bool:
    """True when ``weight`` is a per-row weight-only torchao ``Int8Tensor`` and ``x`` a bfloat16
    CPU tensor with rows of 16k values: the case :class:`Int8Linear` runs on
    ``torch._weight_int8pack_mm``."""
    if type(weight).__name__ != "Int8Tensor" or x.device.type != "cpu" or x.dtype != torch.bfloat16:
        return False
    qdata, scale = getattr(weight, "qdata", None), getattr(weight, "scale", None)
    if not isinstance(qdata, Tensor) or not isinstance(scale, Tensor) or qdata.dim() != 2:
        return False
    if qdata.device.type != "cpu" or qdata.dtype != torch.int8 or scale.numel() != qdata.shape[0]:
        return False
    if any(getattr(weight, a, None) is not None for a in ("act_quant_kwargs", "act_pre_scale")):
        return False
    if list(getattr(weight, "block_size", ())) != [1, qdata.shape[1]]:
        return False
    if qdata.shape[1] % 16:
        return False  # torch's bfloat16 kernel crashes for rows not a multiple of 16 (torch 2.13, this CPU)
    zero = getattr(weight, "zero_point", None)
    return zero is None or not bool(zero.any())


KERNEL_ALIGN = 64
"""Bytes the kernel's operands start on: torch's kernel crashes on an input that is not
32-byte aligned or int8 values not 16-byte aligned (torch 2.13, this CPU); a weight read in
place from a file can start anywhere, so an operand off this boundary is copied first (torch's
own allocations are aligned to it)."""


def _aligned(t: Tensor) -> Tensor:
    if t.is_contiguous() and t.data_ptr() % KERNEL_ALIGN == 0:
        return t
    return torch.empty(t.shape, dtype=t.dtype).copy_(t)


class Int8Linear(nn.Linear):
    """``nn.Linear`` whose torchao int8 weight-only weight runs on ``torch._weight_int8pack_mm``
    for bfloat16 inputs on a CPU (see the module's docstring); the same parameters and state
    dict as ``nn.Linear``."""

    def forward(self, input: Tensor) -> Tensor:
        weight = self.weight
        if not runs_packed(weight, input):
            return F.linear(input, weight, self.bias)
        qdata = _aligned(weight.qdata)  # (out, in) int8
        scale = weight.scale.reshape(-1).to(input.dtype)
        flat = _aligned(input.reshape(-1, input.shape[-1]))
        out = torch._weight_int8pack_mm(flat, qdata, scale)
        if self.bias is not None:
            out = out + self.bias.to(out.dtype)
        return out.reshape(*input.shape[:-1], qdata.shape[0])


def use_int8_kernel(model: nn.Module, modules: Iterable[str]) -> list[str]:
    """Make the ``nn.Linear`` layers named in ``modules`` :class:`Int8Linear` (their class
    changes; parameters, buffers, hooks and state dict stay); returns the names changed.

    Example:
        >>> model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
        >>> use_int8_kernel(model, ["0", "1"])  # "1" is not a linear layer: left alone
        ['0']
        >>> type(model[0]).__name__
        'Int8Linear'
    """
    changed = []
    for name in modules:
        module = model.get_submodule(name)
        if type(module) is nn.Linear:
            module.__class__ = Int8Linear
            changed.append(name)
    return changed
