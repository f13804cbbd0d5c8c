"""load_checkpoint_in_model: checked before loading, real-world key quirks, dtypes, devices."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from torch import nn

import bigviz.checkpoint.loader as load_module
from bigviz.checkpoint.errors import CheckpointError
from bigviz.checkpoint.load import load_checkpoint_in_model, load_sharded_checkpoint
from bigviz.checkpoint.save import save_sharded
from bigviz.modeling.meta import init_empty_weights
from bigviz.modeling.process_memory import rss_anon
from bigviz.models import GPT, GPTConfig


def _tiny_gpt() -> GPT:
    with init_empty_weights():
        return GPT(GPTConfig.preset("gpt-tiny")).eval()


def _all_meta(model: nn.Module) -> bool:
    return all(t.is_meta for t in [*model.parameters(), *model.buffers()])


@pytest.mark.parametrize("safe", [True, False])
def test_round_trip_into_meta_model_gives_same_outputs(tmp_path: Path, tiny_gpt: GPT, safe: bool) -> None:
    folder = save_sharded(tiny_gpt, tmp_path / "c", max_shard_size="10KB", safe_serialization=safe, progress=False)
    model = _tiny_gpt()
    result = load_checkpoint_in_model(model, folder, progress=False)
    assert not result.missing and not result.unexpected and result.disk is None
    assert (
        result.bytes_loaded
        == sum(t.numel() * 4 for t in tiny_gpt.state_dict().values()) - tiny_gpt.lm_head.weight.numel() * 4
    )  # the tie is stored once
    ids = torch.arange(12)[None]
    assert torch.equal(model(ids)[0], tiny_gpt(ids)[0])  # (logits, loss)
    assert model.lm_head.weight is model.transformer.wte.weight


def test_strict_error_lists_every_problem_and_leaves_model_on_meta(tmp_path: Path) -> None:
    state = {
        "0.weight": torch.ones(4, 3),
        "0.bias": torch.ones(5),  # bias: wrong shape
        "2.weight": torch.ones(4, 4),
        "extra.a": torch.ones(1),
        "extra.b": torch.ones(1),
    }
    folder = save_sharded(state, tmp_path / "c", progress=False)
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 4))
    with pytest.raises(CheckpointError) as err:
        load_checkpoint_in_model(model, folder, progress=False)
    text = str(err.value)
    for needle in (
        "shape mismatch: 0.bias",
        "[5]",
        "[4]",
        "missing in the checkpoint: 2.bias",
        "unexpected in the checkpoint (the model has no such tensor): extra.a",
        "extra.b",
        "strict=False",
        "right checkpoint",
        "nothing was loaded",
    ):
        assert needle in text, needle
    assert len(err.value.problems) == 4 and _all_meta(model)
    with pytest.raises(CheckpointError, match="shape mismatch") as err:  # shapes always matter
        load_checkpoint_in_model(model, folder, strict=False, progress=False)
    assert len(err.value.problems) == 1 and _all_meta(model)


def test_strict_false_loads_what_matches(tmp_path: Path) -> None:
    folder = save_sharded({"0.weight": torch.ones(4, 3), "zzz": torch.ones(1)}, tmp_path / "c", progress=False)
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(3, 4))
    result = load_checkpoint_in_model(model, folder, strict=False, progress=False)
    assert result.loaded == ["0.weight"] and result.missing == ["0.bias"] and result.unexpected == ["zzz"]
    assert "missing: 0.bias" in result.summary() and "unexpected: zzz" in result.summary()
    assert torch.equal(model[0].weight, torch.ones(4, 3)) and model[0].bias.is_meta


def _hf_gpt2_on_meta(config) -> nn.Module:
    from accelerate import init_empty_weights as accelerate_empty  # breaks ties, as users hit
    from transformers import GPT2LMHeadModel

    with accelerate_empty():
        return GPT2LMHeadModel(config).eval()


def test_transformers_model_tied_duplicate_absent(tmp_path: Path, hf_gpt2: nn.Module) -> None:
    folder = save_sharded(hf_gpt2, tmp_path / "c", max_shard_size="20KB", progress=False)
    model = _hf_gpt2_on_meta(hf_gpt2.config)
    assert model.lm_head.weight is not model.transformer.wte.weight  # accelerate broke the tie
    result = load_checkpoint_in_model(model, folder, progress=False)
    assert result.filled_by_tie == [("lm_head.weight", "transformer.wte.weight")]
    assert model.lm_head.weight is model.transformer.wte.weight and not result.missing
    ids = torch.arange(10)[None]
    assert torch.equal(model(ids).logits, hf_gpt2(ids).logits)


def test_prefix_added_and_stripped(tmp_path: Path, hf_gpt2: nn.Module) -> None:
    from transformers import GPT2Model

    base = save_sharded(hf_gpt2.transformer, tmp_path / "base", progress=False)  # keys: h.0..., wte...
    model = _hf_gpt2_on_meta(hf_gpt2.config)
    result = load_checkpoint_in_model(model, base, progress=False)
    assert (result.renamed_prefix, result.prefix_action) == ("transformer.", "added")
    assert not result.missing and torch.equal(model.lm_head.weight, hf_gpt2.lm_head.weight)

    full = save_sharded(hf_gpt2, tmp_path / "full", progress=False)  # keys: transformer.h.0...
    with torch.device("meta"):
        body = GPT2Model(hf_gpt2.config)
    result = load_checkpoint_in_model(body, full, progress=False)
    assert (result.renamed_prefix, result.prefix_action) == ("transformer.", "stripped")
    assert torch.equal(body.h[1].mlp.c_fc.weight, hf_gpt2.transformer.h[1].mlp.c_fc.weight)


def test_keys_the_model_class_ignores(tmp_path: Path, hf_gpt2: nn.Module) -> None:
    # old GPT-2 checkpoints carry the causal-mask buffer "attn.bias"; transformers ignores it
    state = {**hf_gpt2.state_dict(), "transformer.h.0.attn.bias": torch.ones(1, 1, 4, 4)}
    folder = save_sharded(state, tmp_path / "c", progress=False)
    result = load_checkpoint_in_model(_hf_gpt2_on_meta(hf_gpt2.config), folder, progress=False)
    assert ("transformer.h.0.attn.bias", "listed by the model class as safe to ignore") in result.ignored


class _WithBuffers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 2)
        self.register_buffer("position_ids", torch.arange(4), persistent=False)


def test_non_persistent_buffer_in_checkpoint(tmp_path: Path) -> None:
    source = _WithBuffers()
    state = {**source.state_dict(), "position_ids": torch.arange(4) * 10}
    folder = save_sharded(state, tmp_path / "c", progress=False)
    with init_empty_weights():  # buffers stay real: the model computes them
        model = _WithBuffers()
    result = load_checkpoint_in_model(model, folder, progress=False)
    assert result.ignored == [("position_ids", "non-persistent buffer: the model computes it itself")]
    assert torch.equal(model.position_ids, torch.arange(4))
    with init_empty_weights(include_buffers=True):  # buffer on meta: the checkpoint fills it
        model = _WithBuffers()
    result = load_checkpoint_in_model(model, folder, progress=False)
    assert torch.equal(model.position_ids, torch.arange(4) * 10) and not result.ignored


def test_bert_checkpoint_with_position_ids(tmp_path: Path, hf_bert: nn.Module) -> None:
    from accelerate import init_empty_weights as accelerate_empty
    from transformers import BertModel

    state = {f"bert.{k}": v for k, v in hf_bert.state_dict().items()}
    state["bert.embeddings.position_ids"] = hf_bert.embeddings.position_ids  # as old checkpoints have
    folder = save_sharded(state, tmp_path / "c", progress=False)
    with accelerate_empty():
        model = BertModel(hf_bert.config).eval()
    result = load_checkpoint_in_model(model, folder, progress=False)
    assert result.renamed_prefix == "bert." and result.prefix_action == "stripped"
    assert [k for k, _ in result.ignored] == ["bert.embeddings.position_ids"]
    ids = torch.arange(8)[None]
    assert torch.equal(model(ids).last_hidden_state, hf_bert(ids).last_hidden_state)


def test_old_llama_checkpoints_with_per_layer_inv_freq_load_as_from_pretrained(
    tmp_path: Path, hf_llama: nn.Module
) -> None:
    """Many 2023 Llama checkpoints hold ``model.layers.N.self_attn.rotary_emb.inv_freq`` (the
    buffer moved to the model's top since): ``from_pretrained`` ignores them by a rule it adds at
    load time for every model, not a class attribute; bigviz follows it (it refused them as
    unexpected). A key no rule covers is still refused."""
    from transformers import LlamaForCausalLM

    state = dict(hf_llama.state_dict())
    for i in range(hf_llama.config.num_hidden_layers):
        state[f"model.layers.{i}.self_attn.rotary_emb.inv_freq"] = torch.arange(4.0)
    folder = save_sharded(state, tmp_path / "c", progress=False, config=hf_llama.config)
    reference = LlamaForCausalLM.from_pretrained(folder).eval()  # loads: transformers' rule
    with init_empty_weights():
        model = LlamaForCausalLM(hf_llama.config).eval()
    result = load_checkpoint_in_model(model, folder, progress=False)
    assert sorted(k for k, _ in result.ignored if "inv_freq" in k) == sorted(k for k in state if "inv_freq" in k)
    ids = torch.arange(8)[None]
    assert torch.equal(model(ids).logits, reference(ids).logits)
    state["model.layers.0.self_attn.extra"] = torch.zeros(2)
    folder = save_sharded(state, tmp_path / "d", progress=False)
    with init_empty_weights():
        model = LlamaForCausalLM(hf_llama.config).eval()
    with pytest.raises(CheckpointError, match="unexpected.*self_attn.extra"):
        load_checkpoint_in_model(model, folder, progress=False)


def test_tied_duplicate_present_is_ignored(tmp_path: Path) -> None:
    source = nn.ModuleDict({"emb": nn.Embedding(5, 3), "head": nn.Linear(3, 5, bias=False)})
    source["head"].weight = source["emb"].weight
    path = tmp_path / "pytorch_model.bin"
    torch.save(source.state_dict(), path)  # torch.save keeps both names
    with torch.device("meta"):
        model = nn.ModuleDict({"emb": nn.Embedding(5, 3), "head": nn.Linear(3, 5, bias=False)})
    model["head"].weight = model["emb"].weight
    result = load_checkpoint_in_model(model, path, progress=False)
    assert [k for k, _ in result.ignored] == ["head.weight"] and result.loaded == ["emb.weight"]
    assert model["head"].weight is model["emb"].weight


def test_dtype_with_keep_in_fp32_modules(tmp_path: Path) -> None:
    source = nn.ModuleDict({"body": nn.Linear(4, 4), "norm": nn.LayerNorm(4), "wo": nn.Linear(4, 2)})
    source.register_buffer("count", torch.tensor([3]))
    folder = save_sharded(source, tmp_path / "c", progress=False)
    with torch.device("meta"):
        model = nn.ModuleDict({"body": nn.Linear(4, 4), "norm": nn.LayerNorm(4), "wo": nn.Linear(4, 2)})
        model.register_buffer("count", torch.tensor([0]))
    load_checkpoint_in_model(model, folder, dtype="float16", keep_in_fp32_modules=["norm", "wo"], progress=False)
    assert model["body"].weight.dtype == torch.float16 and model["norm"].weight.dtype == torch.float32
    assert model["wo"].bias.dtype == torch.float32 and model.count.dtype == torch.int64
    assert torch.equal(model["body"].weight, source["body"].weight.half())


def test_requires_grad_kept(tmp_path: Path) -> None:
    folder = save_sharded(nn.Linear(2, 2), tmp_path / "c", progress=False)
    with torch.device("meta"):
        model = nn.Linear(2, 2)
    model.bias.requires_grad_(False)
    load_checkpoint_in_model(model, folder, progress=False)
    assert isinstance(model.weight, nn.Parameter) and model.weight.requires_grad
    assert isinstance(model.bias, nn.Parameter) and not model.bias.requires_grad


def _mapped_ranges(path: Path) -> list[tuple[int, int]]:
    ranges = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        if line.endswith(str(path)):
            start, end = line.split()[0].split("-")
            ranges.append((int(start, 16), int(end, 16)))
    return ranges


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="needs Linux /proc")
def test_cpu_load_is_zero_copy_from_the_mapped_file(tmp_path: Path) -> None:
    state = {f"{i}.weight": torch.randn(1024, 1024) for i in range(16)}  # 64 MiB
    folder = save_sharded(state, tmp_path / "c", max_shard_size="20MB", progress=False)
    with torch.device("meta"):
        model = nn.Sequential(*[nn.Linear(1024, 1024, bias=False) for _ in range(16)])
    before = rss_anon()
    load_checkpoint_in_model(model, folder, progress=False)
    total = sum(m.weight.sum().item() for m in model)  # touch every byte
    growth = rss_anon() - before
    assert total == pytest.approx(sum(t.sum().item() for t in state.values()), rel=1e-4)
    assert growth < 16 * 2**20, f"anonymous memory grew {growth / 2**20:.0f} MiB for 64 MiB of weights"
    shard = folder / "model-00001-of-00004.safetensors"
    ranges = _mapped_ranges(shard)
    assert any(a <= model[0].weight.data_ptr() < b for a, b in ranges)


def test_disk_map_on_safetensors_reads_nothing_and_rewrites_nothing(tmp_path: Path, tiny_gpt: GPT) -> None:
    folder = save_sharded(tiny_gpt, tmp_path / "c", progress=False)
    model = _tiny_gpt()
    device_map = {"transformer.h.1": "disk", "": "cpu"}
    result = load_checkpoint_in_model(model, folder, device_map=device_map, progress=False)
    assert result.offload_folder is None and sorted(p.name for p in folder.iterdir()) == ["model.safetensors"]
    disk_names = [n for n, _ in tiny_gpt.named_parameters() if n.startswith("transformer.h.1.")]
    assert sorted(result.disk) == sorted(disk_names)
    assert all(model.get_parameter(n).is_meta for n in disk_names)
    assert not model.transformer.h[0].attn.c_attn.weight.is_meta
    assert result.disk.info(disk_names[0]).data_offsets is not None
    for name in disk_names:
        assert torch.equal(result.disk[name], tiny_gpt.get_parameter(name))


def test_disk_map_on_bin_needs_offload_folder_and_writes_it_once(tmp_path: Path, tiny_gpt: GPT) -> None:
    folder = save_sharded(tiny_gpt, tmp_path / "c", safe_serialization=False, progress=False)
    device_map = {"transformer.h": "disk", "": "cpu"}
    model = _tiny_gpt()
    with pytest.raises(CheckpointError, match="offload_folder"):
        load_checkpoint_in_model(model, folder, device_map=device_map, progress=False)
    assert _all_meta(model)
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes.txt").write_text("mine")
    with pytest.raises(CheckpointError, match="holds files bigviz did not write.*notes.txt"):
        load_checkpoint_in_model(
            model, folder, device_map=device_map, offload_folder=tmp_path / "busy", dtype=torch.float16, progress=False
        )
    result = load_checkpoint_in_model(
        model, folder, device_map=device_map, offload_folder=tmp_path / "off", dtype=torch.float16, progress=False
    )
    assert result.offload_folder == tmp_path / "off"
    record = json.loads((tmp_path / "off" / "bigviz-offload.json").read_text())
    assert sorted(p.name for p in (tmp_path / "off").iterdir()) == sorted([*record["files"], "bigviz-offload.json"])
    name = "transformer.h.0.mlp.c_fc.weight"
    assert model.get_parameter(name).is_meta and result.disk[name].dtype == torch.float16
    assert torch.equal(result.disk[name], tiny_gpt.get_parameter(name).half())


def test_device_map_problems_reported_before_loading(tmp_path: Path) -> None:
    folder = save_sharded(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)), tmp_path / "c", progress=False)
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    with pytest.raises(CheckpointError) as err:
        load_checkpoint_in_model(model, folder, device_map={"0": gpus + 3, "1.weight": "cpu"}, progress=False)
    text = str(err.value)
    assert f"cuda:{gpus + 3}" in text and "no device for 1.bias" in text and _all_meta(model)


def test_failure_mid_load_puts_everything_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = save_sharded(nn.Sequential(*[nn.Linear(3, 3) for _ in range(4)]), tmp_path / "c", progress=False)
    with torch.device("meta"):
        model = nn.Sequential(*[nn.Linear(3, 3) for _ in range(4)])
    before = dict(model.named_parameters())
    real, calls = load_module._convert, []

    def failing(tensor: torch.Tensor, load) -> torch.Tensor:
        calls.append(load.name)
        if len(calls) == 5:
            raise RuntimeError("device fell off the bus")
        return real(tensor, load)

    monkeypatch.setattr(load_module, "_convert", failing)
    with pytest.raises(RuntimeError, match="fell off"):
        load_checkpoint_in_model(model, folder, progress=False)
    assert len(calls) == 5 and _all_meta(model)
    assert all(model.get_parameter(n) is p for n, p in before.items())


def test_malicious_pickle_does_not_run_when_loading(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    torch.save({"weight": Evil(), "bias": torch.ones(2)}, tmp_path / "model.pt")
    with torch.device("meta"):
        model = nn.Linear(2, 2)
    with pytest.raises(CheckpointError, match="refused to unpickle"):
        load_checkpoint_in_model(model, tmp_path / "model.pt", progress=False)
    assert not marker.exists() and _all_meta(model)


def test_load_sharded_checkpoint_copies_in_place(tmp_path: Path, tiny_gpt: GPT) -> None:
    folder = save_sharded(tiny_gpt, tmp_path / "c", max_shard_size="10KB", safe_serialization=False, progress=False)
    torch.manual_seed(1)
    model = GPT(GPTConfig.preset("gpt-tiny")).eval()
    weight = model.transformer.h[0].attn.c_attn.weight
    keys = load_sharded_checkpoint(model, folder)
    assert keys.missing_keys == [] and keys.unexpected_keys == []
    assert model.transformer.h[0].attn.c_attn.weight is weight  # same object, new values
    assert torch.equal(weight, tiny_gpt.transformer.h[0].attn.c_attn.weight)
    with pytest.raises(CheckpointError, match="missing in the checkpoint"):
        load_sharded_checkpoint(nn.Sequential(model, nn.Linear(2, 2)), folder)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_load_to_gpu_and_cpu(tmp_path: Path, tiny_gpt: GPT) -> None:
    folder = save_sharded(tiny_gpt, tmp_path / "c", progress=False)
    model = _tiny_gpt()
    load_checkpoint_in_model(
        model, folder, device_map={"transformer.h": 0, "": "cpu"}, dtype=torch.float16, progress=False
    )
    weight = model.transformer.h[0].attn.c_attn.weight
    assert weight.device == torch.device("cuda", 0) and weight.dtype == torch.float16
    assert torch.equal(weight.cpu(), tiny_gpt.transformer.h[0].attn.c_attn.weight.half())
    assert model.transformer.wte.weight.device.type == "cpu"
