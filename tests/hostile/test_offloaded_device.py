"""Promise: an offloaded weight reports the device it will be used on, so model code that places
its inputs by a child's weight (``input_ids.to(self.embed_tokens.weight.device)`` in Llama 4,
``pixel_values`` by the patch embedding's in Mllama, ``model.device`` in ``generate``) computes
the same logits as the model in memory, and ``generate`` the same tokens. Between forwards the
weight holds no data (``is_meta``); computing with it outside its module's forward is refused
naming it (``OffloadedWeightError``), never garbage. accelerate and transformers fail on the same
maps ("Cannot copy out of meta tensor")."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import bigviz
from bigviz.engine.weights import OffloadedWeightError

transformers = pytest.importorskip("transformers")


def _llama4() -> nn.Module:
    config = transformers.Llama4TextConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, intermediate_size_mlp=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=2, max_position_embeddings=64,
        no_rope_layers=[1, 1], interleave_moe_layer_step=1, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    config._attn_implementation = "eager"
    return transformers.Llama4ForCausalLM(config).eval()


def _mllama() -> nn.Module:
    vision = {
        "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_global_layers": 1,
        "num_attention_heads": 4, "image_size": 28, "patch_size": 14, "max_num_tiles": 1, "vision_output_dim": 64,
        "intermediate_layers_indices": [0], "supported_aspect_ratios": [[1, 1]],
    }  # fmt: skip
    text = {
        "vocab_size": 128, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "cross_attention_layers": [1],
        "max_position_embeddings": 64, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2,
    }  # fmt: skip
    config = transformers.MllamaConfig(vision_config=vision, text_config=text, image_token_index=127)
    config._attn_implementation = "eager"
    return transformers.MllamaForConditionalGeneration(config).eval()


def _saved(build, folder: Path) -> tuple[nn.Module, Path]:
    torch.manual_seed(0)
    model = build()
    model.save_pretrained(folder)
    return model, folder


def _dispatched(build, folder: Path, device_map: dict[str, str]) -> nn.Module:
    with bigviz.init_empty_weights():
        model = build()
    return bigviz.load_checkpoint_and_dispatch(model, folder, device_map)


LLAMA4_MAPS = {
    "embeddings and blocks on disk": {
        "model.embed_tokens": "disk", "model.layers": "disk", "model.norm": "cpu", "model.rotary_emb": "cpu",
        "lm_head": "cpu",
    },
    "everything on disk": {"": "disk"},
}  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("case", list(LLAMA4_MAPS))
def test_llama4_with_its_embeddings_offloaded_computes_the_logits_and_tokens_of_memory(tmp_path: Path, case: str):
    reference, folder = _saved(_llama4, tmp_path / "llama4")
    ids = torch.randint(3, 127, (2, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = reference(ids).logits
        tokens = reference.generate(ids[:1], max_new_tokens=6, do_sample=False, pad_token_id=0)
    model = _dispatched(_llama4, folder, LLAMA4_MAPS[case])
    weight = model.model.embed_tokens.weight
    assert weight.is_meta and weight.device == torch.device("cpu") and model.device == torch.device("cpu")
    with torch.no_grad():
        assert torch.equal(model(ids).logits, want)
        assert torch.equal(model.generate(ids[:1], max_new_tokens=6, do_sample=False, pad_token_id=0), tokens)
    bigviz.remove_hooks(model)
    assert model.model.embed_tokens.weight.device == torch.device("meta")  # not dispatched: plain meta again


@pytest.mark.slow
def test_mllama_with_its_patch_embedding_offloaded_computes_the_logits_of_memory(tmp_path: Path):
    reference, folder = _saved(_mllama, tmp_path / "mllama")
    g = torch.Generator().manual_seed(2)
    inputs = {
        "input_ids": torch.tensor([[127, 5, 9, 14, 3, 40]]),
        "pixel_values": torch.randn(1, 1, 1, 3, 28, 28, generator=g),
        "aspect_ratio_ids": torch.tensor([[1]]),
        "aspect_ratio_mask": torch.ones(1, 1, 1, dtype=torch.long),
        "cross_attention_mask": torch.ones(1, 6, 1, 1, dtype=torch.long),
    }
    with torch.no_grad():
        want = reference(**inputs).logits
    device_map = {
        "model.vision_model.patch_embedding": "disk",
        "model.vision_model.transformer": "disk",
        "model.vision_model": "cpu",
        "model.language_model.layers": "disk",
        "model.language_model": "cpu",
        "model.multi_modal_projector": "cpu",
        "lm_head": "cpu",
    }
    model = _dispatched(_mllama, folder, device_map)
    assert model.model.vision_model.patch_embedding.weight.device == torch.device("cpu")
    with torch.no_grad():
        assert torch.equal(model(**inputs).logits, want)


def _project(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return nn.functional.linear(x, module.weight.T.contiguous())  # a helper: no bytecode of the parent shows it


def _embed(module: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return nn.functional.embedding(ids, module.weight)


class _ReadsChild(nn.Module):
    """A parent that computes with its child's weight without calling the child, through a
    helper bigviz's reading of ``forward``'s bytecode does not see."""

    def __init__(self) -> None:
        super().__init__()
        self.child = nn.Linear(4, 4)
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(_project(self.child, x))


class _EmbedsByChild(nn.Module):
    """The same with an embedding: ``F.embedding`` of real ids and a meta weight returns
    uninitialised memory in torch, without an error."""

    def __init__(self) -> None:
        super().__init__()
        self.child = nn.Embedding(10, 4)
        self.head = nn.Linear(4, 2)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(_embed(self.child, ids))


@pytest.mark.parametrize("make, x", [(_ReadsChild, torch.ones(1, 4)), (_EmbedsByChild, torch.tensor([[1, 2]]))])
def test_a_weight_read_outside_its_forward_is_refused_naming_it(tmp_path: Path, make, x: torch.Tensor):
    torch.manual_seed(0)
    model = make().eval()
    with torch.no_grad():
        want = model(x)
    model = bigviz.dispatch_model(model, {"child": "disk", "head": "cpu"}, offload_folder=tmp_path / "off")
    for _ in range(2):  # and again: nothing was left half set
        with torch.no_grad(), pytest.raises(OffloadedWeightError, match="'child.weight'.*preload_module_classes"):
            model(x)
        assert model.child.weight.is_meta
    bigviz.remove_hooks(model)
    model = bigviz.dispatch_model(
        model, {"child": "disk", "head": "cpu"}, offload_folder=tmp_path / "off", preload_module_classes=[make.__name__]
    )
    with torch.no_grad():
        assert torch.equal(model(x), want)  # the fix the error names works
