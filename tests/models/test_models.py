"""The reference models: shapes, sizes of the real presets, names, ties, the KV cache,
generation, and numerical agreement with the transformers implementations."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from bigviz.models import (
    GPT,
    PRESETS,
    Block,
    GPTConfig,
    KVCache,
    Llama,
    LlamaConfig,
    LlamaDecoderLayer,
    build,
)
from bigviz.models.cache import causal_attention
from bigviz.models.generation import next_token
from bigviz.models.llama import RotaryEmbedding, repeat_kv

CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")


def n_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())  # parameters() yields a tied one once


def gpt_params(n_layer: int, n_embd: int, vocab: int = 50257, block: int = 1024) -> int:
    c = n_embd
    per_block = 4 * c + (3 * c * c + 3 * c) + (c * c + c) + (4 * c * c + 4 * c) + (4 * c * c + c)
    return vocab * c + block * c + n_layer * per_block + 2 * c  # lm_head tied to wte


def llama_params(dim: int, layers: int, heads: int, kv: int, ffn: int, vocab: int = 32000) -> int:
    kv_dim = dim // heads * kv
    per_layer = 2 * dim * dim + 2 * dim * kv_dim + 3 * dim * ffn + 2 * dim
    return 2 * vocab * dim + layers * per_layer + dim  # untied embed_tokens and lm_head


def tokens(vocab: int, *shape: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(seed))


# --- shapes and loss ---------------------------------------------------------------------


@pytest.mark.parametrize("name", ["gpt-tiny", "llama-tiny"])
def test_forward_shapes_and_loss(name: str) -> None:
    torch.manual_seed(0)
    model = build(name)
    vocab = model.config.vocab_size
    idx = tokens(vocab, 3, 7)
    logits, loss = model(idx)
    assert logits.shape == (3, 7, vocab) and loss is None
    targets = idx.roll(-1, dims=1)
    targets[:, -1] = -1  # ignored, as in nanoGPT
    logits, loss = model(idx, targets)
    expected = F.cross_entropy(logits[:, :-1].reshape(-1, vocab), targets[:, :-1].reshape(-1))
    assert loss is not None and loss.shape == ()
    torch.testing.assert_close(loss, expected)
    loss.backward()  # trains: gradients reach the embeddings
    assert model.lm_head.weight.grad is not None


def test_gpt_rejects_context_longer_than_block_size(tiny_gpt: GPT) -> None:
    with pytest.raises(ValueError, match="block_size=64"):
        tiny_gpt(torch.zeros(1, 65, dtype=torch.long))


# --- sizes of the real presets, built on meta --------------------------------------------

SIZES = [
    ("gpt2", gpt_params(12, 768), 124e6),
    ("gpt2-medium", gpt_params(24, 1024), 355e6),
    ("gpt2-large", gpt_params(36, 1280), 774e6),
    ("gpt2-xl", gpt_params(48, 1600), 1.558e9),
    ("llama-7b", llama_params(4096, 32, 32, 32, 11008), 6.74e9),
    ("llama-13b", llama_params(5120, 40, 40, 40, 13824), 13.0e9),
    ("llama-70b", llama_params(8192, 80, 64, 8, 28672), 69.0e9),
]


@pytest.mark.parametrize("name, exact, published", SIZES, ids=[s[0] for s in SIZES])
def test_preset_parameter_counts_on_meta(name: str, exact: int, published: float) -> None:
    with torch.device("meta"):
        model = build(name)
    assert all(p.is_meta for p in model.parameters())  # nothing was allocated
    assert n_params(model) == exact
    assert abs(n_params(model) - published) / published < 0.005  # the size people quote


def test_meta_build_keeps_the_tie_and_the_block_classes() -> None:
    with torch.device("meta"):
        gpt, llama = build("gpt2-xl"), build("llama-70b")
    assert gpt.lm_head.weight is gpt.transformer.wte.weight
    assert [type(b).__name__ for b in gpt.transformer.h] == ["Block"] * 48
    assert all(type(layer) is LlamaDecoderLayer for layer in llama.model.layers)
    assert llama.config.n_kv_heads == 8
    assert llama.model.layers[0].self_attn.k_proj.out_features == 8 * 128  # kv heads x head_dim


def test_meta_model_runs_shape_inference() -> None:
    with torch.device("meta"):
        model = build("llama-tiny")
        logits, _ = model(torch.zeros(2, 5, dtype=torch.long))
    assert logits.is_meta and logits.shape == (2, 5, 256)


# --- names, ties, no-split classes --------------------------------------------------------


def test_gpt_parameter_names_are_gpt2s(tiny_gpt: GPT, hf_gpt2: nn.Module) -> None:
    ours = {k: tuple(v.shape) for k, v in tiny_gpt.state_dict().items()}
    theirs = {k: tuple(v.shape) for k, v in hf_gpt2.state_dict().items()}
    assert set(ours) == set(theirs)
    assert "transformer.h.0.attn.c_attn.weight" in ours
    for name, shape in theirs.items():  # Conv1D stores (in, out); nn.Linear stores (out, in)
        assert ours[name] == (shape[::-1] if name.endswith(CONV1D) else shape), name


def test_llama_parameter_names_are_hf_llamas(tiny_llama: Llama, hf_llama: nn.Module) -> None:
    ours = {k: tuple(v.shape) for k, v in tiny_llama.state_dict().items()}
    theirs = {k: tuple(v.shape) for k, v in hf_llama.state_dict().items()}
    assert ours == theirs
    assert "model.layers.1.self_attn.k_proj.weight" in ours
    assert "model.rotary_emb.inv_freq" in dict(tiny_llama.named_buffers())  # a buffer, never saved


def test_gpt_head_is_tied_to_the_token_embedding(tiny_gpt: GPT) -> None:
    assert tiny_gpt.lm_head.weight is tiny_gpt.transformer.wte.weight
    state = tiny_gpt.state_dict()
    assert state["lm_head.weight"].data_ptr() == state["transformer.wte.weight"].data_ptr()
    untied = GPT(GPTConfig.preset("gpt-tiny", tie_weights=False))
    assert untied.lm_head.weight is not untied.transformer.wte.weight
    assert n_params(untied) == n_params(tiny_gpt) + 128 * 32


def test_llama_tie_is_optional() -> None:
    tied = build("llama-tiny", tie_weights=True)
    assert tied.lm_head.weight is tied.model.embed_tokens.weight
    assert tied._tied_weights_keys == ["lm_head.weight"]
    assert build("llama-tiny")._tied_weights_keys == []


def test_no_split_modules_name_the_block_classes(tiny_gpt: GPT, tiny_llama: Llama) -> None:
    for model in (tiny_gpt, tiny_llama):
        classes = {type(m).__name__ for m in model.modules()}
        assert set(model._no_split_modules) <= classes
    assert GPT._no_split_modules == ["Block"] and Block.__name__ == "Block"
    assert Llama._no_split_modules == ["LlamaDecoderLayer"]
    assert GPT._skip_keys_device_placement == ["cache"] == Llama._skip_keys_device_placement


def test_blocks_need_only_their_own_parameters(tiny_gpt: GPT, tiny_llama: Llama) -> None:
    # what a dispatch engine relies on: everything outside a block may live elsewhere (meta)
    block, x = tiny_gpt.transformer.h[1], torch.randn(2, 5, 32)
    expected = block(x)
    t = tiny_gpt.transformer
    for module in (t.wte, t.wpe, t.h[0], t.ln_f, tiny_gpt.lm_head):
        module.to("meta")
    assert t.h[0].attn.c_attn.weight.is_meta and not any(p.is_meta for p in block.parameters())
    torch.testing.assert_close(block(x), expected)

    layer, h = tiny_llama.model.layers[0], torch.randn(1, 5, 64)
    cos, sin = tiny_llama.model.rotary_emb(torch.arange(5), dtype=torch.float32)
    expected = layer(h, cos, sin)
    m = tiny_llama.model
    for module in (m.embed_tokens, m.layers[1], m.norm, m.rotary_emb, tiny_llama.lm_head):
        module.to("meta")
    torch.testing.assert_close(layer(h, cos, sin), expected)


# --- presets and configs ------------------------------------------------------------------


def test_unknown_preset_lists_the_valid_ones() -> None:
    with pytest.raises(ValueError, match="gpt2-xl") as err:
        GPTConfig.preset("gpt3")
    assert "gpt-tiny" in str(err.value)
    with pytest.raises(ValueError, match="llama-70b"):
        LlamaConfig.preset("llama-8b")
    with pytest.raises(ValueError) as err:
        build("falcon-7b")
    assert all(name in str(err.value) for name in PRESETS)


def test_preset_overrides_and_bad_fields() -> None:
    cfg = GPTConfig.preset("gpt2", n_layer=3, vocab_size=1000)
    assert (cfg.n_layer, cfg.n_head, cfg.vocab_size) == (3, 12, 1000)
    with pytest.raises(TypeError, match="n_layers"):
        GPTConfig.preset("gpt2", n_layers=3)  # Llama's spelling, not GPT's
    assert type(build("gpt-mini")) is GPT and type(build("llama-tiny")) is Llama


def test_config_errors_are_collected() -> None:
    with pytest.raises(ValueError, match="n_embd=100 must be divisible by n_head=3"):
        GPTConfig(n_embd=100, n_head=3)
    with pytest.raises(ValueError) as err:
        LlamaConfig(dim=66, n_heads=6, n_kv_heads=4)  # head_dim 11 (odd) and 6 % 4 != 0
    assert "head_dim=11" in str(err.value) and "n_kv_heads=4" in str(err.value)
    assert LlamaConfig(dim=64, n_heads=4).n_kv_heads == 4  # default: no grouping


# --- the KV cache -------------------------------------------------------------------------


def test_kv_cache_bookkeeping() -> None:
    cache = KVCache()
    assert cache.seq_len == 0 and cache.nbytes == 0
    k = torch.zeros(1, 2, 3, 4)
    cache.update(1, k, k)  # layer 1 first: slots are made as needed
    assert cache.seq_len == 0 and len(cache) == 2
    cache.update(0, k, k)
    keys, values = cache.update(0, torch.ones(1, 2, 2, 4), torch.ones(1, 2, 2, 4))
    assert keys.shape == (1, 2, 5, 4) and cache.seq_len == 5
    assert torch.equal(keys[:, :, 3:], torch.ones(1, 2, 2, 4)) and values.sum() == 16
    assert cache.nbytes == (5 + 5 + 3 + 3) * 2 * 4 * 4
    cache.reset()
    assert cache.seq_len == 0 and len(cache) == 0


def test_causal_attention_for_a_chunk_after_a_cache() -> None:
    torch.manual_seed(0)
    q, k, v = torch.randn(3, 2, 2, 7, 8).unbind(0)
    full = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, nh, 7, hd)
    torch.testing.assert_close(causal_attention(q[:, :, 4:], k, v), full[:, :, 4:])
    torch.testing.assert_close(causal_attention(q[:, :, 6:], k, v), full[:, :, 6:])


@pytest.mark.parametrize("fixture", ["tiny_gpt", "tiny_llama"])
def test_cached_forward_matches_full_forward(fixture: str, request: pytest.FixtureRequest) -> None:
    model = request.getfixturevalue(fixture)
    idx = tokens(model.config.vocab_size, 2, 12)
    full, _ = model(idx)  # (B, 12, V)
    cache = KVCache()
    first, _ = model(idx[:, :7], cache=cache)  # prefill 7
    chunk, _ = model(idx[:, 7:10], cache=cache)  # a chunk of 3 on top of the cache
    last, _ = model(idx[:, 10:11], cache=cache)  # one token at a time
    final, _ = model(idx[:, 11:], cache=cache)
    assert cache.seq_len == 12
    stitched = torch.cat([first, chunk, last, final], dim=1)
    torch.testing.assert_close(stitched, full, rtol=1e-4, atol=1e-5)


def test_llama_cache_keeps_only_the_kv_heads(tiny_llama: Llama) -> None:
    cache = KVCache()
    tiny_llama(tokens(256, 1, 5), cache=cache)
    assert len(cache) == 2 and cache.keys[0].shape == (1, 2, 5, 16)  # 2 kv heads, not 4


def test_gpt_cache_holds_its_keys_and_values_only_after_a_prefill(tiny_gpt: GPT) -> None:
    """The prefill's keys and values are cached on their own, not as views of the fused q/k/v
    projection (which kept 1.5x the cache alive until the first decode step, above the plan)."""
    cache = KVCache()
    tiny_gpt(tokens(tiny_gpt.config.vocab_size, 2, 7), cache=cache)
    for k, v in zip(cache.keys, cache.values):
        assert k is not None and v is not None
        assert k.untyped_storage().nbytes() == v.untyped_storage().nbytes() == k.numel() * k.element_size()


def test_grouped_query_attention_equals_repeated_heads(tiny_llama: Llama) -> None:
    # an MHA model whose k/v heads are GQA's heads repeated must compute the same thing
    mha = Llama(LlamaConfig.preset("llama-tiny", n_kv_heads=4)).eval()
    state = tiny_llama.state_dict()
    for key in [k for k in state if k.endswith(("k_proj.weight", "v_proj.weight"))]:
        w = state[key].view(2, 16, 64)  # (kv_heads, head_dim, dim)
        state[key] = repeat_kv(w[None], 2)[0].reshape(64, 64)
    mha.load_state_dict(state)
    idx = tokens(256, 2, 9)
    torch.testing.assert_close(mha(idx)[0], tiny_llama(idx)[0], rtol=1e-4, atol=1e-5)


# --- agreement with transformers ----------------------------------------------------------


def test_gpt_matches_transformers_gpt2(tiny_gpt: GPT, hf_gpt2: nn.Module) -> None:
    state = {k: (v.t() if k.endswith(CONV1D) else v) for k, v in hf_gpt2.state_dict().items()}
    tiny_gpt.load_state_dict(state)
    idx = tokens(128, 2, 10)
    with torch.no_grad():
        expected = hf_gpt2(idx).logits
    torch.testing.assert_close(tiny_gpt(idx)[0], expected, rtol=1e-4, atol=1e-5)


def test_llama_matches_transformers_llama(tiny_llama: Llama, hf_llama: nn.Module) -> None:
    tiny_llama.load_state_dict(hf_llama.state_dict())
    idx = tokens(256, 2, 10)
    with torch.no_grad():
        expected = hf_llama(idx).logits
    torch.testing.assert_close(tiny_llama(idx)[0], expected, rtol=1e-4, atol=1e-5)


# --- generation ---------------------------------------------------------------------------


@pytest.mark.parametrize("fixture", ["tiny_gpt", "tiny_llama"])
def test_generation_with_cache_equals_without(fixture: str, request: pytest.FixtureRequest) -> None:
    model = request.getfixturevalue(fixture)
    idx = tokens(model.config.vocab_size, 2, 5)
    cached = model.generate(idx, 20)
    assert cached.shape == (2, 25) and torch.equal(cached[:, :5], idx)
    assert torch.equal(cached, model.generate(idx, 20, use_cache=False))


def test_generation_past_the_context_window(tiny_gpt: GPT) -> None:
    idx = tokens(128, 1, 60)  # block_size is 64: the window slides after 4 tokens
    cached = tiny_gpt.generate(idx, 10)
    assert cached.shape == (1, 70)
    assert torch.equal(cached, tiny_gpt.generate(idx, 10, use_cache=False))


def test_greedy_generation_picks_the_argmax(tiny_llama: Llama) -> None:
    idx = tokens(256, 1, 4)
    out = tiny_llama.generate(idx, 1)
    assert out[0, -1] == tiny_llama(idx)[0][0, -1].argmax()
    assert torch.equal(tiny_llama.generate(idx, 0), idx)


def test_sampling_respects_top_k() -> None:
    logits = torch.tensor([[0.0, 5.0, 1.0, 4.0, -2.0]]).repeat(400, 1)
    torch.manual_seed(0)
    picked = set(next_token(logits, do_sample=True, top_k=2).flatten().tolist())
    assert picked == {1, 3}  # the two largest, both seen in 400 draws
    torch.manual_seed(0)
    assert set(next_token(logits, do_sample=True, top_k=1).flatten().tolist()) == {1}
    torch.manual_seed(0)
    assert len(set(next_token(logits, do_sample=True, temperature=50.0).flatten().tolist())) == 5


def test_sampled_generation_with_top_k_one_is_greedy(tiny_gpt: GPT) -> None:
    idx = tokens(128, 2, 3)
    sampled = tiny_gpt.generate(idx, 8, do_sample=True, temperature=0.7, top_k=1)
    assert torch.equal(sampled, tiny_gpt.generate(idx, 8))


def test_generate_rejects_bad_arguments(tiny_gpt: GPT) -> None:
    idx = torch.zeros(1, 2, dtype=torch.long)
    with pytest.raises(ValueError) as err:
        tiny_gpt.generate(idx, -1, do_sample=True, temperature=0.0, top_k=0)
    assert all(s in str(err.value) for s in ("max_new_tokens=-1", "temperature=0.0", "top_k=0"))


# --- rotary frequencies that cannot be trusted are rebuilt ---------------------------------


def test_rotary_rebuilds_meta_and_half_precision_frequencies() -> None:
    config = LlamaConfig.preset("llama-tiny")
    reference = RotaryEmbedding(config)
    positions = torch.arange(100, 110)
    cos, sin = reference(positions, dtype=torch.float32)
    with torch.device("meta"):
        empty = RotaryEmbedding(config)  # a checkpoint never fills a non-persistent buffer
    assert empty.inv_freq.is_meta
    torch.testing.assert_close(empty(positions, dtype=torch.float32), (cos, sin))
    halved = RotaryEmbedding(config).to(torch.bfloat16)  # model.half() rounds the buffer
    cos16, _ = halved(positions, dtype=torch.bfloat16)
    assert torch.equal(cos16, cos.to(torch.bfloat16))


def test_bfloat16_llama_stays_close_to_float32(tiny_llama: Llama) -> None:
    idx = tokens(256, 1, 12)
    expected = tiny_llama(idx)[0]
    got = tiny_llama.to(torch.bfloat16)(idx)[0]
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), expected, rtol=0.05, atol=0.05)


# --- the shipped trained GPT ---------------------------------------------------------------


def test_the_shipped_tiny_gpt_writes_the_text_it_learned() -> None:
    """bigviz.models.tiny_gpt knows its corpus by heart: from the start of each paragraph,
    greedy decoding writes the paragraph's next 24 bytes (readable text, not one token)."""
    from bigviz.models import decode_bytes, encode_bytes, tiny_corpus, tiny_gpt

    model = tiny_gpt()
    assert not model.training and model.lm_head.weight is model.transformer.wte.weight
    paragraphs = [p for p in tiny_corpus().split("\n\n") if p.strip()]
    assert len(paragraphs) >= 15
    recalled = 0
    for paragraph in paragraphs:
        prompt = paragraph[:16]
        text = decode_bytes(model.generate(encode_bytes(prompt), 24)[0])
        recalled += text == paragraph[:40]
    assert recalled >= len(paragraphs) - 1, f"{recalled} of {len(paragraphs)} paragraphs recalled"


