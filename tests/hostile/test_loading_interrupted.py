"""Promise: a load interrupted midway (Ctrl-C, a read error) leaves the model exactly as it was:
values and objects, into a real model (``load_sharded_checkpoint`` copies in place) as into a
model on meta. The fault is injected at the third tensor (and at every tensor in turn)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import bigviz
from bigviz.checkpoint import loader as load_module
from bigviz.models import GPT, GPTConfig

from tests.hostile.helpers import assert_same_state, model_state


def _gpt(seed: int) -> GPT:
    torch.manual_seed(seed)
    return GPT(GPTConfig.preset("gpt-tiny")).eval()


def _fail_at(monkeypatch: pytest.MonkeyPatch, n: int, error: BaseException) -> list[str]:
    """Make the ``n``-th tensor conversion of a load raise ``error``."""
    seen: list[str] = []
    convert = load_module._convert

    def faulty(tensor: torch.Tensor, load: object) -> torch.Tensor:
        seen.append(load.name)  # type: ignore[attr-defined]
        if len(seen) == n:
            raise error
        return convert(tensor, load)

    monkeypatch.setattr(load_module, "_convert", faulty)
    return seen


@pytest.mark.parametrize("at", [1, 3, 8, 14])
def test_interrupted_load_sharded_checkpoint_rolls_back_values(tmp_path: Path, monkeypatch, at: int):
    folder = bigviz.save_sharded(_gpt(1), tmp_path / "ckpt", max_shard_size="20KB", progress=False)
    model = _gpt(2)
    before = model_state(model)
    objects = {name: (p, p.data_ptr()) for name, p in model.named_parameters()}
    seen = _fail_at(monkeypatch, at, KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt):
        bigviz.load_sharded_checkpoint(model, folder)
    assert len(seen) == at
    assert_same_state(model, before)  # values, not only objects
    for name, p in model.named_parameters():  # the same objects, on the same memory
        assert p is objects[name][0] and p.data_ptr() == objects[name][1], name
    assert model.lm_head.weight is model.transformer.wte.weight  # the tie survived


def test_interrupted_load_with_a_dtype_change_and_a_read_error(tmp_path: Path, monkeypatch):
    folder = bigviz.save_sharded(_gpt(1), tmp_path / "ckpt", progress=False)
    model = _gpt(2).to(torch.bfloat16)
    before = model_state(model)
    _fail_at(monkeypatch, 5, OSError("disk read error"))
    with pytest.raises(OSError, match="disk read error"):
        bigviz.load_sharded_checkpoint(model, folder)
    assert_same_state(model, before)


def test_a_load_that_succeeds_after_an_interrupted_one(tmp_path: Path, monkeypatch):
    source = _gpt(1)
    folder = bigviz.save_sharded(source, tmp_path / "ckpt", max_shard_size="20KB", progress=False)
    model = _gpt(2)
    _fail_at(monkeypatch, 6, KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt):
        bigviz.load_sharded_checkpoint(model, folder)
    monkeypatch.undo()
    assert bigviz.load_sharded_checkpoint(model, folder) == ([], [])
    assert_same_state(model, model_state(source))


def test_interrupted_load_into_a_materialised_model_keeps_objects_and_values(tmp_path: Path, monkeypatch):
    folder = bigviz.save_sharded(_gpt(1), tmp_path / "ckpt", progress=False)
    model = _gpt(2)
    before = model_state(model)
    params = dict(model.named_parameters())
    _fail_at(monkeypatch, 4, KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt):
        bigviz.load_checkpoint_in_model(model, folder, progress=False)
    assert_same_state(model, before)
    assert all(p is params[n] for n, p in model.named_parameters())


def test_interrupted_load_into_a_meta_model_leaves_it_on_meta(tmp_path: Path, monkeypatch):
    folder = bigviz.save_sharded(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), tmp_path / "c", progress=False)
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    _fail_at(monkeypatch, 3, KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt):
        bigviz.load_checkpoint_in_model(model, folder, progress=False)
    assert all(p.is_meta for p in model.parameters())
