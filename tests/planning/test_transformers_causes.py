"""One focused test per cause of issue 9 (real transformers models), each failing before its fix.

1. checkpoint names that differ from the model's (renames, experts fused at load time);
2. ``dtype=`` with disk offload, and transformers' keep-in-fp32 rule;
3. maps planned from checkpoint headers, run by bigviz and by ``from_pretrained``;
4. ``disk_offload`` of a model with weights on its root module (CLIP's ``logit_scale``);
5. weights read without calling their module (DeBERTa's ``rel_embeddings``);
6. weights the model computes (Marian's sinusoidal positions);
7. weight-norm parametrizations kept whole by the planner;
and the defaults: ``infer_auto_device_map`` fills in order as accelerate's does, a RAM + disk
plan reserves no RAM for memory-mapped disk blocks, ``init_empty_weights(include_buffers=True)``
patches nothing.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from torch import nn

import bigviz
from bigviz.checkpoint.errors import CheckpointError

pytest.importorskip("transformers")

from tests.zoo.helpers import forward, meta_model, reference, save_checkpoint  # noqa: E402
from tests.zoo.specs import BY_NAME  # noqa: E402


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory):
    """name -> checkpoint folder, written once per module (save_pretrained, small shards)."""
    root = tmp_path_factory.mktemp("causes")
    cache: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in cache:
            cache[name] = save_checkpoint(BY_NAME[name], root / name)
        return cache[name]

    return get


# 1 --------------------------------------------------------------------------------------
def test_experts_stored_one_by_one_are_fused_once_and_offloaded(saved, tmp_path: Path):
    spec = BY_NAME["mixtral"]
    folder = saved("mixtral")
    expected = forward(reference(spec, folder), spec)
    device_map = {"": "cpu", "model.layers.1": "disk"}
    model = meta_model(spec)
    result = bigviz.load_checkpoint_in_model(model, folder, device_map, offload_folder=tmp_path / "off", progress=False)
    fused = {t: c for c in result.conversions if not c.is_rename for t in c.targets}
    gate_up = fused["model.layers.1.mlp.experts.gate_up_proj"]
    assert gate_up.operation == "MergeModulelist(dim=0), Concatenate(dim=1)"
    assert gate_up.sources[0] == "model.layers.1.block_sparse_moe.experts.0.w1.weight"
    assert len(gate_up.sources) == 2 * 4 and gate_up.shapes == ((4, 96, 32),)
    renamed = {c.sources[0]: c.targets[0] for c in result.conversions if c.is_rename}
    assert renamed["model.layers.0.block_sparse_moe.gate.weight"] == "model.layers.0.mlp.gate.weight"
    assert "converted model.layers.1.mlp.experts.gate_up_proj <- 8 keys" in result.summary()
    # fused tensors on disk were written once (aligned), plain renames stay in the shards
    written = bigviz.CheckpointIndex.open(tmp_path / "off")
    assert set(written.keys()) == {f"model.layers.1.mlp.experts.{p}" for p in ("gate_up_proj", "down_proj")}
    assert result.disk.info("model.layers.1.mlp.gate.weight").name == "model.layers.1.block_sparse_moe.gate.weight"
    bigviz.dispatch_model(model, device_map, weights=result.disk)
    assert torch.equal(forward(model, spec), expected)
    bigviz.remove_hooks(model)
    result.disk.close()


def test_renamed_head_is_read_in_place_and_fused_disk_needs_a_folder(saved):
    spec = BY_NAME["gpt_neox"]
    folder = saved("gpt_neox")
    model = bigviz.load_checkpoint_and_dispatch(meta_model(spec), folder, {"": "cpu", "lm_head": "disk"})
    units = {u.name: u for u in model._bigviz_dispatch.units}
    store = units["lm_head"].sources["lm_head.weight"]
    assert store.info("lm_head.weight").name == "embed_out.weight"  # GPT-NeoX's checkpoint name
    assert torch.equal(forward(model, spec), forward(reference(spec, folder), spec))
    bigviz.remove_hooks(model)
    with pytest.raises(CheckpointError, match="fused from several checkpoint keys.*offload_folder"):
        bigviz.load_checkpoint_in_model(
            meta_model(BY_NAME["qwen2_moe"]), saved("qwen2_moe"), {"": "disk"}, progress=False
        )


def test_key_mapping_renames_as_from_pretrained_does(saved, tmp_path: Path):
    spec = BY_NAME["gpt2"]
    index = bigviz.CheckpointIndex.open(saved("gpt2"))
    with bigviz.LazyWeights(index) as weights:  # the same weights under other names
        state = {k.replace(".mlp.", ".ffn."): weights[k].clone() for k in weights}
    bigviz.save_sharded(state, tmp_path / "renamed", max_shard_size="20KB", progress=False)
    shutil.copy(saved("gpt2") / "config.json", tmp_path / "renamed")
    mapping = {r"\.ffn\.": ".mlp."}
    model = meta_model(spec)
    result = bigviz.load_checkpoint_in_model(model, tmp_path / "renamed", key_mapping=mapping, progress=False)
    assert not result.missing and not result.unexpected and len(result.conversions) == 2 * 4
    theirs = reference(spec, tmp_path / "renamed", key_mapping=mapping)
    assert torch.equal(forward(model, spec), forward(theirs, spec))


# 2 --------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "device_map", [{"": "cpu", "transformer.h.1": "disk"}, {"": "disk"}], ids=["half-disk", "all-disk"]
)
def test_disk_weights_come_back_in_the_requested_dtype(saved, device_map):
    spec = BY_NAME["gpt2"]
    folder = saved("gpt2")
    expected = forward(reference(spec, folder, torch.bfloat16), spec)
    model = bigviz.load_checkpoint_and_dispatch(meta_model(spec), folder, device_map, dtype=torch.bfloat16)
    assert model.transformer.h[1].mlp.c_fc.weight.dtype == torch.bfloat16  # the placeholder says so
    got = forward(model, spec)
    assert got.dtype == torch.bfloat16 and torch.equal(got, expected)
    bigviz.remove_hooks(model)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_keep_in_fp32_follows_transformers_rule(saved, dtype):
    spec = BY_NAME["t5"]
    folder = saved("t5")
    want = {k: v.dtype for k, v in reference(spec, folder, dtype).state_dict().items()}
    device_map = {"": "cpu", "encoder.block.1": "disk"}
    model = meta_model(spec)
    result = bigviz.load_checkpoint_in_model(model, folder, device_map, dtype=dtype, progress=False)
    got = {k: v.dtype for k, v in model.state_dict().items()}
    assert got == want
    wo = "encoder.block.1.layer.1.DenseReluDense.wo.weight"
    assert result.disk[wo].dtype == (torch.float32 if dtype == torch.float16 else dtype)


# 3 --------------------------------------------------------------------------------------
def test_a_map_planned_from_headers_runs_in_bigviz_and_transformers(saved, tmp_path: Path):
    spec = BY_NAME["llama_tied"]  # lm_head is tied: the checkpoint does not store it
    folder = saved("llama_tied")
    expected = forward(reference(spec, folder), spec)
    budget = bigviz.compute_module_sizes(meta_model(spec))[""] // 2
    bigviz.save_device_map(bigviz.plan(folder, {"cpu": budget}).device_map, tmp_path / "map.json")
    exported = json.loads((tmp_path / "map.json").read_text())
    assert "lm_head" in exported and "disk" in exported.values()
    model = bigviz.load_checkpoint_and_dispatch(meta_model(spec), folder, bigviz.load_device_map(tmp_path / "map.json"))
    assert torch.equal(forward(model, spec), expected)
    bigviz.remove_hooks(model)
    theirs = reference(spec, folder, device_map=exported, offload_folder=tmp_path / "off")
    assert torch.equal(forward(theirs, spec), expected)


def test_a_map_from_headers_alone_leaves_out_computed_buffers_and_renames(saved, tmp_path: Path):
    for name in ("llama", "gpt_neox"):  # rotary buffers not in any checkpoint; embed_out -> lm_head
        spec = BY_NAME[name]
        headers = tmp_path / name
        headers.mkdir()
        for file in saved(name).glob("*.safetensors*"):  # no config.json: names as the files have them
            shutil.copy(file, headers)
        budget = bigviz.compute_module_sizes(meta_model(spec))[""] // 2
        device_map = bigviz.plan(headers, {"cpu": budget}).device_map
        assert not any("rotary" in key for key in device_map)
        model = bigviz.load_checkpoint_and_dispatch(meta_model(spec), headers, device_map)
        assert torch.equal(forward(model, spec), forward(reference(spec, saved(name)), spec))
        bigviz.remove_hooks(model)


# 4 --------------------------------------------------------------------------------------
def test_disk_offload_of_a_model_with_weights_on_its_root(tmp_path: Path):
    from tests.zoo.specs import build_config, model_class

    spec = BY_NAME["clip"]
    torch.manual_seed(0)
    model = model_class(spec)(build_config(spec)).eval()
    expected = forward(model, spec)
    bigviz.disk_offload(model, tmp_path / "off")
    assert model.logit_scale.is_meta  # the root's own weight is offloaded too
    assert torch.equal(forward(model, spec), expected)
    assert torch.equal(forward(model, spec), expected)  # files still open after a forward
    bigviz.remove_hooks(model)
    assert torch.equal(forward(model, spec), expected)


# 5 --------------------------------------------------------------------------------------
def test_a_weight_read_without_calling_its_module_is_fetched_by_its_reader(saved):
    spec = BY_NAME["deberta_v2"]
    folder = saved("deberta_v2")
    device_map = {"": "cpu", "deberta.encoder.rel_embeddings": "disk"}
    model = bigviz.load_checkpoint_and_dispatch(meta_model(spec), folder, device_map)
    units = [u.name for u in model._bigviz_dispatch.units]
    assert units == ["deberta.encoder"]  # the module whose code reads rel_embeddings.weight
    assert torch.equal(forward(model, spec), forward(reference(spec, folder), spec))
    bigviz.remove_hooks(model)


# 6 --------------------------------------------------------------------------------------
def test_computed_weights_are_computed_as_transformers_does(saved):
    spec = BY_NAME["marian"]
    folder = saved("marian")
    model = meta_model(spec)
    result = bigviz.load_checkpoint_in_model(model, folder, {"": "cpu"}, progress=False)
    assert result.computed == ["model.encoder.embed_positions.weight", "model.decoder.embed_positions.weight"]
    assert not model.model.encoder.embed_positions.weight.is_meta
    assert torch.equal(forward(model, spec), forward(reference(spec, folder), spec))


# 7 --------------------------------------------------------------------------------------
class _WeightNormed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(64, 64)
        self.conv = nn.utils.parametrizations.weight_norm(nn.Conv1d(64, 64, 3, padding=1), dim=2)
        self.last = nn.Linear(64, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.last(self.conv(self.first(x).transpose(1, 2)).transpose(1, 2))


def test_a_parametrized_weight_is_placed_whole(tmp_path: Path):
    torch.manual_seed(0)
    model = _WeightNormed().eval()
    sizes = bigviz.compute_module_sizes(model)
    # room for the first layer and part of the conv: its parts must not be split
    budget = sizes["first"] + sizes["conv.parametrizations.weight"] // 2
    plan = bigviz.plan(model, {"cpu": budget})
    assert plan.device_map["conv"] == "disk" and not any(k.startswith("conv.") for k in plan.device_map)
    x = torch.randn(2, 5, 64)
    expected = model(x)
    dispatched = bigviz.dispatch_model(model, plan.device_map, offload_folder=tmp_path)
    assert [u.name for u in dispatched._bigviz_dispatch.units] == ["conv"]
    assert torch.equal(dispatched(x), expected)
    bigviz.remove_hooks(dispatched)


# defaults -------------------------------------------------------------------------------
def test_infer_auto_device_map_fills_devices_in_order_like_accelerate():
    from accelerate import infer_auto_device_map as accelerate_map

    model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(6)])  # 16,640 B each
    budgets = {0: 200_000, 1: 200_000, "cpu": 10**9}
    ours = bigviz.infer_auto_device_map(model, budgets)
    assert ours == {"": 0} and ours == accelerate_map(model, budgets)
    assert set(bigviz.plan(model, budgets).device_map.values()) == {0, 1}  # plan() balances


def test_ram_and_disk_plan_keeps_more_in_ram_than_accelerate():
    from accelerate import infer_auto_device_map as accelerate_map

    model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(10)])
    for budget in (50_000, 90_000, 120_000):
        theirs = accelerate_map(model, {"cpu": budget}, verbose=False)
        plan = bigviz.plan(model, {"cpu": budget}, strategy="sequential")
        in_ram = [k for k, d in plan.device_map.items() if d == "cpu"]
        assert plan.usage_of("cpu").offload_reserve == 0  # the CPU computes on mapped pages
        assert len(in_ram) >= len([k for k, d in theirs.items() if d == "cpu"]) + 1
        assert plan.usage_of("cpu").used <= budget


def test_init_empty_weights_with_buffers_patches_nothing():
    register_parameter, register_buffer = nn.Module.register_parameter, nn.Module.register_buffer
    with bigviz.init_empty_weights(include_buffers=True):
        module = nn.BatchNorm1d(4)
        assert nn.Module.register_parameter is register_parameter
        assert nn.Module.register_buffer is register_buffer
    assert module.weight.device.type == "meta" and module.running_mean.device.type == "meta"
    with bigviz.init_empty_weights():
        module = nn.BatchNorm1d(4)
    assert module.weight.device.type == "meta" and module.running_mean.device.type == "cpu"
    assert nn.Module.register_parameter is register_parameter
