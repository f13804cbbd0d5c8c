"""A config.json with the non-finite floats transformers writes as ``{"__float__": ...}``
(Mamba-2's ``time_step_limit = (0.0, inf)``) builds the model, so a checkpoint folder is
planned in the model's names, its computed buffers included (tests/zoo: Bamba, Falcon-H1)."""

from __future__ import annotations


import pytest

from bigviz.checkpoint.hf import meta_model_from_folder
from bigviz.modeling.configs import checked_config, hf_config

transformers = pytest.importorskip("transformers")


def test_tagged_non_finite_floats_are_decoded_as_transformers_decodes_them(tmp_path):
    config = transformers.Mamba2Config(
        vocab_size=32,
        hidden_size=16,
        num_hidden_layers=1,
        num_heads=4,
        head_dim=8,
        state_size=4,
        n_groups=1,
        architectures=["Mamba2ForCausalLM"],
    )
    config.save_pretrained(tmp_path)
    assert "__float__" in (tmp_path / "config.json").read_text()  # what transformers writes for inf
    data, where = checked_config(tmp_path / "config.json")
    built = hf_config(data, where)
    assert list(built.time_step_limit) == [0.0, float("inf")]
    assert meta_model_from_folder(tmp_path) is not None
