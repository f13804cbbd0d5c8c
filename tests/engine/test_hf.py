"""transformers models built from configs, dispatched and offloaded (forward, tied weights, generate)."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from torch import nn

import bigviz
from bigviz.checkpoint.save import save_sharded
from bigviz.engine.big_modeling import load_checkpoint_and_dispatch
from bigviz.engine.dispatch import dispatch_model
from bigviz.engine.hooks import remove_hooks

pytest.importorskip("transformers")

MAPS = {
    "gpt2": {
        "half-disk": {
            "transformer.wte": "cpu", "transformer.wpe": "cpu", "transformer.drop": "cpu",
            "transformer.h.0": "cpu", "transformer.h.1": "disk", "transformer.ln_f": "cpu", "lm_head": "cpu",
        },
        "tied-on-disk": {
            "transformer.wte": "disk", "transformer.wpe": "cpu", "transformer.drop": "cpu",
            "transformer.h": "disk", "transformer.ln_f": "cpu", "lm_head": "disk",
        },
    },
    "llama": {
        "half-disk": {"model.embed_tokens": "cpu", "model.layers.0": "cpu", "model.layers.1": "disk",
                      "model.norm": "cpu", "model.rotary_emb": "cpu", "lm_head": "cpu"},
        "alternating": {"model.embed_tokens": "cpu", "model.layers.0": "disk", "model.layers.1": "cpu",
                        "model.norm": "disk", "model.rotary_emb": "cpu", "lm_head": "disk"},
    },
    "bert": {
        "half-disk": {"embeddings": "cpu", "encoder.layer.0": "cpu", "encoder.layer.1": "disk", "pooler": "cpu"},
        "alternating": {"embeddings": "disk", "encoder.layer.0": "cpu", "encoder.layer.1": "disk", "pooler": "cpu"},
    },
}  # fmt: skip


@pytest.fixture(params=["gpt2", "llama", "bert"])
def hf_model(request: pytest.FixtureRequest) -> tuple[str, nn.Module]:
    fixture = {"gpt2": "hf_gpt2", "llama": "hf_llama", "bert": "hf_bert"}[request.param]
    return request.param, request.getfixturevalue(fixture)


def ids(vocab: int = 128) -> torch.Tensor:
    return torch.randint(1, vocab, (1, 7), generator=torch.Generator().manual_seed(2))


def maps_for(family: str) -> dict[str, dict[str, str]]:
    return {**MAPS[family], "all-disk": {"": "disk"}}


def test_forward_parity_for_every_map(hf_model: tuple[str, nn.Module], tmp_path: Path):
    family, reference = hf_model
    x = ids()
    with torch.no_grad():
        expected = reference(x)[0]
    for name, device_map in maps_for(family).items():
        model = dispatch_model(copy.deepcopy(reference), device_map, offload_folder=tmp_path / name)
        with torch.no_grad():
            got = model(x)[0]
        assert torch.equal(got, expected), name
        remove_hooks(model)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_generate_with_the_transformers_cache_gives_the_same_tokens(
    family: str, request: pytest.FixtureRequest, tmp_path: Path
):
    reference = request.getfixturevalue({"gpt2": "hf_gpt2", "llama": "hf_llama"}[family])
    x = ids()
    kwargs = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    expected = reference.generate(x, **kwargs)
    for name, device_map in maps_for(family).items():
        model = dispatch_model(copy.deepcopy(reference), device_map, offload_folder=tmp_path / name)
        assert torch.equal(model.generate(x, **kwargs), expected), name


def test_gpt2_tie_survives_and_is_fetched_once_per_use(hf_gpt2: nn.Module, tmp_path: Path):
    model = dispatch_model(copy.deepcopy(hf_gpt2), MAPS["gpt2"]["tied-on-disk"], offload_folder=tmp_path)
    units = {u.name: u for u in model._bigviz_dispatch.units}
    assert set(units["lm_head"].slots) == {"transformer.wte.weight"}  # stored once, under wte's name
    assert model.lm_head.weight is model.transformer.wte.weight  # both on the same meta placeholder


def test_load_checkpoint_and_dispatch_a_model_built_from_config_on_meta(hf_gpt2: nn.Module, tmp_path: Path):
    from transformers import GPT2LMHeadModel

    folder = save_sharded(hf_gpt2.state_dict(), tmp_path / "ckpt", max_shard_size="50KB", progress=False)
    with bigviz.init_empty_weights():
        model = GPT2LMHeadModel(hf_gpt2.config)
    model = load_checkpoint_and_dispatch(model, folder, MAPS["gpt2"]["half-disk"])
    x = ids()
    assert not model.training
    with torch.no_grad():
        assert torch.equal(model(x)[0], hf_gpt2(x)[0])
    kwargs = dict(max_new_tokens=5, do_sample=False, pad_token_id=0)
    assert torch.equal(model.generate(x, **kwargs), hf_gpt2.generate(x, **kwargs))


def test_auto_map_for_bert_from_a_checkpoint(hf_bert: nn.Module, tmp_path: Path):
    from transformers import BertModel

    folder = save_sharded(hf_bert.state_dict(), tmp_path / "ckpt", progress=False)
    total = sum(p.numel() * p.element_size() for p in hf_bert.parameters())
    with bigviz.init_empty_weights():
        model = BertModel(hf_bert.config)
    model = load_checkpoint_and_dispatch(model, folder, "auto", max_memory={"cpu": total * 3 // 4, "disk": "1GB"})
    assert "disk" in model.hf_device_map.values()
    x = ids()
    with torch.no_grad():
        assert torch.equal(model(x).last_hidden_state, hf_bert(x).last_hidden_state)
