"""Quantized weights sized in the plan (pure, no torch): bytes per format, which weights,
which checkpoint keys carry a quantization role, which stored formats run here."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from bigviz.core.planner import make_plan
from bigviz.core.quant import (
    QuantConfig,
    as_quant_config,
    default_targets,
    packed_nbytes,
    prequantized_format,
    quantization_role_keys,
    quantized_tree,
    with_stored,
)
from bigviz.core.tree import SizeTree, TensorSpec


def test_int8_is_one_byte_a_value_plus_a_float32_scale_and_an_int8_zero_point_per_row() -> None:
    # torchao Int8Tensor: qdata [out, in] int8, scale [out, 1] float32, zero_point [out, 1] int8
    assert packed_nbytes(QuantConfig("int8"), (64, 64)) == 64 * 64 + 64 * 4 + 64
    assert packed_nbytes(QuantConfig("int8"), (5120, 1280)) == 5120 * 1280 + 5120 * 5


def test_int4_is_half_a_byte_a_value_plus_a_float32_absmax_per_64_and_the_code() -> None:
    # bitsandbytes Params4bit: data [n/2, 1] uint8, absmax [n/64] float32, code [16] float32
    assert packed_nbytes(QuantConfig("int4"), (64, 64)) == 2048 + 64 * 4 + 64
    assert packed_nbytes(QuantConfig("int4", quant_type="fp4"), (3, 7)) == 11 + 4 + 64  # rounded up


@given(st.integers(1, 4096), st.integers(1, 4096))
def test_packed_sizes_are_a_quarter_and_an_eighth_of_float32_plus_their_scales(rows: int, cols: int) -> None:
    fp32 = rows * cols * 4
    int8, int4 = packed_nbytes(QuantConfig("int8"), (rows, cols)), packed_nbytes(QuantConfig("int4"), (rows, cols))
    assert int8 == fp32 // 4 + 5 * rows
    assert rows * cols / 2 <= int4 <= rows * cols / 2 + 1 + 4 * (rows * cols / 64 + 1) + 64


def _tree() -> SizeTree:
    specs = [
        TensorSpec("wte.weight", 32 * 16, "float32", (32, 16)),
        TensorSpec("h.0.fc.weight", 64 * 16, "float32", (64, 16)),
        TensorSpec("h.0.fc.bias", 64, "float32", (64,)),
        TensorSpec("h.0.proj.weight", 16 * 64, "float32", (16, 64)),
        TensorSpec("h.1.fc.weight", 64 * 16, "float32", (64, 16)),
        TensorSpec("h.1.proj.weight", 16 * 64, "float32", (16, 64)),
        TensorSpec("ln_f.weight", 16, "float32", (16,)),
        TensorSpec("lm_head.weight", 32 * 16, "float32", (32, 16)),
    ]
    return SizeTree.build(specs)


def test_a_quantized_tree_sizes_the_targets_packed_and_leaves_the_rest() -> None:
    tree = _tree()
    targets = ["h.0.fc.weight", "h.1.proj.weight"]
    q = quantized_tree(tree, QuantConfig("int8"), targets)
    assert q.tensors["h.0.fc.weight"].nbytes == 64 * 16 + 64 * 5
    assert q.tensors["h.0.fc.weight"].dtype == "float32" and q.tensors["h.0.fc.weight"].quant == "int8"
    assert q.tensors["h.0.proj.weight"].nbytes == 16 * 64 * 4  # not a target
    saved = sum(tree.tensors[t].nbytes - q.tensors[t].nbytes for t in targets)
    assert q.total("") == tree.total("") - saved
    assert q.total("h.0") == tree.total("h.0") - (
        tree.tensors["h.0.fc.weight"].nbytes - q.tensors["h.0.fc.weight"].nbytes
    )


def test_a_quantized_weight_keeps_its_packed_bytes_under_another_compute_dtype() -> None:
    q = with_stored(_tree(), {"h.0.fc.weight": (999, "int8")})
    half = q.with_dtype("bfloat16")
    assert half.tensors["h.0.fc.weight"].nbytes == 999 and half.tensors["h.0.fc.weight"].dtype == "bfloat16"
    assert half.tensors["h.0.proj.weight"].nbytes == 16 * 64 * 2


def test_the_planner_places_quantized_weights_by_their_packed_bytes() -> None:
    tree = _tree()
    q = quantized_tree(tree, QuantConfig("int8"), default_targets(tree, QuantConfig("int8")))
    budget = {"cpu": q.total("") + 10, "disk": 10**12}
    assert make_plan(q, budget).usage_of("disk").used == 0  # fits quantized ...
    assert make_plan(tree, budget).usage_of("disk").used > 0  # ... not in float32


def test_default_targets_skip_embeddings_heads_norms_biases_ties_and_skipped_modules() -> None:
    tree = _tree()
    assert default_targets(tree, QuantConfig("int8")) == [
        "h.0.fc.weight",
        "h.0.proj.weight",
        "h.1.fc.weight",
        "h.1.proj.weight",
    ]
    skip = QuantConfig("int4", modules_to_not_convert=("h.1", "proj"))
    assert default_targets(tree, skip) == ["h.0.fc.weight"]
    tied = SizeTree.build(list(tree.tensors.values()), ties=[("h.0.fc.weight", "h.1.fc.weight")])
    assert "h.0.fc.weight" not in default_targets(tied, QuantConfig("int8"))


def test_a_config_from_a_word_or_an_error_that_says_what_is_taken() -> None:
    assert as_quant_config("int8") == QuantConfig("int8")
    assert as_quant_config(" Int4 ").method == "int4"
    assert as_quant_config(None) is None and as_quant_config("none") is None
    for bad in ("int3", 8, "fp8"):
        with pytest.raises(ValueError, match="'int8', 'int4'"):
            as_quant_config(bad)
    with pytest.raises(ValueError, match="quant_type 'nf3'"):
        QuantConfig("int4", quant_type="nf3")
    with pytest.raises(ValueError, match="method 'int2'"):
        QuantConfig("int2")
    assert "torchao" in QuantConfig("int8").describe() and "nf4" in QuantConfig("int4").describe()


def test_keys_that_carry_a_quantization_role_are_recognised_in_every_layout() -> None:
    keys = [
        "m.layers.0.q._weight_qdata",  # torchao
        "m.layers.0.q._weight_scale",
        "m.layers.0.q._weight_zero_point",
        "m.layers.0.q.SCB",  # bitsandbytes 8-bit
        "m.layers.0.q.weight_format",
        "m.layers.0.q.weight.absmax",  # bitsandbytes 4-bit
        "m.layers.0.q.weight.quant_map",
        "m.layers.0.q.weight.nested_absmax",
        "m.layers.0.q.weight.quant_state.bitsandbytes__nf4",
        "m.layers.0.q.weight_scale_inv",  # FP8 blocks
        "m.layers.0.q.weight_packed",  # compressed-tensors
        "m.layers.0.q.weight_scale",
        "m.layers.0.q.weight_shape",
        "m.layers.0.q.weight_zero_point",
        "m.layers.0.q.input_scale",
        "m.layers.0.q.qweight",  # GPTQ / AWQ
        "m.layers.0.q.qzeros",
        "m.layers.0.q.scales",
        "m.layers.0.q.g_idx",
        "m.layers.0.q.weight._data",  # optimum-quanto
        "m.layers.0.mlp.experts.gate_up_proj_blocks",  # MXFP4
    ]
    plain = ["m.layers.0.q.weight", "m.layers.0.q.bias", "m.norm.weight", "m.layer_scale", "m.embed.weight"]
    assert quantization_role_keys(keys + plain) == keys


def test_stored_formats_bigviz_runs_and_those_it_refuses_saying_what_to_do() -> None:
    for method in ("torchao", "bitsandbytes", "fp8", "mxfp4", "compressed-tensors"):
        assert prequantized_format(method).runs
    assert prequantized_format("compressed-tensors").library == "compressed-tensors"  # named when missing
    for method in ("gptq", "awq", "quanto", "hqq"):
        refused = prequantized_format(method)
        assert not refused.runs and method in refused.how
        assert "quantization='int8'" in refused.how  # what to do instead
