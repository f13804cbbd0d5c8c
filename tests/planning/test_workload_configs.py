"""Will it fit, from a config alone: the shipped configs build on meta with their published
sizes, ``plan`` and ``kv_cache_bytes`` take config paths, ``max_context`` keeps its
definition, and ``bigviz plan CONFIG --batch --context`` prints the run."""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch
from torch import nn

import bigviz
from bigviz.cli import main
from bigviz.models import GPT, GPTConfig, LlamaConfig, build

transformers = pytest.importorskip("transformers")
GiB = 2**30

# published sizes (billions of parameters) and KV cache bytes per token at bf16
PUBLISHED = {
    "llama-3.1-8b": (8.03, 32 * 8 * 128 * 2 * 2),
    "llama-3.1-70b": (70.55, 80 * 8 * 128 * 2 * 2),
    "mixtral-8x7b": (46.70, 32 * 8 * 128 * 2 * 2),
    "qwen2.5-72b": (72.71, 80 * 8 * 128 * 2 * 2),
    "deepseek-v3": (671.03, 61 * (512 + 64) * 2),  # the latent, not 128 heads of keys and values
    "gemma-2-27b": (27.23, 46 * 16 * 128 * 2 * 2),  # under the 4096-token window every layer keeps all
}


@pytest.fixture(scope="module")
def shipped() -> dict[str, nn.Module]:
    return {name: bigviz.resolve_model(bigviz.config_path(name)) for name in PUBLISHED}


def test_the_shipped_configs_have_their_published_shapes(shipped):
    assert set(bigviz.shipped_configs()) == set(PUBLISHED)
    for name, model in shipped.items():
        billions, per_token = PUBLISHED[name]
        params = sum(p.numel() for p in model.parameters())
        assert abs(params / 1e9 - billions) < 0.01 * billions, name
        assert all(p.is_meta for p in model.parameters()) and next(model.parameters()).dtype == torch.bfloat16
        assert sum(bigviz.kv_cache_bytes(model, 1, 1000).values()) == 1000 * per_token, name


def test_gemma2_alternates_sliding_and_full_layers(shipped):
    per_layer = bigviz.kv_cache_bytes(shipped["gemma-2-27b"], 1, 32768)
    sizes = sorted(set(per_layer.values()))
    assert sizes == [4096 * 8192, 32768 * 8192]  # window-capped layers and full ones, 16 x 128 x 2 x 2 per token
    assert list(per_layer.values())[:2] == sizes  # layer 0 slides, layer 1 attends to everything


def test_llama_70b_with_32k_on_two_a100s(shipped):
    model = shipped["llama-3.1-70b"]
    budgets = {0: 80 * GiB, 1: 80 * GiB, "cpu": 340 * GiB}
    plan = bigviz.plan(model, budgets, context_length=32768, reserve=0)  # the bare arithmetic
    assert sum(plan.kv_cache.values()) == 10 * GiB  # 80 layers x 128 MiB
    assert plan.offloaded_bytes() == {"cpu": 0, "disk": 0} and all(u.free >= 0 for u in plan.usage)
    assert plan.activations[0] > 0 and plan.activations[1] > 0 and plan.activations["cpu"] == 0
    longest = bigviz.max_context(model, budgets, reserve=0)
    assert 32768 <= longest < 131072
    assert bigviz.max_context(model, budgets, 4, reserve=0) < longest  # four sequences share the memory
    # with each GPU's default headroom (CUDA context, cuBLAS workspace, fragmentation) it is tighter
    assert bigviz.max_context(model, budgets) < longest
    kept = bigviz.plan(model, budgets, context_length=32768)
    assert all(u.reserve >= GiB for u in kept.usage if isinstance(u.device, int))
    assert sum("keeps 1.0 GiB + 10% of its run free by default" in n for n in kept.notes) == 2


def test_the_input_embeddings_are_charged_on_their_device_only(shipped):
    """Llama 3.1 8B on two GPUs: the input embeddings' output (batch x tokens x hidden) stays on
    GPU 0, which holds them; GPU 1 runs the same layers without it."""
    model = shipped["llama-3.1-8b"]
    batch, tokens = 8, 4096
    plan = bigviz.plan(model, {0: 12 * GiB, 1: 24 * GiB}, batch_size=batch, context_length=tokens, reserve=0)
    assert plan.device_of("model.embed_tokens") == 0 and plan.device_of("model.layers.31") == 1
    assert plan.activations[0] - plan.activations[1] == batch * tokens * 4096 * 2  # bf16


