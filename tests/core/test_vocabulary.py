"""One vocabulary: devices, dtypes and errors, each defined once in bigviz.core (no torch)."""

from __future__ import annotations

import pytest

from bigviz.core.devices import (
    device_label,
    device_sort_key,
    execution_device,
    missing_device_problems,
    normalize_device,
    streamed_devices,
    torch_name,
)
from bigviz.core.dtypes import (
    FLOATING_DTYPES,
    SAFETENSORS_CODES,
    canonical_dtype,
    from_safetensors,
    is_floating,
    itemsize,
    tensor_nbytes,
    to_safetensors,
)
from bigviz.core.errors import MAX_LINES, BigvizError, DeviceMapError, PlanError, format_problems
from bigviz.core.tree import SizeTree, TensorSpec


@pytest.mark.parametrize("spelling", [0, "0", "cuda", "cuda:0", " cuda:0 "])
def test_every_spelling_of_gpu_0_is_one_device(spelling):
    assert normalize_device(spelling) == 0
    assert torch_name(spelling) == "cuda:0" and device_label(normalize_device(spelling)) == "GPU 0"


@pytest.mark.parametrize(
    "devices, expected",
    [
        (["cpu", "disk"], "cpu"),
        (["disk", "mps", "cpu"], "mps"),
        (["mps", 3, "cuda:1", "cpu"], 1),  # GPUs win over mps, the lowest index first
        (["cpu", "gpu", 2], 2),  # a value naming no device is left to the map's checks
        ([], "cpu"),
    ],
)
def test_one_rule_for_the_execution_device(devices, expected):
    assert execution_device(devices) == expected


def test_streamed_devices_follow_the_execution_device():
    assert streamed_devices("cpu") == ("disk",)
    assert streamed_devices(0) == streamed_devices("mps") == ("cpu", "disk")
    assert sorted(["disk", "cpu", "mps", 2, 0], key=device_sort_key) == [0, 2, "mps", "cpu", "disk"]


def test_missing_devices_grouped_with_their_modules_and_what_exists():
    problems = missing_device_problems(
        {"a": 2, "b": "cuda:2", "c": "mps", "d": "disk", "e": "cpu", "f": "?"},
        [0, "cpu", "disk"],
        main_device="cuda:5",
        cuda_count=1,
    )
    assert len(problems) == 3  # GPU 2 (a, b), GPU 5 (main_device), MPS (c); disk always exists
    assert problems[0].startswith("device map names GPU 2 (a, b), which this machine does not have (cuda:2")
    assert "GPU 5 (main_device)" in problems[1] and "MPS (c)" in problems[2]
    assert all("available: GPU 0, CPU, disk" in p and "torch sees 1 CUDA GPU)" in p for p in problems)


@pytest.mark.parametrize(
    "code, name, nbytes_of_6",
    [
        ("F8_E8M0", "float8_e8m0fnu", 6),
        ("F8_E4M3", "float8_e4m3fn", 6),
        ("F8_E5M2", "float8_e5m2", 6),
        ("BF16", "bfloat16", 12),
        ("I4", "int4", 3),
        ("U4", "uint4", 3),
        ("F4", "float4_e2m1", 3),
        ("F6_E2M3", "float6_e2m3", 5),
        ("BOOL", "bool", 6),
        ("C64", "complex64", 48),
    ],
)
def test_one_dtype_table_for_safetensors_codes_and_torch_names(code, name, nbytes_of_6):
    assert from_safetensors(code) == name == canonical_dtype(code) == canonical_dtype(f"torch.{name}")
    assert to_safetensors(name) == code
    assert tensor_nbytes(code, 6) == nbytes_of_6


def test_dtype_table_sizes_and_floating():
    assert itemsize("fp16") == 2 and itemsize("int4") == 0.5 and tensor_nbytes("int4", 5) == 3  # packed, rounded up
    assert is_floating("F8_E8M0") and not is_floating("I8") and "float8_e8m0fnu" in FLOATING_DTYPES
    assert all(canonical_dtype(c) == d.name for c, d in SAFETENSORS_CODES.items())
    with pytest.raises(ValueError, match="unknown dtype 'float7'"):
        canonical_dtype("float7")


def test_a_tree_of_every_safetensors_dtype_can_be_sized_and_resized():
    specs = [TensorSpec(f"m.{code.lower()}", 6, canonical_dtype(code)) for code in SAFETENSORS_CODES]
    tree = SizeTree.build(specs)
    assert tree.total("") == sum(tensor_nbytes(code, 6) for code in SAFETENSORS_CODES)
    halved = tree.with_dtype("float16")  # floating tensors become 2 bytes each, integers keep theirs
    assert halved.tensors["m.f8_e8m0"].dtype == "float16" and halved.tensors["m.i4"].dtype == "int4"


def test_one_error_type_formats_every_problem_once():
    err = DeviceMapError("invalid device_map", [f"p{i}" for i in range(MAX_LINES + 3)], fix="Fix: it")
    text = str(err)
    assert text.startswith(f"invalid device_map ({MAX_LINES + 3} problems):\n  - p0\n")
    assert "  ... and 3 more (see err.problems)\nFix: it" in text and len(err.problems) == MAX_LINES + 3
    assert isinstance(err, ValueError) and isinstance(err, BigvizError)
    one = PlanError("the model does not fit")
    assert str(one) == "the model does not fit" and one.problems == ["the model does not fit"]
    assert format_problems("h", ["a"]) == "h (1 problem):\n  - a"
    PlanError.check([], "nothing wrong")  # no problems: no error
