"""A plan's bytes are the loaded model's, buffers the model computes itself included: transformers
keeps rotary ``inv_freq`` in float32 in a bfloat16 model (computed so on purpose), and bigviz's
loader materialises the buffers of other models in the dtype they were built with. Planned from
the model on meta and from the checkpoint's headers, in float32, bfloat16 and float16, the plan
holds what ``load_checkpoint_and_dispatch`` then holds, byte for byte."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

import bigviz
from bigviz.models import GPT, GPTConfig, Llama, LlamaConfig
from bigviz.planning.models import computed_dtypes
from bigviz.ui.presets import DTYPE_CHOICES


def _hf(name: str) -> torch.nn.Module:
    import transformers

    small = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, vocab_size=128)
    if name == "llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**small, num_key_value_heads=1))
    if name == "gemma2":
        return transformers.Gemma2ForCausalLM(transformers.Gemma2Config(**small, num_key_value_heads=1, head_dim=16))
    if name == "qwen2":
        return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**small, num_key_value_heads=1))
    if name == "phi3-longrope":  # two computed factor tables beside inv_freq
        rope = {"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8}
        config = transformers.Phi3Config(
            **small,
            num_key_value_heads=1,
            max_position_embeddings=256,
            original_max_position_embeddings=64,
            rope_scaling=rope,
            pad_token_id=0,
        )
        return transformers.Phi3ForCausalLM(config)
    if name == "gpt2":
        return transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=128))
    raise KeyError(name)


MODELS = {
    "llama": lambda: _hf("llama"),
    "gemma2": lambda: _hf("gemma2"),
    "qwen2": lambda: _hf("qwen2"),
    "phi3-longrope": lambda: _hf("phi3-longrope"),
    "gpt2": lambda: _hf("gpt2"),
    "bigviz-llama": lambda: Llama(LlamaConfig.preset("llama-tiny", n_layers=2)),
    "bigviz-gpt": lambda: GPT(GPTConfig.preset("gpt-tiny", n_layer=2)),
}


def _held(model: torch.nn.Module) -> int:
    tensors = {id(t): t for t in (*model.parameters(), *model.buffers())}
    return sum(t.numel() * t.element_size() for t in tensors.values())


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = {}
    for name, make in MODELS.items():
        torch.manual_seed(0)
        model = make().eval()
        folder = tmp_path_factory.mktemp(name)
        if isinstance(model, (GPT, Llama)):
            bigviz.save_sharded(model, folder, config=model.config, progress=False)
        else:
            model.save_pretrained(folder)
        out[name] = folder
    return out


@pytest.mark.parametrize("dtype", [None, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", list(MODELS))
def test_planned_bytes_are_the_loaded_models_computed_buffers_included(folders, name, dtype, tmp_path):
    with bigviz.init_empty_weights():
        empty = MODELS[name]()
    budget = {"cpu": "1GiB"}
    from_model = bigviz.plan(empty, budget, dtype=dtype).usage_of("cpu").used
    from_headers = bigviz.plan(folders[name], budget, dtype=dtype).usage_of("cpu").used
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loaded = bigviz.load_checkpoint_and_dispatch(empty, folders[name], "auto", max_memory=budget, dtype=dtype)
    assert from_model == from_headers == _held(loaded), (from_model, from_headers, _held(loaded))


def test_the_computed_dtypes_are_what_the_loader_gives_and_a_given_dtype_wins():
    llama = _hf("llama")
    assert computed_dtypes(llama, "bfloat16") == {
        "model.rotary_emb.inv_freq": torch.float32,
        "model.rotary_emb.original_inv_freq": torch.float32,
    }
    assert computed_dtypes(llama, None) is None and computed_dtypes(llama, torch.float32) is None  # nothing differs
    given = {"model.rotary_emb": torch.float16}  # a module name covers its buffers: what it says is kept
    assert computed_dtypes(llama, "bfloat16", given) == given
    tree = bigviz.plan(llama, {"cpu": "1GiB"}, dtype="bfloat16", special_dtypes=given).tree
    assert tree.tensors["model.rotary_emb.inv_freq"].dtype == "float16"
    bigviz_llama = Llama(LlamaConfig.preset("llama-tiny", n_layers=1))
    computed = computed_dtypes(bigviz_llama, "float16")
    assert computed and all(d == torch.float32 for d in computed.values())  # as built: the loader keeps them


def test_the_planner_sizes_computed_buffers_as_bigviz_plan_does():
    """The Planner's dtype box and its constructor size a float dtype with bigviz.plan's rule."""
    from bigviz.ui.planner import Planner

    with bigviz.init_empty_weights():
        llama = _hf("llama")
    budget = {"cpu": "1GiB"}
    widget = Planner(llama, budget, dtype="bfloat16", live=False)
    api = bigviz.plan(llama, budget, dtype="bfloat16")
    assert widget.plan.usage_of("cpu").used == api.usage_of("cpu").used
    label = next(k for k, v in DTYPE_CHOICES.items() if v == "float16")
    widget.controls.dtype.value = label  # as a user picks it
    assert widget.state.dtype == "float16"
    assert widget.plan.usage_of("cpu").used == bigviz.plan(llama, budget, dtype="float16").usage_of("cpu").used
    widget.close()