def test_plan_takes_a_config_file_or_a_folder_holding_only_one(tmp_path):
    folder = tmp_path / "mistral"
    folder.mkdir()
    config = {
        "model_type": "mistral",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 100,
        "sliding_window": 8,
    }
    (folder / "config.json").write_text(json.dumps(config))
    by_file = bigviz.plan(folder / "config.json", {"cpu": "1GB"}, context_length=100, batch_size=3)
    by_folder = bigviz.plan(folder, {"cpu": "1GB"}, context_length=100, batch_size=3)
    # the plan charges the sliding layers' peak: the whole prompt's keys and values, held from the
    # prefill until their first decode step; once decoding they keep the window
    assert by_file.kv_cache == by_folder.kv_cache == {"cpu": 2 * 3 * 100 * 2 * 16 * 2 * 4, "disk": 0}
    assert bigviz.kv_cache_bytes(folder, 3, 100) == {
        "model.layers.0": 3 * 8 * 2 * 16 * 2 * 4,
        "model.layers.1": 3 * 8 * 2 * 16 * 2 * 4,
    }


@pytest.mark.parametrize("preset", ["gpt-mini", "llama-tiny"])
def test_a_bigviz_checkpoint_with_its_config_plans_its_run(tmp_path, preset):
    """``save_sharded(config=model.config)`` records a reference model's config: the run of a
    checkpoint planned from its headers is the run of the model itself."""
    torch.manual_seed(0)
    model = build(preset, n_layer=3) if preset.startswith("gpt") else build(preset, n_layers=3)
    folder = bigviz.save_sharded(model, tmp_path / "ckpt", max_shard_size="100KB", config=model.config, progress=False)
    budget = {"cpu": bigviz.compute_module_sizes(model)[""] // 2}
    from_headers = bigviz.plan(folder, budget, batch_size=2, context_length=40, reserve=0)
    from_model = bigviz.plan(model, budget, batch_size=2, context_length=40, reserve=0)
    assert from_headers.kv_cache == from_model.kv_cache and sum(from_headers.kv_cache.values()) > 0
    assert from_headers.activations == from_model.activations
    assert from_headers.device_map == {k: v for k, v in from_model.device_map.items() if k in from_headers.device_map}
    assert "disk" in from_headers.device_map.values()
    assert type(bigviz.model_from_config(folder / "config.json")) is type(model)


def test_bad_configs_say_what_is_wrong(tmp_path):
    (tmp_path / "a.json").write_text("{not json")
    with pytest.raises(ValueError, match="a.json"):
        bigviz.plan(tmp_path / "a.json", {"cpu": "1GB"})
    (tmp_path / "b.json").write_text(json.dumps({"hidden_size": 8}))
    with pytest.raises(ValueError, match="no 'model_type'"):
        bigviz.model_from_config(tmp_path / "b.json")
    (tmp_path / "c.json").write_text(json.dumps({"model_type": "no-such-model"}))
    with pytest.raises(ValueError, match="no-such-model"):
        bigviz.model_from_config(tmp_path / "c.json")
    with pytest.raises(ValueError, match="ships no config named 'llama-9'"):
        bigviz.config_path("llama-9")


def test_kv_cache_bytes_takes_models_and_configs():
    hf = transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        vocab_size=50,
    )
    expected = {f"model.layers.{i}": 5 * 7 * 1 * 16 * 2 * 4 for i in range(2)}
    assert bigviz.kv_cache_bytes(hf, 5, 7) == expected
    assert bigviz.kv_cache_bytes(LlamaConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=1), 5, 7) == expected
    half = bigviz.kv_cache_bytes(GPTConfig.preset("gpt-tiny"), 1, 10, dtype=torch.float16)
    assert half == {"transformer.h.0": 10 * 32 * 2 * 2, "transformer.h.1": 10 * 32 * 2 * 2}


