"""The seed's whole-model helpers: cpu_offload, cpu_offload_with_hook (chained), disk_offload."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from torch import nn

import bigviz
from bigviz.engine.big_modeling import cpu_offload, cpu_offload_with_hook, disk_offload
from bigviz.engine.hooks import remove_hooks
from bigviz.engine.offload_hooks import CpuOffload
from bigviz.models import GPT, GPTConfig


@pytest.fixture
def gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig.preset("gpt-mini")).eval()


def ids(model: GPT) -> torch.Tensor:
    return torch.randint(0, model.config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(3))


def test_seed_pipeline_chain_offloads_the_previous_model(monkeypatch: pytest.MonkeyPatch):
    torch.manual_seed(0)
    model_1, model_2, model_3 = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)
    reference = [copy.deepcopy(m) for m in (model_1, model_2, model_3)]
    moves: list[tuple[int, str]] = []
    for i, m in enumerate((model_1, model_2, model_3)):
        original = m.to
        monkeypatch.setattr(m, "to", lambda device, _o=original, _i=i: moves.append((_i, str(device))) or _o(device))
    device = "cpu"
    model_1, hook_1 = cpu_offload_with_hook(model_1, device)
    model_2, hook_2 = cpu_offload_with_hook(model_2, device, prev_module_hook=hook_1)
    model_3, hook_3 = cpu_offload_with_hook(model_3, device, prev_module_hook=hook_2)

    x = torch.randn(2, 4)
    hid_1 = model_1(x)
    assert hook_1.hook.on_device and not hook_2.hook.on_device
    for _ in range(5):
        # model 1 is offloaded at the first iteration; model 2 stays on the device
        hid_2 = model_2(hid_1)
        assert not hook_1.hook.on_device and hook_2.hook.on_device
    assert hook_2.hook.calls == 5
    hid_3 = model_3(hid_2)  # model 2 is offloaded just before this forward
    assert not hook_2.hook.on_device and hook_3.hook.on_device
    hook_3.offload()  # the last one by hand
    assert not hook_3.hook.on_device
    expected = reference[2](reference[1](reference[0](x)))
    assert torch.equal(hid_3, expected)
    assert moves.count((1, "cpu")) >= 2 and (2, "cpu") in moves  # offload() really moved them


def test_cpu_offload_hook_remove_leaves_a_plain_model():
    model, hook = cpu_offload_with_hook(nn.Linear(2, 2), "cpu")
    assert isinstance(model._hf_hook, CpuOffload)
    hook.remove()
    assert not hasattr(model, "_hf_hook") and "forward" not in model.__dict__


def test_cpu_offload_on_the_cpu_runs_unchanged(gpt: GPT):
    idx = ids(gpt)
    with torch.no_grad():
        expected, _ = gpt(idx)
    model = cpu_offload(copy.deepcopy(gpt), "cpu")
    with torch.no_grad():
        assert torch.equal(model(idx)[0], expected)
    assert hasattr(model, "_hf_hook")  # hooked (outputs come back to the input's device)
    remove_hooks(model)
    assert not hasattr(model, "_hf_hook")


def test_disk_offload_streams_blocks_and_writes_once(gpt: GPT, tmp_path: Path):
    idx = ids(gpt)
    with torch.no_grad():
        expected, _ = gpt(idx)
    tokens = gpt.generate(idx[:1], 5)
    model = disk_offload(copy.deepcopy(gpt), tmp_path / "off", "cpu")
    units = [u.name for u in model._bigviz_dispatch.units]
    assert units[:3] == ["transformer.wte", "transformer.wpe", "transformer.h.0"]  # blocks whole
    assert all(p.is_meta for p in model.parameters())
    written = {p.name: p.stat().st_mtime_ns for p in (tmp_path / "off").iterdir()}
    assert any(name.endswith(".safetensors") for name in written)
    with torch.no_grad():
        assert torch.equal(model(idx)[0], expected)
    assert torch.equal(model.generate(idx[:1], 5), tokens)
    assert {p.name: p.stat().st_mtime_ns for p in (tmp_path / "off").iterdir()} == written  # no rewrites


def test_disk_offload_of_a_meta_model_reads_an_existing_folder(gpt: GPT, tmp_path: Path):
    idx = ids(gpt)
    with torch.no_grad():
        expected, _ = gpt(idx)
    remove_hooks(disk_offload(copy.deepcopy(gpt), tmp_path / "off"))
    with bigviz.init_empty_weights():
        model = GPT(gpt.config)
    disk_offload(model, tmp_path / "off")
    with torch.no_grad():
        assert torch.equal(model(idx)[0], expected)


def test_disk_offload_without_blocks_uses_one_unit_per_module(tmp_path: Path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    x = torch.randn(3, 4)
    expected = model(x)
    disk_offload(model, tmp_path)
    assert [u.name for u in model._bigviz_dispatch.units] == ["0", "2"]
    with torch.no_grad():
        assert torch.equal(model(x), expected)
