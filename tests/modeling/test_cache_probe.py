"""What a run's cache keeps, read from the model itself: a twin built on meta runs a short
prefill and a decode step through the architecture's own cache classes (no memory, nothing
downloaded), and the rules that follow the installed transformers.

The per-architecture end-to-end check (the plan against a real ``generate``) is in
``tests/zoo/test_zoo_run.py``; here: the probe's parts, on tiny configs."""

from __future__ import annotations

import sys
import warnings

import pytest
import torch

import bigviz
from bigviz.modeling import cache_probe, workload
from bigviz.modeling.twin import computed_buffer_dtypes, meta_twin

transformers = pytest.importorskip("transformers")
T = transformers


def _meta(config: object, cls: type | None = None) -> torch.nn.Module:
    with warnings.catch_warnings(), torch.device("meta"):
        warnings.simplefilter("ignore")
        return (cls or T.AutoModelForCausalLM).from_config(config) if cls is None else cls(config)


def test_a_mamba_layer_holds_a_conv_state_in_the_compute_dtype_and_a_float32_ssm_state():
    model = _meta(T.MambaConfig(hidden_size=16, state_size=4, num_hidden_layers=2, vocab_size=32, expand=2))
    probe = cache_probe.probe_cache(model, 2)
    assert probe is not None
    inner, kernel = 32, model.config.conv_kernel
    assert probe.layers[0] == cache_probe.LayerCache(states=((inner * kernel, None), (inner * 4, "float32")))
    # the state does not grow with the context; in bfloat16 the conv state halves, the SSM one stays
    assert bigviz.kv_cache_bytes(model, 3, 10) == bigviz.kv_cache_bytes(model, 3, 10_000)
    assert bigviz.kv_cache_bytes(model, 3, 10, dtype="bfloat16")["backbone.layers.0"] == 3 * (
        inner * kernel * 2 + inner * 4 * 4
    )


def test_a_hybrid_layer_holds_a_state_and_keys_and_values_at_once():
    """Falcon-H1: every layer runs attention and a Mamba-2 mixer side by side."""
    config = T.FalconH1Config(
        vocab_size=32, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, mamba_n_heads=4, mamba_d_ssm=64, mamba_d_head=16, mamba_d_state=8,
        mamba_n_groups=1, mamba_expand=2, mamba_d_conv=4, mamba_chunk_size=8,
    )  # fmt: skip
    spec = workload.run_spec(_meta(config), dtype="float32")
    kinds = [sorted(s.kind for s in specs) for specs in spec.caches.values()]
    assert kinds == [["full_attention", "state"]] * 2
    conv, ssm = (64 + 2 * 8) * 4, 4 * 16 * 8  # conv over inner + 2 x groups x state; heads x head_dim x state
    assert workload.kv_cache_bytes(config, 1, 10) == {
        f"model.layers.{i}": (10 * 2 * 8 * 2 + conv + ssm) * 4 for i in range(2)
    }


def test_zamba2_attention_is_as_wide_as_its_cache_not_as_its_hidden_size():
    config = T.Zamba2Config(
        vocab_size=32, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, layers_block_type=["mamba", "hybrid"], mamba_d_state=8, mamba_headdim=8,
        n_mamba_heads=8, mamba_ngroups=1, mamba_expand=2, mamba_d_conv=4, chunk_size=8, use_mem_rope=True,
    )  # fmt: skip
    probe = cache_probe.probe_cache(_meta(config), 2)
    assert probe is not None and probe.layers[0].per_token == ()
    assert probe.layers[1].per_token == (4 * 16, 4 * 16)  # 4 heads of 2 x 32 / 4: the input is [hidden, embeddings]


def test_states_a_model_keeps_on_its_modules_belong_to_their_layer():
    config = T.RecurrentGemmaConfig(
        vocab_size=32, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=1, lru_width=48, attention_window_size=8, conv1d_width=4,
        block_types=["recurrent", "recurrent", "attention"],
    )  # fmt: skip
    kv = bigviz.kv_cache_bytes(_meta(config), 2, 100)
    state = 2 * (48 * 4 * 4 + 48 * 4)  # conv (its last 4 inputs, float32 here), RG-LRU state (float32)
    assert kv == {"model.layers.0": state, "model.layers.1": state, "model.layers.2": 2 * 8 * 2 * 8 * 4}


def test_a_recurrent_model_that_cannot_be_stepped_on_meta_is_refused_saying_what_to_give(monkeypatch):
    mamba = _meta(T.MambaConfig(hidden_size=16, state_size=4, num_hidden_layers=2, vocab_size=32))
    monkeypatch.setattr(workload, "probe_cache", lambda *a, **k: None)
    with pytest.raises(ValueError, match="kv_cache="):
        bigviz.kv_cache_bytes(mamba, 1, 10)


@pytest.mark.parametrize(("version", "latent"), [("4.57.1", False), ("5.14.2", False), ("5.15.0", True), ("6.0", True)])
def test_deepseeks_latent_is_cached_from_transformers_5_15(monkeypatch, version: str, latent: bool):
    """The rule follows the installed version: before 5.15 transformers cached every head's
    keys and values, then the latent."""
    config = T.DeepseekV3Config(
        hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, vocab_size=32, kv_lora_rank=24, q_lora_rank=48,
        qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, n_routed_experts=4, num_experts_per_tok=2,
        n_group=1, topk_group=1, first_k_dense_replace=1,
    )  # fmt: skip
    model = _meta(config)
    installed = cache_probe.probe_cache(model, 2)  # what the installed transformers (5.24 here) allocates
    assert installed is not None and installed.layers[0].per_token == (24, 8)
    assert bigviz.kv_cache_bytes(model, 1, 10)["model.layers.0"] == 10 * (24 + 8) * 4
    monkeypatch.setattr(sys.modules["transformers"], "__version__", version)  # the module imported now
    per_token = (24 + 8) if latent else 4 * ((16 + 8) + 16)
    assert bigviz.kv_cache_bytes(model, 1, 10)["model.layers.0"] == 10 * per_token * 4