def test_a_model_of_unknown_layout_takes_bytes_by_hand():
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    with pytest.raises(ValueError, match="kv_cache="):
        bigviz.plan(model, {"cpu": "1MB"}, context_length=10)
    plan = bigviz.plan(
        model, {"cpu": "1MB"}, context_length=10, kv_cache={"0": 100, "1": 100}, activations={"0": 50, "1": 70}
    )
    assert plan.kv_cache["cpu"] == 200 and plan.activations["cpu"] == 70


def test_max_context_keeps_its_definition():
    with torch.device("meta"):
        model = build("llama-tiny", max_seq_len=4096)
    budgets = {0: 1_000_000, "cpu": 10**8}
    bare = {"reserve": 0}  # the arithmetic alone: no headroom
    longest = bigviz.max_context(model, budgets, **bare)
    fits = bigviz.plan(model, budgets, context_length=longest, **bare)
    assert not any(fits.offloaded_bytes().values()) and all(u.free >= 0 for u in fits.usage)
    over = bigviz.plan(model, budgets, context_length=longest + 1, **bare)  # still plans, but offloads
    assert any(over.offloaded_bytes().values())
    assert bigviz.max_context(model, budgets, allow_offload=True, **bare) > longest
    kept = bigviz.max_context(model, budgets, device_map=fits, **bare)  # this placement, nothing moved
    assert kept >= longest
    with pytest.raises(bigviz.PlanError):
        bigviz.plan(model, budgets, context_length=kept + 1, overrides=dict(fits.unit_map), **bare)
    assert bigviz.max_context(model, {0: 1000, "cpu": 1000, "disk": 1000}) == 0  # not even the weights
    assert bigviz.max_context(model, {0: 10**9}, limit=300, **bare) == 300
    assert bigviz.max_context(model, {0: 10**9}) == 0  # a GPU smaller than its CUDA context: no run


def test_max_context_keeps_the_default_headroom_on_the_cpu():
    """The answer keeps 25% of the run free on the CPU by default (the allocator's slack):
    the plan at the answer fits with it, and the bare answer is longer."""
    with torch.device("meta"):
        model = build("llama-tiny", max_seq_len=4096)
    budgets = {"cpu": 2_000_000}
    longest, bare = bigviz.max_context(model, budgets), bigviz.max_context(model, budgets, reserve=0)
    assert 0 < longest < bare
    plan = bigviz.plan(model, budgets, context_length=longest)
    u = plan.usage_of("cpu")
    assert u.free >= 0 and u.reserve == -(-(u.kv_cache + u.activations) // 4)
    assert u.used + 1.25 * (u.kv_cache + u.activations) <= budgets["cpu"] + 1


def _sizes(text: str) -> list[int]:
    """The sizes a reason names, in bytes, in order (``format_size``'s spellings)."""
    units = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}
    return [round(float(n) * units[u]) for n, u in re.findall(r"([0-9.]+) (B|KiB|MiB|GiB|TiB)\b", text)]


@pytest.mark.parametrize("given", [None, {0: "1GiB"}])
def test_reasons_name_the_headroom_they_kept(given):
    """Each placement's reason says what headroom shrank its room: the bytes a device keeps
    free (the default 1 GiB on a GPU, or the caller's reserve) and the share of the unit's run
    kept free on top (10% on a GPU by default); ``reserve=0`` says none."""
    with bigviz.init_empty_weights():
        model = GPT(GPTConfig.preset("gpt2"))
    budgets = {0: 2**30 + 400_000_000, "cpu": 2**30}
    plan = bigviz.plan(model, budgets, context_length=256, reserve=given)
    assert plan.usage_of(0).used and plan.usage_of("cpu").used, plan.summary()  # a split
    on_gpu = [p for p in plan.placements if p.device == 0 and p.reason.startswith("fits: ")]
    missed = [p for p in plan.placements if "did not fit GPU 0" in p.reason]
    assert on_gpu and missed, plan.summary()
    assert all("1.0 GiB more kept free as headroom" in p.reason for p in missed)
    for p in on_gpu:
        assert "; headroom: 1.0 GiB kept free" in p.reason, p.reason
        if given is None:  # the share of the run kept free, and its bytes
            weights, *run, left = _sizes(p.reason.split(" left ")[0])
            if run:  # its KV cache and the activations it adds
                slack = _sizes(p.reason.split("; headroom: ")[1])[1]
                assert slack == pytest.approx(0.1 * sum(run), rel=0.05), p.reason  # sizes as printed, rounded
                assert "(10% of it)" in p.reason
        else:  # a reserve given replaces the default for that device: no share of the run
            assert "of it)" not in p.reason, p.reason
    bare = bigviz.plan(model, budgets, context_length=256, reserve=0)
    assert not any("headroom" in p.reason for p in bare.placements)


