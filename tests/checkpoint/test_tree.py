"""tree_from_checkpoint and detect_no_split: planning inputs from headers alone."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from bigviz.checkpoint.save import save_sharded
from bigviz.checkpoint.tree import detect_no_split, tree_from_checkpoint
from bigviz.core.names import natural_order
from bigviz.modeling.sizes import module_tree


@pytest.mark.parametrize("fixture", ["tiny_gpt", "tiny_llama", "hf_gpt2", "hf_llama"])
def test_tree_from_headers_matches_the_model(tmp_path: Path, request: pytest.FixtureRequest, fixture: str) -> None:
    model: nn.Module = request.getfixturevalue(fixture)
    folder = save_sharded(model, tmp_path / "c", max_shard_size="50KB", progress=False)
    from_ckpt = tree_from_checkpoint(folder)
    from_model = module_tree(model)
    persistent = set(model.state_dict())
    stored = {n for n in persistent if n not in from_model.leader_of}  # tied duplicates are not saved
    assert set(from_ckpt.tensors) == stored
    for name in stored:
        assert from_ckpt.tensors[name].nbytes == from_model.tensors[name].nbytes, name
        assert from_ckpt.tensors[name].shape == from_model.tensors[name].shape, name
    non_persistent = sum(from_model.tensors[n].nbytes for n in from_model.tensors if n not in persistent)
    assert from_ckpt.total("") == from_model.total("") - non_persistent
    for module in from_ckpt.nodes:
        expected = from_model.total(module) - sum(
            from_model.tensors[n].nbytes for n in from_model.subtree_tensors(module) if n not in persistent
        )
        assert from_ckpt.total(module) == expected, module


def test_dtype_resizes_floating_tensors_only(tmp_path: Path) -> None:
    state = {"a.w": torch.ones(10), "a.i": torch.ones(10, dtype=torch.int64)}
    folder = save_sharded(state, tmp_path / "c", progress=False)
    assert tree_from_checkpoint(folder).total("") == 40 + 80
    assert tree_from_checkpoint(folder, dtype="float16").total("a") == 20 + 80
    assert tree_from_checkpoint(folder, dtype=torch.bfloat16).total("") == 20 + 80


def test_module_order_is_numeric_for_alphabetical_headers() -> None:
    names = sorted(f"model.layers.{i}.w" for i in range(12)) + ["model.embed.w"]
    ordered = natural_order(names)
    assert ordered[:3] == ["model.layers.0.w", "model.layers.1.w", "model.layers.2.w"]
    assert ordered[-2:] == ["model.layers.11.w", "model.embed.w"]


def test_detect_no_split_on_real_models(tiny_gpt: nn.Module, hf_llama: nn.Module, hf_bert: nn.Module) -> None:
    assert detect_no_split(list(tiny_gpt.state_dict())) == ["transformer.h.*"]
    assert detect_no_split(list(hf_llama.state_dict())) == ["model.layers.*"]
    assert detect_no_split(list(hf_bert.state_dict())) == ["encoder.layer.*"]


def test_detect_no_split_rules() -> None:
    assert detect_no_split(["h.0.w", "h.1.w"]) == ["h.*"]
    assert detect_no_split(["h.0.w", "h.1.v"]) == []  # different structure
    assert detect_no_split(["h.0.w"]) == []  # one block is no repeat
    assert detect_no_split(["h.0.w", "h.2.w"]) == []  # not 0..N-1
    assert detect_no_split(["h.0.w", "h.1.w", "h.extra.w"]) == []  # not a list of blocks
    nested = [f"blocks.{i}.experts.{j}.w" for i in range(2) for j in range(3)]
    assert detect_no_split(nested) == ["blocks.*"]  # the outer repeat only
    assert detect_no_split(["0.w", "1.w"]) == ["[0-9]*"]  # never "*", which matches the root ""


def test_ties_inside_a_pickle_count_once(tmp_path: Path, hf_gpt2: nn.Module) -> None:
    torch.save(hf_gpt2.state_dict(), tmp_path / "pytorch_model.bin")  # keeps lm_head.weight, tied
    tree = tree_from_checkpoint(tmp_path)
    assert tree.leader_of == {"lm_head.weight": "transformer.wte.weight"}
    assert tree.total("") == module_tree(hf_gpt2).total("")
