"""Promise: every loader's ``dtype=`` takes a floating dtype (a ``torch.dtype`` or its name) and
refuses anything else before a byte is read or written, quoting the value: ``torch.int8`` (a
cast would turn the weights into integers, a layer of small weights into zeros), ``torch.bool``,
``"float17"``, ``3``, a dtype torch cannot hold (``"float4_e2m1"``), a floating dtype that
cannot hold a weight (``float8_e8m0fnu``, unsigned powers of two: every weight lost its sign; the
packed ``float4_e2m1fn_x2``: torch's raw ``NotImplementedError`` half-way). Planning in ``int8``
stays a what-if."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

import bigviz
from bigviz.checkpoint.lazy import LazyWeights
from bigviz.models import GPT, GPTConfig

from tests.hostile.helpers import assert_same_state, model_state, snapshot

BAD = [torch.int8, torch.int64, torch.bool, torch.uint8, "int8", "float17", "torch.float17", 3, 2.5, True, "", "F4",
       torch.float8_e8m0fnu, "F8_E8M0", torch.float4_e2m1fn_x2, torch.complex64]  # fmt: skip
DEVICE_MAP = {"transformer.wte": "cpu", "transformer.wpe": "cpu", "transformer.h": "disk",
              "transformer.ln_f": "cpu", "lm_head": "cpu"}  # fmt: skip


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("dtypes")
    torch.manual_seed(0)
    model = GPT(GPTConfig.preset("gpt-tiny"))
    return {
        "safetensors": bigviz.save_sharded(model, root / "st", max_shard_size="30KB", progress=False),
        "bin": bigviz.save_sharded(model, root / "bin", safe_serialization=False, progress=False),
    }


def _meta() -> GPT:
    with bigviz.init_empty_weights():
        return GPT(GPTConfig.preset("gpt-tiny"))


LOADERS: dict[str, Callable[..., object]] = {
    "load_checkpoint_in_model": lambda model, folder, dtype, off: bigviz.load_checkpoint_in_model(
        model, folder, DEVICE_MAP, dtype=dtype, offload_folder=off, progress=False
    ),
    "load_checkpoint_and_dispatch": lambda model, folder, dtype, off: bigviz.load_checkpoint_and_dispatch(
        model, folder, DEVICE_MAP, dtype=dtype, offload_folder=off
    ),
    "load_checkpoint_and_dispatch(auto)": lambda model, folder, dtype, off: bigviz.load_checkpoint_and_dispatch(
        model, folder, "auto", max_memory={"cpu": "40KB"}, dtype=dtype, offload_folder=off
    ),
    "load_plan": lambda model, folder, dtype, off: bigviz.load_plan(model, folder, DEVICE_MAP, dtype=dtype),
    "dispatch_plan": lambda model, folder, dtype, off: bigviz.dispatch_plan(model, folder, DEVICE_MAP, dtype=dtype),
    "LazyWeights": lambda model, folder, dtype, off: LazyWeights(folder, dtype=dtype),
}


@pytest.mark.parametrize("fmt", ["safetensors", "bin"])
@pytest.mark.parametrize("loader", list(LOADERS))
def test_a_dtype_that_is_not_floating_is_refused_quoting_it(checkpoints, tmp_path: Path, loader: str, fmt: str):
    folder = checkpoints[fmt]
    files = snapshot(folder)
    for dtype in BAD:
        model = _meta()
        with pytest.raises(ValueError) as err:
            LOADERS[loader](model, folder, dtype, tmp_path / "off")
        message = str(err.value)
        assert f"dtype={dtype!r}" in message, (dtype, message)
        assert "float16" in message  # what to give instead
        assert all(p.is_meta for p in model.parameters()) and not hasattr(model, "_hf_hook")
        assert not (tmp_path / "off").exists()  # nothing written
    assert snapshot(folder) == files


def test_a_materialised_model_keeps_its_values(checkpoints):
    torch.manual_seed(3)
    model = GPT(GPTConfig.preset("gpt-tiny"))
    before = model_state(model)
    for dtype in (torch.int8, "float17", 3):
        with pytest.raises(ValueError, match="dtype="):
            bigviz.load_checkpoint_in_model(model, checkpoints["safetensors"], dtype=dtype, progress=False)
    assert_same_state(model, before)


@pytest.mark.parametrize("dtype", [torch.float16, "bfloat16", "torch.float16", "fp16", "bf16", np.dtype("float16")])
def test_floating_dtypes_by_any_name_load(checkpoints, dtype: object):
    model = bigviz.load_checkpoint_and_dispatch(_meta(), checkpoints["safetensors"], DEVICE_MAP, dtype=dtype)
    want = {"float16": torch.float16, "fp16": torch.float16}.get(str(dtype).removeprefix("torch."), torch.bfloat16)
    assert model.transformer.wte.weight.dtype == want
    with torch.no_grad():
        assert model(torch.zeros(1, 3, dtype=torch.long))[0].isfinite().all()


def test_planning_in_int8_is_still_a_what_if():
    plan = bigviz.plan(_meta(), {"cpu": "1GB"}, dtype=torch.int8)
    assert plan.usage  # sized, nothing loaded