def test_a_tied_head_keeps_room_for_its_run():
    """A leader keeps room on its device for the tied modules that follow it there, their run
    included (GPT-2's head, tied to the input embeddings, holds the logits: the largest step):
    every split of a GPU and the CPU that plans is within budget, with the run charged."""
    with bigviz.init_empty_weights():
        model = GPT(GPTConfig.preset("gpt2"))
    planned = 0
    for gpu in range(280_000_000, 520_000_000, 30_000_000):
        try:
            plan = bigviz.plan(model, {0: gpu, "cpu": 2**30}, context_length=256, reserve=0)
        except bigviz.PlanError:
            continue
        planned += 1
        u = plan.usage_of(0)
        assert u.free >= 0 and u.activations > 0, plan.summary()
        assert plan.device_map["lm_head"] == plan.device_map["transformer.wte"]
    assert planned >= 7


def test_cli_plans_a_config_with_a_workload(tmp_path, capsys):
    out = tmp_path / "map.json"
    code = main(
        [
            "plan",
            "llama-3.1-8b",
            "--batch",
            "4",
            "--context",
            "8192",
            "--max-memory",
            "0=80GiB,1=80GiB",
            "--out",
            str(out),
        ]
    )
    assert code == 0
    text = capsys.readouterr().out
    assert "workload: batch 4 x 8,192 tokens" in text and "KV cache" in text and "activations" in text
    assert "longest context that fits (batch 4)" in text and out.exists()
    shutil.copy(bigviz.config_path("mixtral-8x7b"), tmp_path / "config.json")
    assert (
        main(
            [
                "plan",
                str(tmp_path / "config.json"),
                "--context",
                "1024",
                "--max-memory",
                "0=80GiB,1=80GiB",
                "--out",
                str(out),
                "--overwrite",  # the map of the run above
            ]
        )
        == 0
    )
    assert "KV cache" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["plan", "llama-3.1-8b", "--context", "many"])
    assert "'many'" in capsys.readouterr().err


def test_an_encoder_caches_nothing(hf_bert):
    assert set(bigviz.kv_cache_bytes(hf_bert, 2, 64).values()) == {0}
    plan = bigviz.plan(hf_bert, {"cpu": "1GB"}, context_length=64)
    assert plan.kv_cache["cpu"] == 0 and plan.activations["cpu"] > 0


def test_an_encoder_decoder_caches_its_decoder_tokens_and_the_encoders_in_every_decoder_layer():
    """T5 with heads wider than d_model / heads (mT5's layout): the widths come from the cache
    the model allocates, not from the config's hidden size."""
    with torch.device("meta"):
        t5 = transformers.T5ForConditionalGeneration(
            transformers.T5Config(num_layers=2, d_model=32, d_ff=64, num_heads=2, d_kv=24, vocab_size=100)
        )
    per_token = 2 * 2 * 24 * 4  # keys and values, 2 heads of 24, float32
    kv = bigviz.kv_cache_bytes(t5, 3, 10, encoder_length=50)
    assert kv == {f"decoder.block.{i}": 3 * (10 + 50) * per_token for i in range(2)}
    assert bigviz.kv_cache_bytes(t5, 3, 10) == {f"decoder.block.{i}": 3 * (10 + 10) * per_token for i in range(2)}
    plan = bigviz.plan(t5, {"cpu": "1GB"}, batch_size=3, context_length=10, encoder_length=50)
    assert plan.kv_cache["cpu"] == sum(kv.values())
    # the encoder runs over its 50 tokens, on the device that holds it
    longer = bigviz.plan(t5, {"cpu": "1GB"}, batch_size=3, context_length=10, encoder_length=500)
    assert longer.activations["cpu"] > plan.activations["cpu"]