def test_the_shipped_checkpoint_folder_loads_like_any_other(tmp_path) -> None:
    """tiny_gpt_folder() is a checkpoint with its config: planned from its headers, half on
    disk, loaded by bigviz's engine, it writes what tiny_gpt() writes."""
    import json

    import bigviz
    from bigviz.models import GPTConfig, encode_bytes, tiny_gpt, tiny_gpt_folder

    folder = tiny_gpt_folder()
    config = json.loads((folder / "config.json").read_text())
    assert config.pop("model_type") == GPTConfig.model_type
    weights = bigviz.compute_module_sizes(tiny_gpt())[""]
    plan = bigviz.plan(folder, {"cpu": weights // 2})
    assert set(plan.device_map.values()) == {"cpu", "disk"}
    with bigviz.init_empty_weights():
        model = GPT(GPTConfig(**config))
    model = bigviz.load_checkpoint_and_dispatch(model, folder, device_map=plan)
    try:
        prompt = encode_bytes("A device map ")
        assert torch.equal(model.generate(prompt, 30), tiny_gpt().generate(prompt, 30))
    finally:
        bigviz.remove_hooks(model)


# --- GPU (skipped without CUDA) -----------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("fixture", ["tiny_gpt", "tiny_llama"])
def test_generation_on_cuda_matches_cpu(fixture: str, request: pytest.FixtureRequest) -> None:
    model = request.getfixturevalue(fixture)
    idx = tokens(model.config.vocab_size, 2, 5)
    expected = model.generate(idx, 10)
    got = model.to("cuda").generate(idx.to("cuda"), 10)
    assert got.device.type == "cuda"
    assert torch.equal(got.cpu(), expected)
