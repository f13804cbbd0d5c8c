"""Meta-device construction, module sizes, ties, and planning real nn.Modules."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn as nn

import bigviz
from bigviz.modeling.process_memory import rss
from bigviz.models import GPT, GPTConfig, Llama, LlamaConfig


class TiedNet(nn.Module):
    """emb (10 x 4) tied to head, plus a 4 -> 4 linear with bias, plus a buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 4)  # 40 floats = 160 B
        self.body = nn.Linear(4, 4)  # 16 + 4 floats = 80 B
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.emb.weight  # tied in __init__: 0 extra bytes
        self.register_buffer("steps", torch.zeros(3, dtype=torch.int64))  # 24 B


def test_seed_100b_model_builds_on_meta_without_memory():
    before = rss()
    with bigviz.init_empty_weights():
        model = nn.Sequential(*[nn.Linear(10000, 10000) for _ in range(1000)])
    assert sum(p.numel() for p in model.parameters()) == 100_010_000_000
    assert all(p.device.type == "meta" for p in model.parameters())
    assert rss() - before < 200 * 2**20


def test_ties_made_in_init_survive_meta_init():
    with bigviz.init_empty_weights():
        model = TiedNet()
    assert model.head.weight is model.emb.weight
    assert model.steps.device.type == "cpu"  # buffers stay real unless include_buffers
    with bigviz.init_empty_weights(include_buffers=True):
        assert TiedNet().steps.device.type == "meta"


def test_init_on_device_cpu_and_restores_register_parameter():
    original = nn.Module.register_parameter
    with bigviz.init_on_device("cpu"):
        layer = nn.Linear(2, 2)
    assert layer.weight.device.type == "cpu" and nn.Module.register_parameter is original


def test_sizes_count_buffers_and_ties_once():
    sizes = bigviz.compute_module_sizes(TiedNet())
    # emb 160 + body 80 + head 0 (tied) + steps 24
    assert sizes == {"": 264, "emb": 160, "body": 80, "head": 0}
    assert bigviz.find_tied_parameters(TiedNet()) == [["emb.weight", "head.weight"]]


def test_dtype_override_applies_to_floating_tensors_only():
    sizes = bigviz.compute_module_sizes(TiedNet(), dtype=torch.float16)
    assert sizes[""] == 80 + 40 + 24  # halves floats, keeps the int64 buffer
    special = bigviz.compute_module_sizes(TiedNet(), dtype="float16", special_dtypes={"body": torch.float32})
    assert special["body"] == 80 and special["emb"] == 80


def test_size_table_columns_and_shares():
    table = bigviz.size_table(TiedNet())
    assert list(table.columns) == ["module", "class", "parameters", "bytes", "share", "tied_to", "depth"]
    row = table.set_index("module").loc["head"]
    assert row["tied_to"] == "emb.weight" and row["bytes"] == 0
    assert table.set_index("module").loc["<model>", "parameters"] == 40 + 20


def test_shared_storage_views_count_once():
    model = nn.Module()
    base = torch.zeros(8)
    model.register_buffer("a", base)
    model.register_buffer("b", base)  # same storage, another name
    assert bigviz.compute_module_sizes(model)[""] == 32


def test_reference_model_sizes_on_meta():
    with bigviz.init_empty_weights():
        gpt = GPT(GPTConfig.preset("gpt2-xl"))
        llama = Llama(LlamaConfig.preset("llama-70b"))
    gpt_tree, llama_tree = bigviz.module_tree(gpt), bigviz.module_tree(llama)
    assert 1.5e9 < gpt_tree.nodes[""].n_params < 1.6e9  # tied lm_head counted once
    assert 68e9 < llama_tree.nodes[""].n_params < 70e9
    assert gpt_tree.total("lm_head") == 0


def test_plan_gpt2_xl_uses_no_split_blocks_and_ties():
    with bigviz.init_empty_weights():
        model = GPT(GPTConfig.preset("gpt2-xl"))
    plan = bigviz.plan(model, {0: "2GiB", "cpu": "3GiB"})
    units = plan.unit_map
    assert all(name.count(".") <= 2 for name in units)  # blocks stay whole: transformer.h.N
    assert plan.device_of("lm_head.weight") == plan.device_of("transformer.wte.weight")
    assert {p.device for p in plan.placements} >= {0, "cpu"}


def test_transformers_model_from_config_counts_tie_before_tie_weights():
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=16)
    with bigviz.init_empty_weights():
        model = transformers.GPT2LMHeadModel(config)
    tied = bigviz.compute_module_sizes(model)
    model.tie_weights()
    assert tied[""] == bigviz.compute_module_sizes(model)[""]


def test_plan_max_memory_errors_quote_the_value():
    with pytest.raises(ValueError, match="'lots'"):
        bigviz.plan(TiedNet(), {"cpu": "lots"})
    with pytest.raises(ValueError, match="'gpu'"):
        bigviz.infer_auto_device_map(TiedNet(), {"gpu": 100})


def test_infer_auto_device_map_compat_signature():
    model = nn.Sequential(*[nn.Linear(100, 100) for _ in range(4)])  # 40,400 B each
    got = bigviz.infer_auto_device_map(model, {0: "150KB", "cpu": "1GB"}, None, None, None, False, True)
    assert got == {"0": 0, "1": "cpu", "2": "cpu", "3": "cpu"}
    units = bigviz.infer_auto_device_map(model, {0: "150KB", "cpu": "1GB"}, clean_result=False)
    assert units == got  # already one unit per layer


def test_check_device_map_on_model():
    model = nn.ModuleDict(
        {
            "block1": nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)),
            "block2": nn.ModuleDict({f"linear{i}": nn.Linear(2, 2) for i in (1, 2, 3)}),
        }
    )
    with pytest.raises(ValueError, match="block2.linear3"):
        bigviz.check_device_map(model, {"block1": 0, "block2.linear1": 1, "block2.linear2": 1})
    assert bigviz.check_device_map(model, {"block1": 0, "block2": "cuda:1"}) == {"block1": 0, "block2": 1}


def test_exported_map_is_accepted_by_transformers(tmp_path):
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=4, n_embd=32, n_head=2, vocab_size=100, n_positions=16)
    torch.manual_seed(0)
    reference = transformers.GPT2LMHeadModel(config).eval()
    reference.save_pretrained(tmp_path / "ckpt")
    with bigviz.init_empty_weights():
        meta = transformers.GPT2LMHeadModel(config)
    meta.tie_weights()
    # A CPU budget of 3/4 of the model, less room kept for two disk blocks streamed in,
    # splits the model between the CPU and disk.
    budget = bigviz.compute_module_sizes(meta)[""] * 3 // 4
    plan = bigviz.plan(meta, {"cpu": budget, "disk": 10**9})
    assert set(plan.device_map.values()) == {"cpu", "disk"}
    bigviz.save_device_map(plan.device_map, tmp_path / "map.json")
    loaded_map = json.loads((tmp_path / "map.json").read_text())
    model = transformers.GPT2LMHeadModel.from_pretrained(
        tmp_path / "ckpt", device_map=loaded_map, offload_folder=tmp_path / "offload"
    )
    assert {k: v for k, v in model.hf_device_map.items()} == plan.device_map
    ids = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        assert torch.allclose(model(ids).logits, reference(ids).logits, atol=1e-5)