def test_mllama_cross_attention_layers_cache_one_images_vision_states_whatever_the_text():
    from tests.zoo.specs import MLLAMA, build_config

    with torch.device("meta"):
        model = T.MllamaForConditionalGeneration(build_config(MLLAMA))
    vision = 1 * 2 * ((16 // 8) ** 2 + 1)  # images x tiles x (patches + 1)
    assert cache_probe.source_layers(model, 4) == {1: vision, 3: vision}
    assert "_previous_max_cache_length" not in model.__dict__  # transformers' hook left nothing behind
    per_token = 2 * 8 * 2 * 4  # 2 kv heads of 8, keys and values, float32
    short, long = bigviz.kv_cache_bytes(model, 1, 10), bigviz.kv_cache_bytes(model, 1, 1000)
    names = sorted(short)
    assert [short[n] for n in names] == [10 * per_token, vision * per_token] * 2
    assert [long[n] for n in names] == [1000 * per_token, vision * per_token] * 2
    two_images = bigviz.kv_cache_bytes(model, 1, 10, encoder_length=2 * vision)
    assert two_images[names[1]] == 2 * vision * per_token


def test_computed_buffers_take_the_dtype_from_pretrained_gives_them(tmp_path):
    """Falcon-H1's ``mup_vector`` is made under the default dtype (bfloat16 under dtype=bfloat16);
    a rotary ``inv_freq`` is computed in float32 on purpose and stays so."""
    config = T.FalconH1Config(
        vocab_size=32, hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, mamba_n_heads=4, mamba_d_ssm=64, mamba_d_head=16, mamba_d_state=8,
        mamba_n_groups=1, mamba_expand=2, mamba_d_conv=4, mamba_chunk_size=8,
    )  # fmt: skip
    torch.manual_seed(0)
    T.FalconH1ForCausalLM(config).save_pretrained(tmp_path)
    theirs = T.FalconH1ForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    with bigviz.init_empty_weights():
        ours = T.FalconH1ForCausalLM(config)
    assert computed_buffer_dtypes(ours, torch.bfloat16)["model.layers.0.mamba.mup_vector"] == torch.bfloat16
    ours = bigviz.load_checkpoint_and_dispatch(ours, tmp_path, {"": "cpu"}, dtype=torch.bfloat16)
    expected = {n: b.dtype for n, b in theirs.named_buffers()}
    assert {n: b.dtype for n, b in ours.named_buffers()} == expected
    assert expected["model.layers.0.mamba.mup_vector"] == torch.bfloat16
    assert expected["model.rotary_emb.inv_freq"] == torch.float32
    for name, buffer in theirs.named_buffers():
        assert torch.equal(dict(ours.named_buffers())[name], buffer), name


def test_a_twin_is_built_once_per_config_and_dtype_and_leaves_the_model_alone():
    model = _meta(T.MambaConfig(hidden_size=16, state_size=4, num_hidden_layers=1, vocab_size=32))
    config = model.config.to_dict()
    twin = meta_twin(model, torch.bfloat16)
    assert twin is meta_twin(model, torch.bfloat16) and twin is not model
    assert next(twin.parameters()).dtype == torch.bfloat16 and next(model.parameters()).dtype == torch.float32
    assert model.config.to_dict() == config
    assert meta_twin(torch.nn.Linear(2, 2), torch.bfloat16) is None


def test_attention_widths_come_from_the_model_where_the_config_counts_otherwise():
    """Falcon's original multi-query layout keeps one key/value head whatever its config's
    ``num_kv_heads`` says: the plan follows the cache the model fills, not the config's rule."""
    config = T.FalconConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, multi_query=True,
        new_decoder_architecture=False, parallel_attn=True,
    )  # fmt: skip
    assert config.num_kv_heads == 4  # what a rule over config fields reads
    model = _meta(config)
    one_head = 10 * 1 * (8 + 8) * 4  # 10 tokens x 1 head x (key 8 + value 8) x float32
    assert bigviz.kv_cache_bytes(model, 1, 10) == {f"transformer.h.{i}": one_head for i in range(2)}


def test_layers_alike_are_stepped_once_and_each_layer_keeps_its_own_kind():
    """Gemma 2 alternates sliding and full layers: two layers are stepped (one of each), and
    every layer still gets the cache of its own kind."""
    config = T.Gemma2Config(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=6, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, sliding_window=8,
    )  # fmt: skip
    model = _meta(config)
    names = [f"model.layers.{i}" for i in range(6)]
    kinds = list(config.layer_types)
    assert cache_probe.representatives(model, names, kinds) == [0, 1, 0, 1, 0, 1]
    assert cache_probe.representatives(model, names, [str(i) for i in range(6)]) is None  # none alike
    per_layer = bigviz.kv_cache_bytes(model, 1, 100)
    full, window = 100 * 2 * 16 * 4, 8 * 2 * 16 * 4  # tokens x kv heads x (key 8 + value 8) x float32
    expected = [window if kind == "sliding_attention" else full for kind in kinds]
    assert list(per_layer.values()) == expected
