"""bigviz's int8 linear layer: torch's packed CPU kernel for torchao's per-row int8 weights in
bfloat16, ``F.linear`` for everything else (real torchao tensors, no mocks)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from bigviz.core.quant import QuantConfig
from bigviz.modeling.int8_linear import Int8Linear, runs_packed, use_int8_kernel

pytest.importorskip("torchao")


def _layer(weight: torch.Tensor, bias: bool = True) -> Int8Linear:
    torch.manual_seed(1)
    layer = Int8Linear(weight.shape[1], weight.shape[0], bias=bias, dtype=weight.dtype).requires_grad_(False)
    layer.weight = nn.Parameter(weight, requires_grad=False)
    return layer


def _int8(out: int = 24, inp: int = 48, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    from bigviz.modeling.quant import quantize_weight

    torch.manual_seed(0)
    return quantize_weight(torch.randn(out, inp, dtype=dtype), QuantConfig("int8"))


def _calls(fn) -> tuple[torch.Tensor, set[str]]:  # type: ignore[no-untyped-def]
    with torch.no_grad(), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        out = fn()
    return out, {e.key for e in prof.key_averages()}


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(7, 48), (2, 3, 48), (1, 48)])
def test_bfloat16_runs_the_packed_kernel_and_agrees_with_torchaos_path(shape: tuple[int, ...], bias: bool) -> None:
    layer = _layer(_int8(), bias=bias)
    x = torch.randn(*shape, dtype=torch.bfloat16)
    assert runs_packed(layer.weight, x)
    y, calls = _calls(lambda: layer(x))
    assert "aten::_weight_int8pack_mm" in calls
    reference = nn.functional.linear(x, layer.weight, layer.bias)  # torchao's override
    assert y.shape == reference.shape == (*shape[:-1], 24) and y.dtype == reference.dtype == torch.bfloat16
    assert float((y - reference).abs().max()) <= 2e-2 * float(reference.abs().max())


def test_anything_else_goes_to_f_linear_bit_for_bit() -> None:
    from torchao.quantization import Int8DynamicActivationInt8WeightConfig, quantize_

    torch.manual_seed(0)
    plain = nn.Linear(48, 24)
    layer = Int8Linear(48, 24)
    layer.load_state_dict(plain.state_dict())
    x = torch.randn(5, 48)
    assert not runs_packed(layer.weight, x)  # a float weight
    assert torch.equal(layer(x), plain(x))
    fp32 = _layer(_int8(dtype=torch.float32), bias=False)  # float32: torchao's path is the faster one
    assert not runs_packed(fp32.weight, x)
    y, calls = _calls(lambda: fp32(x))
    assert "aten::_weight_int8pack_mm" not in calls and torch.equal(y, nn.functional.linear(x, fp32.weight))
    dynamic = nn.Sequential(nn.Linear(48, 24))
    quantize_(dynamic, Int8DynamicActivationInt8WeightConfig())  # int8 activations too: not weight-only
    assert not runs_packed(dynamic[0].weight, x)
    odd = _layer(_int8(inp=40), bias=False)  # torch's bfloat16 kernel needs rows of 16k values
    xb = torch.randn(5, 40, dtype=torch.bfloat16)
    assert not runs_packed(odd.weight, xb)
    assert torch.equal(odd(xb), nn.functional.linear(xb, odd.weight))
    assert not runs_packed(_int8(), torch.randint(0, 4, (5, 48)))


def test_use_int8_kernel_changes_only_linear_layers_and_keeps_their_state() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert use_int8_kernel(model, ["0", "1", "2"]) == ["0", "2"]
    assert [type(m).__name__ for m in model] == ["Int8Linear", "ReLU", "Int8Linear"]
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())
    assert use_int8_kernel(model, ["0"]) == []  # already changed: nothing to do


@pytest.mark.parametrize("offset", [0, 3, 16, 40])
def test_operands_off_the_kernels_alignment_are_copied_first(offset: int) -> None:
    """A weight read in place from a file, an input sliced from a larger tensor: torch's kernel
    crashes on operands that do not start on its alignment; the layer copies them first."""
    weight = _int8()
    qdata = weight.qdata
    block = torch.empty(qdata.numel() + 128, dtype=torch.int8)
    start = (-block.data_ptr()) % 64 + offset
    shifted = block[start : start + qdata.numel()].view_as(qdata).copy_(qdata)
    weight.qdata = shifted
    layer = _layer(weight, bias=False)
    wide = torch.randn(5 * 48 + 64, dtype=torch.bfloat16)
    begin = (-wide.data_ptr() // 2) % 32 + offset
    x = wide[begin : begin + 5 * 48].view(5, 48)
    assert runs_packed(layer.weight, x)
    y, calls = _calls(lambda: layer(x))
    assert "aten::_weight_int8pack_mm" in calls
    reference = nn.functional.linear(x, layer.weight)
    assert float((y - reference).abs().max()) <= 2e-2 * float(reference.abs().max())
