"""The chain of plans on real models: ``bigviz.load_plan`` and ``bigviz.dispatch_plan`` are
made from headers and sizes alone, the engine carries out exactly the dispatch plan (same
units, storage, fetch order), no-split globs are honoured alike, and an entry point reports
every problem of its input in one error."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import bigviz
from bigviz.core.errors import BigvizError


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(width, 2 * width), nn.Linear(2 * width, width)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))


class Net(nn.Module):
    _no_split_modules = ["Block"]

    def __init__(self, width: int = 8, depth: int = 3) -> None:
        super().__init__()
        self.emb = nn.Linear(width, width)
        self.body = nn.Sequential(*[Block(width) for _ in range(depth)])
        self.head = nn.Linear(width, 3)

    def forward(self, x):
        return self.head(self.body(self.emb(x)))


def _checkpoint(tmp_path, model):
    return bigviz.save_sharded(model, tmp_path / "ckpt", max_shard_size="1KB", progress=False)


def _meta_net(**kwargs) -> Net:
    with torch.device("meta"):
        return Net(**kwargs)


def test_dispatch_plan_is_what_the_engine_fetches(tmp_path):
    torch.manual_seed(0)
    reference = Net()
    folder = _checkpoint(tmp_path, reference)
    device_map = {"emb": "cpu", "body.0": "disk", "body.1": "cpu", "body.2": "disk", "head": "cpu"}
    planned = bigviz.dispatch_plan(_meta_net(), folder, device_map, main_device="cpu")
    # the CPU executes: cpu-mapped modules are resident, disk blocks stream, one unit per block
    assert [(u.name, u.storage) for u in planned.units] == [("body.0", "disk"), ("body.2", "disk")]
    assert planned.units[0].tensors == ("body.0.up.weight", "body.0.up.bias", "body.0.down.weight", "body.0.down.bias")
    assert planned.units[0].nbytes == 4 * (8 * 16 + 16 + 16 * 8 + 8)
    model = bigviz.load_checkpoint_and_dispatch(_meta_net(), folder, device_map)
    done = model._bigviz_dispatch.plan
    assert done.units == planned.units and done.resident == planned.resident
    x = torch.randn(2, 8)
    assert torch.equal(model(x), reference(x))
    bigviz.remove_hooks(model)


def test_a_glob_no_split_entry_makes_block_units_in_the_engine_too():
    model = Net(depth=4)
    glob = ["body.*"]  # blocks named by a glob, not a class: the engine used to ignore it
    plan = bigviz.dispatch_plan(model, device_map={"": "cpu"}, main_device="cpu", no_split_module_classes=glob)
    assert plan.units == ()  # the CPU executes: cpu weights are resident
    plan = bigviz.dispatch_plan(
        model, device_map={"emb": "cpu", "body": "disk", "head": "cpu"}, main_device="cpu", no_split_module_classes=glob
    )
    assert [u.name for u in plan.units] == [f"body.{i}" for i in range(4)]
    whole = bigviz.dispatch_plan(
        model, device_map={"emb": "cpu", "body": "disk", "head": "cpu"}, main_device="cpu", no_split_module_classes=[]
    )
    assert [u.name for u in whole.units] == ["body"]  # nothing says where blocks end: one unit


def test_dispatch_model_carries_out_its_plan_with_a_glob(tmp_path):
    torch.manual_seed(1)
    model = Net(depth=4)
    x = torch.randn(3, 8)
    expected = model(x)
    device_map = {"emb": "cpu", "body": "disk", "head": "cpu"}
    planned = bigviz.dispatch_plan(model, device_map=device_map, main_device="cpu", no_split_module_classes=["body.*"])
    bigviz.dispatch_model(
        model, device_map, main_device="cpu", offload_folder=tmp_path / "off", no_split_module_classes=["body.*"]
    )
    assert model._bigviz_dispatch.plan.units == planned.units
    assert [u.name for u in model._bigviz_dispatch.units] == [f"body.{i}" for i in range(4)]
    assert torch.equal(model(x), expected)
    bigviz.remove_hooks(model)


def test_the_planners_reserve_is_the_dispatch_plans_hold():
    model = _meta_net(width=16, depth=6)
    block = 4 * (16 * 32 + 32 + 32 * 16 + 16)
    plan = bigviz.plan(model, {0: 4 * block, "cpu": "1GB"})
    dispatch = plan.dispatch_plan()
    assert dispatch.units and all(u.nbytes <= block for u in dispatch.units)  # never more than a block
    assert plan.usage_of(0).offload_reserve == dispatch.held_bytes()[0]
    again = bigviz.dispatch_plan(model, device_map=plan)  # from the public entry point: the same units
    assert again.units == dispatch.units


def test_load_plan_says_where_each_tensor_comes_from_without_reading(tmp_path):
    folder = _checkpoint(tmp_path, Net())
    plan = bigviz.load_plan(_meta_net(), folder, {"emb": "cpu", "body": "disk", "head": "cpu"}, dtype=torch.float16)
    assert isinstance(plan, bigviz.LoadPlan)
    loads = {t.name: t for t in plan.loads}
    assert set(loads) == set(Net().state_dict())
    assert loads["body.1.up.weight"].device == "disk" and loads["emb.weight"].device == "cpu"
    assert {t.source_dtype for t in plan.loads} == {"float32"} and {str(t.dtype) for t in plan.loads} == {
        "torch.float16"
    }
    text = plan.summary()
    assert "LoadPlan" in text or "tensor" in text


def test_one_error_lists_a_missing_gpu_and_an_uncovered_module_together(tmp_path):
    if torch.cuda.device_count() > 5:
        pytest.skip("this machine has GPU 5")
    folder = _checkpoint(tmp_path, Net())
    bad = {"emb": 5, "body": "cpu"}  # GPU 5 is absent, and 'head' is covered by nothing
    for call in (
        lambda: bigviz.load_checkpoint_and_dispatch(_meta_net(), folder, bad),
        lambda: bigviz.dispatch_model(Net(), bad),
    ):
        with pytest.raises(BigvizError) as caught:
            call()
        text = str(caught.value)
        assert "GPU 5" in text and "head" in text, text
        assert isinstance(caught.value, ValueError)
        assert text.count("GPU 5") == 1  # once, however many entries and arguments name it
    # a plan may be made for hardware this machine lacks: only the uncovered module is wrong
    with pytest.raises(BigvizError, match="head") as caught:
        bigviz.dispatch_plan(_meta_net(), folder, bad)
    assert "GPU 5" not in str(caught.value)
    planned = bigviz.dispatch_plan(_meta_net(), folder, {**bad, "head": "disk"})
    assert planned.main_device == 5  # GPU 5 executes: cpu blocks stream to it too
    assert [(u.name, u.storage) for u in planned.units] == [
        ("body.0", "cpu"),
        ("body.1", "cpu"),
        ("body.2", "cpu"),
        ("head", "disk"),
    ]


@pytest.mark.parametrize("entry", ["dispatch_plan", "load_checkpoint_and_dispatch"])
def test_a_map_planned_from_headers_reads_the_checkpoint_headers_once(tmp_path, monkeypatch, entry):
    import bigviz.checkpoint.index as index_module
    from bigviz.checkpoint.save import save_sharded

    torch.manual_seed(0)
    source = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    folder = save_sharded({f"base.{k}": v for k, v in source.state_dict().items()}, tmp_path / "c", progress=False)
    reads = []
    real = index_module._read_safetensors
    monkeypatch.setattr(index_module, "_read_safetensors", lambda *a: reads.append(1) or real(*a))
    with bigviz.init_empty_weights():
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    device_map = {"base.0": "cpu", "base.1": "disk"}  # checkpoint names: the model has no `base`
    if entry == "dispatch_plan":
        plan = bigviz.dispatch_plan(model, folder, device_map)
        assert [u.name for u in plan.units] == ["1"]
    else:
        loaded = bigviz.load_checkpoint_and_dispatch(model, folder, device_map)
        x = torch.randn(3, 4)
        assert torch.equal(loaded(x), source(x))
    assert len(reads) == 1


def test_auto_without_max_memory_plans_for_the_machine_given(tmp_path):
    """``machine=`` is the machine the whole chain plans for: with "auto" and no max_memory the
    default "cpu" budget is its RAM's (less the ring), as the stream plan's, so a model larger
    than that machine streams blocks from disk; the real machine's RAM planned everything on
    "cpu" and the stream plan then kept it memory-mapped."""
    torch.manual_seed(0)
    reference = Net(width=64, depth=6)
    folder = _checkpoint(tmp_path, reference)
    total = sum(p.numel() * 4 for p in reference.parameters())
    small = bigviz.MachineFacts(available_ram=total // 2)
    plan = bigviz.dispatch_plan(_meta_net(width=64, depth=6), folder, "auto", machine=small)
    assert "disk" in set(map(str, plan.device_map.values())) and plan.stream.mode == "copy"
    assert plan.stream.resident_bytes + plan.stream.ring_bytes <= small.room
    device_plan = bigviz.plan(_meta_net(width=64, depth=6), machine=small)
    assert dict(device_plan.device_map) == dict(plan.device_map)
    model = bigviz.load_checkpoint_and_dispatch(_meta_net(width=64, depth=6), folder, "auto", machine=small)
    x = torch.randn(2, 64)
    with torch.no_grad():
        assert torch.equal(model(x), reference(x))
    assert bigviz.residency(model).mode == "copy"
    bigviz.remove_hooks(model)


def test_strict_false_says_what_it_did_not_load(tmp_path):
    """load_checkpoint_and_dispatch returns only the model: with strict=False a tensor the
    checkpoint lacks (left as the model made it) and a key the model lacks are named in a
    warning pointing at the caller's line, as accelerate logs them; a full checkpoint warns nothing."""
    import warnings

    torch.manual_seed(0)
    reference = Net()
    state = {k: v for k, v in reference.state_dict().items() if k != "head.weight"}
    state["extra.weight"] = torch.zeros(2)
    folder = bigviz.save_sharded(state, tmp_path / "partial", progress=False)
    with pytest.warns(
        UserWarning, match=r"(?s)1 tensor of the model not in.*head\.weight.*1 checkpoint key.*extra\.weight"
    ) as caught:
        model = bigviz.load_checkpoint_and_dispatch(Net(), folder, {"": "cpu", "body.1": "disk"}, strict=False)
    assert caught[0].filename == __file__
    assert torch.equal(model.emb.weight, reference.emb.weight) and not torch.equal(
        model.head.weight, reference.head.weight
    )
    bigviz.remove_hooks(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model = bigviz.load_checkpoint_and_dispatch(_meta_net(), _checkpoint(tmp_path, reference), {"": "cpu"})
