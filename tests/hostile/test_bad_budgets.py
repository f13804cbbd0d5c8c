"""Promise: a bad budget, device map or no-split list is a ValueError quoting the value, made
before anything is planned, loaded or written (no OverflowError, AttributeError, TypeError,
and no silent merge or silent no-op)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import bigviz
from bigviz.cli import main
from bigviz.core.sizes import parse_max_memory, parse_size
from bigviz.models import GPT, GPTConfig

from tests.hostile.helpers import assert_same_state, model_state, snapshot


def _gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig.preset("gpt-tiny")).eval()


@pytest.mark.parametrize("text", ["1e400", "1e400GiB", "9e307TB", "1e308GB"])
def test_huge_sizes_are_a_value_error_quoting_the_value(text):
    with pytest.raises(ValueError, match=repr(text).replace("+", r"\+")):
        parse_size(text)
    with pytest.raises(ValueError, match="too large"):
        bigviz.plan(nn.Linear(2, 2), {"cpu": text})


@pytest.mark.parametrize("budget", ["10GiB", 10 * 2**30, ["cpu", "1GB"]])
def test_max_memory_that_is_not_a_dict(budget):
    for call in (
        lambda: parse_max_memory(budget),
        lambda: bigviz.plan(nn.Linear(2, 2), budget),
        lambda: bigviz.infer_auto_device_map(nn.Linear(2, 2), budget),
    ):
        with pytest.raises(ValueError, match=r"max_memory must be a dict.*" + repr(budget)[:6].replace("[", r"\[")):
            call()


@pytest.mark.parametrize("keys", [(0, "cuda:0"), ("0", 0), ("cuda", "cuda:0"), ("cpu", " cpu")])
def test_two_keys_for_one_device_are_refused_not_merged(keys):
    first, second = keys
    budget = {first: "1GiB", second: "2GiB"}
    with pytest.raises(ValueError) as info:
        parse_max_memory(budget)
    assert repr(first) in str(info.value) and repr(second) in str(info.value)
    with pytest.raises(ValueError, match="both name"):
        bigviz.plan(nn.Linear(2, 2), {**budget, "disk": "1GB"})


def test_int_keys_in_a_device_map_are_quoted(tmp_path: Path):
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    before = model_state(model)
    bad = {0: "cpu", "1": "cpu"}
    for call in (
        lambda: bigviz.check_device_map(model, bad),
        lambda: bigviz.dispatch_model(model, bad),
        lambda: bigviz.save_device_map(bad, tmp_path / "map.json"),
    ):
        with pytest.raises(ValueError, match=r"key 0 \(an int\) is not a module name"):
            call()
    assert not hasattr(model, "_hf_hook") and not (tmp_path / "map.json").exists()
    assert_same_state(model, before)


def test_int_keys_in_a_device_map_for_a_load(tmp_path: Path):
    folder = bigviz.save_sharded(_gpt(), tmp_path / "ckpt", progress=False)
    files = snapshot(folder)
    with bigviz.init_empty_weights():
        model = GPT(GPTConfig.preset("gpt-tiny"))
    with pytest.raises(ValueError, match=r"key 0 \(an int\)"):
        bigviz.load_checkpoint_in_model(model, folder, {0: "cpu", "": "cpu"}, progress=False)
    with pytest.raises(ValueError, match=r"key 0 \(an int\)"):
        bigviz.load_checkpoint_and_dispatch(model, folder, {0: "cpu", "": "cpu"})
    assert all(p.is_meta for p in model.parameters())  # nothing loaded
    assert snapshot(folder) == files


def test_a_no_split_typo_is_an_error_listing_the_classes():
    with bigviz.init_empty_weights():
        model = GPT(GPTConfig.preset("gpt-mini"))
    with pytest.raises(ValueError) as info:
        bigviz.plan(model, {"cpu": "1GB"}, no_split_module_classes=["Blok"])
    message = str(info.value)
    assert "'Blok'" in message and "did you mean 'Block'" in message
    assert "Block" in message and "Linear" in message and "LayerNorm" in message  # the model's classes
    with pytest.raises(ValueError, match="'Blok'"):
        bigviz.infer_auto_device_map(model, {"cpu": "1GB"}, no_split_module_classes=["Block", "Blok"])
    with pytest.raises(ValueError, match=r"'transformer\.blocks\.\*' matches no module name"):
        bigviz.plan(model, {"cpu": "1GB"}, no_split_module_classes=["transformer.blocks.*"])
    plan = bigviz.plan(model, {"cpu": "1GB"}, no_split_module_classes=["Block", "transformer.h.*"])
    assert plan.device_map == {"": "cpu"}  # names that match are fine


def test_no_split_for_a_checkpoint_needs_module_patterns(tmp_path: Path, capsys):
    bigviz.save_sharded(_gpt(), tmp_path / "ckpt", progress=False)
    out = tmp_path / "map.json"
    code = main(["plan", str(tmp_path / "ckpt"), "--max-memory", "cpu=1GB", "--no-split", "Block", "--out", str(out)])
    assert code == 2 and not out.exists()
    err = capsys.readouterr().err
    assert "'Block'" in err and "no class names" in err and "'transformer.h.*'" in err
    assert (
        main(
            [
                "plan",
                str(tmp_path / "ckpt"),
                "--max-memory",
                "cpu=1GB",
                "--no-split",
                "transformer.h.*",
                "--out",
                str(out),
            ]
        )
        == 0
    )


def test_cli_no_split_typo_on_a_preset(tmp_path: Path, capsys):
    out = tmp_path / "map.json"
    code = main(["plan", "gpt-mini", "--max-memory", "cpu=1GB", "--no-split", "Blok", "--out", str(out)])
    assert code == 2 and not out.exists()
    err = capsys.readouterr().err
    assert "bigviz plan:" in err and "'Blok'" in err and "did you mean 'Block'" in err
