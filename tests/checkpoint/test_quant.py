"""Quantized weights, end to end on the CPU: planned, loaded, offloaded and streamed packed.

Tiny Llamas (random weights, ``save_pretrained``) quantized by every path bigviz supports:
while loading (``quantization="int8"``: torchao; ``"int4"``: bitsandbytes nf4), and stored
quantized by transformers (torchao int8, bitsandbytes 8-bit and 4-bit) or written by hand in
DeepSeek-V3's FP8 layout (transformers cannot quantize to FP8 without a GPU), and a tiny gpt-oss
with its experts in MXFP4 as gpt-oss ships them (written by hand too: transformers quantizes to
MXFP4 only with its Triton kernels). Each one's logits
are compared with transformers' own ``from_pretrained`` of the same configuration: the kernels
are the same, so bit for bit. In bfloat16, torchao's int8 runs on torch's packed CPU kernel in
bigviz (``Int8Linear``): its reference is transformers' model with the same layers made
``Int8Linear`` (bit for bit), and torchao's own path agrees within bfloat16 rounding.
"""

from __future__ import annotations

import importlib.util
import json
import os
import warnings
from pathlib import Path

import pytest
import torch

import bigviz
from bigviz.checkpoint.errors import CheckpointError
from bigviz.engine.resident import mapped_bytes
from bigviz.modeling.packed import held_bytes, split

pytest.importorskip("torchao")
pytest.importorskip("bitsandbytes")
transformers = pytest.importorskip("transformers")

IDS = torch.tensor([[1, 5, 9, 22, 7, 3, 100]])
MAPS = {
    "cpu": {"": "cpu"},
    "disk": {"": "disk"},
    "half": {"model.layers.0": "disk", "": "cpu"},
}


@pytest.fixture(autouse=True)
def _quiet() -> None:
    warnings.filterwarnings("ignore", message=".*MatMul8bitLt.*")
    transformers.logging.set_verbosity_error()


def _llama(hidden: int = 64) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=128,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(config).eval()


def _fp8_layout(model: torch.nn.Module, folder: Path, block: int = 128) -> Path:
    """DeepSeek-V3's layout, by hand: each linear weight in ``float8_e4m3fn`` with one float32
    ``weight_scale_inv`` per ``block x block`` (the weight is ``fp8 * scale`` per block)."""
    from safetensors.torch import save_file

    state = {}
    for key, value in model.state_dict().items():
        if key.endswith("proj.weight"):
            rows, cols = value.shape
            br, bc = -(-rows // block), -(-cols // block)
            padded = torch.zeros(br * block, bc * block)
            padded[:rows, :cols] = value
            blocks = padded.view(br, block, bc, block)
            scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / 448.0
            fp8 = (blocks / scale[:, None, :, None]).to(torch.float8_e4m3fn).view(br * block, bc * block)
            state[key] = fp8[:rows, :cols].contiguous()
            state[key.removesuffix("weight") + "weight_scale_inv"] = scale.contiguous()
        else:
            state[key] = value.to(torch.bfloat16).contiguous()
    folder.mkdir()
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    config = model.config.to_dict() | {"torch_dtype": "bfloat16", "architectures": ["LlamaForCausalLM"]}
    config["quantization_config"] = {
        "quant_method": "fp8",
        "activation_scheme": "dynamic",
        "weight_block_size": [block, block],
    }
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The float checkpoint and one stored in each quantized format."""
    from torchao.quantization import Int8WeightOnlyConfig
    from transformers import BitsAndBytesConfig, LlamaForCausalLM, TorchAoConfig

    transformers.logging.set_verbosity_error()
    root = tmp_path_factory.mktemp("quant")
    out = {"float": root / "float"}
    _llama().save_pretrained(out["float"])
    stored = {
        "torchao": TorchAoConfig(Int8WeightOnlyConfig()),
        "bnb8": BitsAndBytesConfig(load_in_8bit=True),
        "bnb4": BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4"),
    }
    for name, config in stored.items():
        model = LlamaForCausalLM.from_pretrained(out["float"], quantization_config=config, device_map="cpu")
        model.save_pretrained(root / name)
        out[name] = root / name
    out["fp8"] = _fp8_layout(_llama(hidden=256), root / "fp8")
    if importlib.util.find_spec("compressed_tensors") is not None:
        for preset in ("W4A16", "W8A16"):
            out[preset] = _compressed_tensors_layout(_llama(hidden=128), root / preset, preset)
    return out


def _transformers(folder: Path, *, int8_kernel: bool = True, **kwargs: object) -> torch.Tensor:
    """transformers' logits; its torchao int8 layers run on bigviz's kernel unless ``int8_kernel=False``."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(folder, device_map="cpu", **kwargs)
    if int8_kernel:
        _int8_kernel(model)
    with torch.no_grad():
        return model(IDS).logits


def _int8_kernel(model: torch.nn.Module) -> list[str]:
    """Every linear layer holding a torchao ``Int8Tensor`` made ``Int8Linear`` (what bigviz does)."""
    from bigviz.modeling.int8_linear import use_int8_kernel

    names = [n for n, m in model.named_modules() if type(getattr(m, "weight", None)).__name__ == "Int8Tensor"]
    return use_int8_kernel(model, names)


@pytest.fixture(scope="module")
def while_loading_refs(folders: dict[str, Path]) -> dict[str, torch.Tensor]:
    from torchao.quantization import Int8WeightOnlyConfig
    from transformers import BitsAndBytesConfig, TorchAoConfig

    return {
        "int8": _transformers(folders["float"], quantization_config=TorchAoConfig(Int8WeightOnlyConfig())),
        "int4": _transformers(
            folders["float"], quantization_config=BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4")
        ),
    }


def _load(folder: Path, device_map: object, tmp_path: Path, **kwargs: object) -> torch.nn.Module:
    model = bigviz.model_from_config(folder)
    return bigviz.load_checkpoint_and_dispatch(model, folder, device_map, offload_folder=tmp_path / "offload", **kwargs)


def _run(folder: Path, device_map: object, tmp_path: Path, **kwargs: object) -> tuple[torch.nn.Module, torch.Tensor]:
    model = _load(folder, device_map, tmp_path, **kwargs)
    return model, _forward(model)


def _forward(model: torch.nn.Module) -> torch.Tensor:
    """Two forwards: the logits, checked equal (a second pass reads the same packed bytes)."""
    with torch.no_grad():
        first = model(IDS).logits
        assert torch.equal(model(IDS).logits, first)  # a second pass reads the same packed bytes
    return first


# ---- quantized while loading ----------------------------------------------------------------
@pytest.mark.parametrize("method", ["int8", "int4"])
@pytest.mark.parametrize(
    "where", ["half", pytest.param("cpu", marks=pytest.mark.slow), pytest.param("disk", marks=pytest.mark.slow)]
)
@pytest.mark.parametrize("resident", ["copy", pytest.param("map", marks=pytest.mark.slow)])
def test_quantized_while_loading_equals_transformers_bit_for_bit(
    folders: dict[str, Path],
    while_loading_refs: dict[str, torch.Tensor],
    tmp_path: Path,
    method: str,
    where: str,
    resident: str,
) -> None:
    model, logits = _run(folders["float"], MAPS[where], tmp_path, quantization=method, resident=resident)
    assert torch.equal(logits, while_loading_refs[method])
    kinds = {type(t).__name__ for t in model.parameters() if t.device.type == "cpu"}
    if where != "disk":
        assert kinds & {"Int8Tensor", "Params4bit"}  # packed in memory, not dequantized


@pytest.mark.parametrize("source", ["float", "torchao"])
def test_int8_in_bfloat16_runs_on_torchs_packed_kernel_within_rounding_of_torchaos_path(
    folders: dict[str, Path], tmp_path: Path, source: str
) -> None:
    """Quantized while loading, or stored by transformers, computed in bfloat16: every int8
    layer (one block on disk) calls ``torch._weight_int8pack_mm``, and the logits are torchao's
    own path's to bfloat16 rounding (the additions are made in another order; the weights are
    the same bytes); in float32 torchao's path runs (the float32 tests above: bit for bit)."""
    from torchao.quantization import Int8WeightOnlyConfig
    from transformers import TorchAoConfig

    extra: dict[str, object] = {"quantization": "int8"} if source == "float" else {}
    model = _load(folders[source], MAPS["half"], tmp_path, dtype=torch.bfloat16, **extra)
    assert sum(type(m).__name__ == "Int8Linear" for m in model.modules()) == 14
    with torch.no_grad(), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        logits = model(IDS).logits
    calls = {e.key: e.count for e in prof.key_averages()}
    assert calls.get("aten::_weight_int8pack_mm") == 14  # every int8 layer, the one on disk too
    qc = {"quantization_config": TorchAoConfig(Int8WeightOnlyConfig())} if source == "float" else {}
    torchaos = _transformers(folders[source], int8_kernel=False, dtype=torch.bfloat16, **qc)
    assert logits.dtype == torchaos.dtype == torch.bfloat16
    assert float((logits - torchaos).abs().max()) <= 2e-2 * float(torchaos.abs().max())
    assert torch.equal(logits, _transformers(folders[source], dtype=torch.bfloat16, **qc))  # the same kernel


@pytest.mark.parametrize("method", ["int8", "int4"])
@pytest.mark.parametrize("budget", ["1GiB", "60KiB"])
def test_plan_bytes_equal_the_bytes_in_memory_after_the_load(
    folders: dict[str, Path], tmp_path: Path, method: str, budget: str
) -> None:
    plan = bigviz.plan(folders["float"], {"cpu": budget}, quantization=method)
    model = _load(folders["float"], plan, tmp_path, quantization=method)
    # after the load: bitsandbytes' CPU kernel repacks a 4-bit weight at its first forward on a
    # CPU with AVX-512 BF16 (absmax kept in bfloat16, a little less than stored)
    assert held_bytes(model).get("cpu", 0) == plan.usage_of("cpu").used
    _forward(model)
    state = getattr(model, "_bigviz_dispatch", None)  # (all in RAM: no hooks at all)
    units = state.units if state is not None else []
    assert sum(u.nbytes for u in units if u.storage == "disk") == plan.usage_of("disk").used
    full = bigviz.plan(folders["float"], {"cpu": budget})
    assert plan.usage_of("cpu").used + plan.usage_of("disk").used < 0.5 * (
        full.usage_of("cpu").used + full.usage_of("disk").used
    )


def test_the_quantized_what_if_counts_scales_and_keeps_the_head_embeddings_and_norms(folders: dict[str, Path]) -> None:
    model = bigviz.model_from_config(folders["float"])
    tree = bigviz.plan(model, {"cpu": "1GiB"}, quantization="int8")
    floats = bigviz.plan(model, {"cpu": "1GiB"})
    linear = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"]
    packed = sum(m.weight.numel() + 5 * m.weight.shape[0] for n, m in model.named_modules() if n in linear)
    floated = sum(model.get_submodule(n).weight.numel() * 4 for n in linear)
    assert floats.usage_of("cpu").used - tree.usage_of("cpu").used == floated - packed


def test_bigviz_gpt_quantized_while_loading_is_torchaos_own_quantize(tmp_path: Path) -> None:
    """A model that is not transformers': the same rule (tied head and last module kept)."""
    from torchao.quantization import Int8WeightOnlyConfig, quantize_

    from bigviz.models import tiny_gpt_folder

    folder = tiny_gpt_folder()
    model = bigviz.load_checkpoint_and_dispatch(bigviz.model_from_config(folder), folder, None, quantization="int8")
    reference = bigviz.model_from_config(folder)
    bigviz.load_checkpoint_in_model(reference, folder, progress=False)
    kept = {"lm_head", "transformer.wte"}
    quantize_(
        reference, Int8WeightOnlyConfig(), filter_fn=lambda m, n: isinstance(m, torch.nn.Linear) and n not in kept
    )
    assert _int8_kernel(reference)
    idx = torch.tensor([[66, 105, 103, 32, 109]])
    with torch.no_grad():
        assert torch.equal(model(idx)[0], reference(idx)[0])
    assert type(model.lm_head.weight).__name__ == "Parameter"  # tied to the embedding: float


# ---- stored quantized --------------------------------------------------------------------------
@pytest.mark.parametrize("stored", ["torchao", "bnb8", "bnb4", "fp8", "W4A16", "W8A16"])
@pytest.mark.parametrize("where", ["cpu", "half", pytest.param("disk", marks=pytest.mark.slow)])
def test_a_checkpoint_stored_quantized_loads_as_transformers_loads_it(
    folders: dict[str, Path], tmp_path: Path, stored: str, where: str
) -> None:
    if stored not in folders:
        pytest.skip("compressed-tensors is not installed")
    reference = _transformers(folders[stored])
    for resident in ("map", "copy"):
        model, logits = _run(folders[stored], MAPS[where], tmp_path / resident, resident=resident)
        assert torch.equal(logits, reference), (stored, where, resident)
        if resident == "copy" and where == "half":  # copied beside the first forward, packed parts too
            assert bigviz.residency(model).copied is not None and mapped_bytes(model) == 0
        assert not (tmp_path / resident / "offload").exists()  # on disk: read from the checkpoint's own files


@pytest.mark.parametrize("stored", ["torchao", "bnb8", "bnb4", "fp8"])
def test_a_stored_checkpoint_is_planned_from_its_headers_as_it_loads(
    folders: dict[str, Path], tmp_path: Path, stored: str
) -> None:
    plan = bigviz.plan(folders[stored], {"cpu": "1GiB"})
    model = _load(folders[stored], plan, tmp_path)
    assert held_bytes(model)["cpu"] == plan.usage_of("cpu").used  # after the load (see above)
    _forward(model)
    half = bigviz.plan(folders[stored], {"cpu": plan.usage_of("cpu").used // 2})
    model = _load(folders[stored], half, tmp_path / "half")
    assert held_bytes(model)["cpu"] == half.usage_of("cpu").used
    _forward(model)
    summary = str(bigviz.load_plan(bigviz.model_from_config(folders[stored]), folders[stored]))
    assert "14 weights: " in summary and "cast" not in summary
    method = {"bnb8": "bitsandbytes", "bnb4": "bitsandbytes"}.get(stored, stored)
    assert f"note: stored quantized ({method}): " in plan.summary()  # the format and the compute dtype named
    assert "computed in " in plan.summary()


def test_a_quantized_what_if_names_its_format_and_compute_dtype(folders: dict[str, Path]) -> None:
    summary = bigviz.plan(folders["float"], {"cpu": "1GiB"}, quantization="int4").summary()
    assert "note: quantized: 14 weights as int4 (bitsandbytes nf4" in summary and "computed in float32" in summary
    assert "quantized" not in bigviz.plan(folders["float"], {"cpu": "1GiB"}).summary()
    int8 = bigviz.plan(folders["float"], {"cpu": "1GiB"}, quantization="int8").summary()
    fast = bigviz.plan(folders["float"], {"cpu": "1GiB"}, quantization="int8", dtype=torch.bfloat16).summary()
    assert "with dtype=torch.bfloat16 it runs on torch's packed int8 kernel" in int8  # the fast path, named
    assert "computed in bfloat16" in fast and "packed int8 kernel" not in fast


def test_stored_in_blocks_on_disk_the_checkpoint_is_read_in_place(folders: dict[str, Path], tmp_path: Path) -> None:
    before = sorted(os.listdir(folders["torchao"]))
    model, _ = _run(folders["torchao"], MAPS["half"], tmp_path)
    assert not (tmp_path / "offload").exists()  # no copy: built from the checkpoint's own bytes
    assert sorted(os.listdir(folders["torchao"])) == before
    assert model.model.layers[0].self_attn.q_proj.weight.is_meta


# ---- offloaded and streamed packed -------------------------------------------------------------
@pytest.mark.parametrize("stored", ["torchao", "bnb8", "bnb4"])
@pytest.mark.parametrize("ran_first", [False, True])
def test_a_live_quantized_model_offloaded_to_disk_round_trips_bit_for_bit(
    folders: dict[str, Path], tmp_path: Path, stored: str, ran_first: bool
) -> None:
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(folders[stored], device_map="cpu")
    with torch.no_grad():
        reference = model(IDS).logits if ran_first else None  # bitsandbytes moves SCB into the layer's state
    layer = model.model.layers[1].mlp.down_proj
    before = {k: v.clone() for k, v in split(layer.weight, module=layer).parts.items()}
    bigviz.disk_offload(model, tmp_path / "offload")
    with torch.no_grad():
        logits = model(IDS).logits
    if reference is not None:
        assert torch.equal(logits, reference)
    record = json.loads((tmp_path / "offload" / "bigviz-offload.json").read_text())
    from safetensors import safe_open

    names = set()
    for name in record["files"]:
        if name.endswith(".safetensors"):
            with safe_open(tmp_path / "offload" / name, "pt") as f:
                names |= set(f.keys())
    packed = {n for n in names if n.startswith("model.layers.1.mlp.down_proj.weight:")}
    assert packed == {f"model.layers.1.mlp.down_proj.weight:{p}" for p in before}  # written packed
    bigviz.remove_hooks(model)
    after = split(layer.weight, module=layer).parts
    assert all(torch.equal(after[k], v) for k, v in before.items())
    with torch.no_grad():
        assert torch.equal(model(IDS).logits, logits)


def test_streamed_int8_blocks_read_their_packed_bytes(folders: dict[str, Path], tmp_path: Path) -> None:
    plan = bigviz.plan(folders["float"], {"cpu": "60KiB"}, quantization="int8")
    model, _ = _run(folders["float"], plan, tmp_path, quantization="int8", resident="copy")
    ring = model._bigviz_dispatch.scheduler.fetcher
    assert type(ring).__name__ == "RingFetcher"
    before = ring.stats.bytes_read
    with torch.no_grad():
        model(IDS)
    read = ring.stats.bytes_read - before
    packed = plan.usage_of("disk").used
    needed = sum(view[1] for layout in ring._layouts.values() for e in layout.extents for view in e.views.values())
    assert needed == packed  # each streamed weight's parts, read packed into the ring
    floats = bigviz.plan(folders["float"], {"cpu": "60KiB"}).usage_of("disk").used
    assert packed <= read < floats  # (tiny tensors: the ring merges reads of neighbours less than 64 KiB apart)


# ---- refused, clearly, before anything loads -----------------------------------------------------
def _with_config(folder: Path, target: Path, change: dict) -> Path:
    target.mkdir()
    for name in os.listdir(folder):
        os.symlink(folder / name, target / name) if name != "config.json" else None
    config = json.loads((folder / "config.json").read_text())
    config.update(change)
    config = {k: v for k, v in config.items() if v is not None}
    (target / "config.json").write_text(json.dumps(config))
    return target


@pytest.mark.parametrize("method", ["gptq", "awq", "hqq", "quanto", "bitnet"])
def test_a_quantization_without_a_cpu_path_is_refused_naming_it(
    folders: dict[str, Path], tmp_path: Path, method: str
) -> None:
    folder = _with_config(
        folders["float"], tmp_path / "c", {"quantization_config": {"quant_method": method, "bits": 4}}
    )
    model = bigviz.model_from_config(folders["float"])
    with pytest.raises(CheckpointError, match=f"quant_method '{method}'") as err:
        bigviz.load_checkpoint_and_dispatch(model, folder, {"": "cpu"})
    assert "quantization='int8'" in str(err.value)  # what to do instead
    assert all(p.is_meta for p in model.parameters())  # nothing loaded


def test_a_torchao_format_without_a_cpu_kernel_is_refused_naming_it(folders: dict[str, Path], tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file
    from safetensors import safe_open

    src = folders["torchao"] / "model.safetensors"
    with safe_open(src, "pt") as f:
        metadata = dict(f.metadata())
    name = "model.layers.0.self_attn.q_proj.weight"
    metadata[name] = metadata[name].replace("Int8Tensor", "Int4Tensor")
    folder = tmp_path / "int4"
    folder.mkdir()
    save_file(load_file(src), folder / "model.safetensors", metadata=metadata)
    (folder / "config.json").write_text((folders["torchao"] / "config.json").read_text())
    with pytest.raises(CheckpointError, match="Int4Tensor has no CPU kernel"):
        bigviz.load_checkpoint_in_model(bigviz.model_from_config(folder), folder, progress=False)


def test_a_missing_library_is_named_before_anything_loads(
    folders: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "bitsandbytes" else real(name, *a)
    )
    model = bigviz.model_from_config(folders["float"])
    with pytest.raises(ImportError, match=r"bitsandbytes package.*pip install 'bigviz\[quant\]'"):
        bigviz.load_checkpoint_and_dispatch(model, folders["float"], {"": "cpu"}, quantization="int4")
    with pytest.raises(CheckpointError, match="needs the bitsandbytes package"):
        bigviz.load_checkpoint_and_dispatch(bigviz.model_from_config(folders["bnb8"]), folders["bnb8"], {"": "cpu"})
    assert all(p.is_meta for p in model.parameters())


def test_quantizing_a_checkpoint_stored_quantized_is_refused(folders: dict[str, Path]) -> None:
    with pytest.raises(CheckpointError, match="already stored quantized"):
        bigviz.load_checkpoint_in_model(
            bigviz.model_from_config(folders["torchao"]), folders["torchao"], quantization="int8"
        )
    with pytest.raises(bigviz.PlanError, match="already stored quantized"):
        bigviz.plan(folders["torchao"], {"cpu": "1GiB"}, quantization="int8")


def test_quantized_disk_weights_without_an_offload_folder_are_refused_up_front(folders: dict[str, Path]) -> None:
    model = bigviz.model_from_config(folders["float"])
    with pytest.raises(CheckpointError, match="written once, packed, to an offload folder: pass offload_folder="):
        bigviz.load_checkpoint_and_dispatch(model, folders["float"], MAPS["half"], quantization="int8")
    assert all(p.is_meta for p in model.parameters())


@pytest.mark.parametrize("stored", ["torchao", "bnb8", "fp8"])
def test_strict_false_never_drops_quantization_tensors(folders: dict[str, Path], tmp_path: Path, stored: str) -> None:
    """A checkpoint whose config lost its quantization_config: loading its keys as plain
    weights would be garbage; strict=False must not drop the scales silently."""
    folder = _with_config(folders[stored], tmp_path / "c", {"quantization_config": None})
    model = bigviz.model_from_config(folders["float"])
    with pytest.raises(CheckpointError, match="never dropped") as err:
        bigviz.load_checkpoint_in_model(model, folder, strict=False, progress=False)
    assert {"torchao": "_weight_qdata", "bnb8": ".SCB", "fp8": "weight_scale_inv"}[stored] in str(err.value)


def test_nothing_is_written_outside_the_offload_folder(folders: dict[str, Path], tmp_path: Path) -> None:
    def files(root: Path) -> dict[str, int]:
        return {str(p): p.stat().st_size for p in root.rglob("*")}

    checkpoint, outside = files(folders["float"]), files(tmp_path)
    _run(folders["float"], MAPS["half"], tmp_path, quantization="int4")
    assert files(folders["float"]) == checkpoint
    made = set(files(tmp_path)) - set(outside)
    assert made and all(Path(p).is_relative_to(tmp_path / "offload") for p in made)


def test_the_cli_plans_a_quantized_what_if(
    folders: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    from bigviz.cli import main

    out = tmp_path / "map.json"
    assert (
        main(["plan", str(folders["float"]), "--max-memory", "cpu=60KiB", "--quantize", "int8", "--out", str(out)]) == 0
    )
    text = capsys.readouterr().out
    assert "int8 (torchao" in text
    expected = bigviz.plan(folders["float"], {"cpu": "60KiB"}, quantization="int8").device_map
    assert bigviz.load_device_map(out) == expected


@pytest.mark.slow
def test_quantizing_while_loading_never_holds_the_float_model(tmp_path: Path) -> None:
    """40 float32 layers of 4 MiB quantized one at a time: the process's anonymous memory grows
    by about the int8 bytes (the float32 temporaries do not pile up between them)."""
    from bigviz.modeling.process_memory import PeakMemory

    torch.manual_seed(0)
    layers = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024, bias=False) for _ in range(40)])
    folder = bigviz.save_sharded(layers, tmp_path / "ckpt", progress=False)
    with torch.device("meta"):
        model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024, bias=False) for _ in range(40)])
    int8 = 39 * (1024 * 1024 + 5 * 1024)  # the last layer stays float32 (mapped: not anonymous)
    with PeakMemory(("RssAnon",)) as peak:
        bigviz.load_checkpoint_and_dispatch(model, folder, {"": "cpu"}, quantization="int8")
    grew = peak.peak["RssAnon"] - peak.base["RssAnon"]
    assert held_bytes(model)["cpu"] == int8 + 1024 * 1024 * 4
    assert grew < 1.3 * int8 + 16 * 2**20, f"{grew / 2**20:.0f} MiB for {int8 / 2**20:.0f} MiB of int8"


# ---- MXFP4 (gpt-oss) ------------------------------------------------------------------------------
def _mxfp4_layout(model: torch.nn.Module, folder: Path) -> Path:
    """gpt-oss's layout, by hand: each expert projection ``[experts, in, out]`` stored as
    ``<proj>_blocks`` ``[experts, out, in / 32, 16]`` (two FP4 e2m1 codes a byte, low nibble
    first) and ``<proj>_scales`` ``[experts, out, in / 32]`` (a power-of-two exponent + 127)."""
    from safetensors.torch import save_file
    from transformers.integrations.mxfp4 import FP4_VALUES

    codes = torch.tensor(FP4_VALUES)
    state = {}
    for key, value in model.state_dict().items():
        if key.endswith(("experts.gate_up_proj", "experts.down_proj")):
            rows = value.transpose(1, 2).contiguous()
            groups = rows.reshape(*rows.shape[:-1], rows.shape[-1] // 32, 32)
            exponent = torch.ceil(torch.log2(groups.abs().amax(-1).clamp(min=2**-100) / 6.0))
            index = ((groups / torch.exp2(exponent)[..., None])[..., None] - codes).abs().argmin(-1).to(torch.uint8)
            state[f"{key}_blocks"] = (index[..., 0::2] | (index[..., 1::2] << 4)).contiguous()
            state[f"{key}_scales"] = (exponent + 127).to(torch.uint8).contiguous()
        else:
            state[key] = value.to(torch.bfloat16).contiguous()
    folder.mkdir()
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    config = model.config.to_dict() | {"torch_dtype": "bfloat16", "architectures": ["GptOssForCausalLM"]}
    config["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": [
            "model.layers.*.self_attn",
            "model.layers.*.mlp.router",
            "model.embed_tokens",
            "lm_head",
        ],
    }
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="module")
def mxfp4(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import GptOssConfig, GptOssForCausalLM

    torch.manual_seed(0)
    config = GptOssConfig(
        vocab_size=128, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=64,
        sliding_window=8, layer_types=["sliding_attention", "full_attention"], tie_word_embeddings=False,
    )  # fmt: skip
    return _mxfp4_layout(GptOssForCausalLM(config).eval(), tmp_path_factory.mktemp("mxfp4") / "gpt-oss")


@pytest.mark.parametrize("where", ["cpu", "half", pytest.param("disk", marks=pytest.mark.slow)])
def test_mxfp4_experts_load_as_transformers_dequantizes_them(mxfp4: Path, tmp_path: Path, where: str) -> None:
    from transformers import GptOssForCausalLM

    with torch.no_grad():
        reference = GptOssForCausalLM.from_pretrained(mxfp4, device_map="cpu")(IDS[:, :6]).logits
    for resident in ("map", "copy"):
        model = bigviz.load_checkpoint_and_dispatch(
            bigviz.model_from_config(mxfp4), mxfp4, MAPS[where], offload_folder=tmp_path / resident, resident=resident
        )
        with torch.no_grad():
            assert torch.equal(model(IDS[:, :6]).logits, reference), (where, resident)
        assert not (tmp_path / resident).exists()  # on disk, read from the checkpoint's own blocks


def test_mxfp4_is_planned_from_its_headers_as_it_loads(mxfp4: Path) -> None:
    plan = bigviz.plan(mxfp4, {"cpu": "1GiB"})
    model = bigviz.load_checkpoint_and_dispatch(bigviz.model_from_config(mxfp4), mxfp4, plan)
    assert held_bytes(model)["cpu"] == plan.usage_of("cpu").used  # dequantized: bfloat16 bytes
    experts = model.model.layers[0].mlp.experts
    assert experts.gate_up_proj.dtype == torch.bfloat16 and experts.gate_up_proj.shape == (4, 64, 128)
    summary = str(bigviz.load_plan(bigviz.model_from_config(mxfp4), mxfp4))
    assert "4 weights: mxfp4, dequantized" in summary


def test_mxfp4_blocks_without_their_scales_are_named(mxfp4: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "broken"
    folder.mkdir()
    state = load_file(mxfp4 / "model.safetensors")
    del state["model.layers.1.mlp.experts.down_proj_scales"]
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    (folder / "config.json").write_bytes((mxfp4 / "config.json").read_bytes())
    model = bigviz.model_from_config(mxfp4)
    with pytest.raises(CheckpointError, match="model.layers.1.mlp.experts.down_proj_blocks"):
        bigviz.load_checkpoint_and_dispatch(model, folder, {"": "cpu"})
    assert all(p.is_meta for p in model.parameters())


# ---- compressed-tensors ---------------------------------------------------------------------------
def _compressed_tensors_layout(model: torch.nn.Module, folder: Path, preset: str) -> Path:
    """A weight-only compressed-tensors checkpoint (``W4A16``: int4 pack-quantized in groups of
    128; ``W8A16``: int8 int-quantized), each linear weight compressed by the package's own
    compressor from scales its ``calculate_qparams`` computes (what llm-compressor writes)."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationConfig, QuantizationStatus, preset_name_to_scheme
    from compressed_tensors.quantization.utils import calculate_qparams
    from safetensors.torch import save_file

    scheme = preset_name_to_scheme(preset, ["Linear"])
    scheme.format = "pack-quantized" if scheme.weights.num_bits == 4 else "int-quantized"
    compressor = BaseCompressor.get_value_from_registry(scheme.format)
    state = {}
    for key, value in model.state_dict().items():
        if not key.endswith("proj.weight"):
            state[key] = value.to(torch.bfloat16).contiguous()
            continue
        weight = value.to(torch.bfloat16)
        groups = weight.float().reshape(weight.shape[0], -1, scheme.weights.group_size)
        scale, zero = calculate_qparams(groups.amin(-1), groups.amax(-1), scheme.weights)
        local = {"weight": weight, "weight_scale": scale.to(torch.bfloat16), "weight_zero_point": zero}
        for name, tensor in compressor.compress(local, scheme).items():
            state[f"{key.removesuffix('weight')}{name}"] = tensor.contiguous()
    folder.mkdir()
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    config = model.config.to_dict() | {"torch_dtype": "bfloat16", "architectures": ["LlamaForCausalLM"]}
    quant = QuantizationConfig(
        config_groups={"group_0": scheme},
        format=scheme.format,
        quantization_status=QuantizationStatus.COMPRESSED,
        ignore=["lm_head"],
    )
    config["quantization_config"] = quant.model_dump(mode="json") | {"quant_method": "compressed-tensors"}
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_compressed_tensors_are_planned_from_their_headers_as_they_load(folders: dict[str, Path]) -> None:
    if "W4A16" not in folders:
        pytest.skip("compressed-tensors is not installed")
    folder = folders["W4A16"]
    plan = bigviz.plan(folder, {"cpu": "1GiB"})
    model = bigviz.load_checkpoint_and_dispatch(bigviz.model_from_config(folder), folder, plan)
    assert held_bytes(model)["cpu"] == plan.usage_of("cpu").used  # decompressed: bfloat16 bytes
    assert model.model.layers[0].self_attn.q_proj.weight.shape == (128, 128)  # from weight_shape
    assert "14 weights: compressed-tensors, decompressed" in str(
        bigviz.load_plan(bigviz.model_from_config(folder), folder)
    )


def test_compressed_tensors_quantizing_activations_are_refused_naming_the_group(
    folders: dict[str, Path], tmp_path: Path
) -> None:
    if "W8A16" not in folders:
        pytest.skip("compressed-tensors is not installed")
    config = json.loads((folders["W8A16"] / "config.json").read_text())
    group = config["quantization_config"]["config_groups"]["group_0"]
    group["input_activations"] = {"num_bits": 8, "type": "int", "symmetric": True, "dynamic": True, "strategy": "token"}
    folder = _with_config(folders["W8A16"], tmp_path / "w8a8", {"quantization_config": config["quantization_config"]})
    model = bigviz.model_from_config(folders["W8A16"])
    with pytest.raises(CheckpointError, match="group_0 quantize activations"):
        bigviz.load_checkpoint_and_dispatch(model, folder, {"": "cpu"})
    assert all(p.is_meta for p in model.parameters())


# ---- a stored weight's parts, checked from the headers before anything is read -------------------
Q = "model.layers.0.self_attn.q_proj"


def _mutated(folder: Path, target: Path, change: dict[str, torch.Tensor | None]) -> Path:
    """A copy of ``folder`` whose ``model.safetensors`` has the keys of ``change`` replaced (None:
    removed), its header metadata (torchao's tensor subclasses) kept."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    with safe_open(folder / "model.safetensors", "pt") as f:
        metadata = f.metadata()
    state = load_file(folder / "model.safetensors")
    for key, value in change.items():
        state.pop(key) if value is None else state.__setitem__(key, value)
    target.mkdir()
    save_file(state, target / "model.safetensors", metadata=metadata)
    (target / "config.json").write_text((folder / "config.json").read_text())
    return target


@pytest.fixture(scope="module")
def bnb4_double(folders: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import BitsAndBytesConfig, LlamaForCausalLM

    config = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_use_double_quant=True)
    folder = tmp_path_factory.mktemp("double") / "bnb4dq"
    LlamaForCausalLM.from_pretrained(folders["float"], quantization_config=config, device_map="cpu").save_pretrained(
        folder
    )
    return folder


BAD_PARTS = {  # stored format, {key: new value (None: removed)}, what the message must say
    "bnb4 short absmax": ("bnb4", {f"{Q}.weight.absmax": torch.ones(7)}, ["expected 64 float32", "found [7] float32"]),
    "bnb4 no absmax": ("bnb4", {f"{Q}.weight.absmax": None}, [f"{Q}.weight.absmax is missing"]),
    "bnb4 no quant_map": ("bnb4", {f"{Q}.weight.quant_map": None}, [f"{Q}.weight.quant_map is missing"]),
    "bnb4 no quant state": ("bnb4", {f"{Q}.weight.quant_state.bitsandbytes__nf4": None}, ["quant_state", "missing"]),
    "bnb4 short packed": ("bnb4", {f"{Q}.weight": torch.zeros(100, 1, dtype=torch.uint8)}, ["expected 2048 bytes"]),
    "bnb4dq no nested_absmax": (
        "bnb4dq",
        {f"{Q}.weight.nested_absmax": None},
        [f"{Q}.weight.nested_absmax is missing"],
    ),
    "bnb4dq float absmax": ("bnb4dq", {f"{Q}.weight.absmax": torch.ones(64)}, ["expected 64 uint8"]),
    "bnb8 no SCB": ("bnb8", {f"{Q}.SCB": None}, [f"{Q}.SCB is missing", "64 float32 row scales"]),
    "bnb8 short SCB": ("bnb8", {f"{Q}.SCB": torch.ones(7)}, [f"{Q}.SCB", "found [7] float32"]),
    "bnb8 float16 weight": ("bnb8", {f"{Q}.weight": torch.zeros(64, 64, dtype=torch.float16)}, ["int8 weight"]),
    "torchao short scale": ("torchao", {f"{Q}._weight_scale": torch.ones(7)}, [f"{Q}._weight_scale", "expected 64"]),
    "torchao no zero point": ("torchao", {f"{Q}._weight_zero_point": None}, [f"{Q}._weight_zero_point is missing"]),
    "fp8 scale grid": ("fp8", {f"{Q}.weight_scale_inv": torch.ones(3, 5)}, ["expected [2, 2] scales", "found [3, 5]"]),
}


@pytest.mark.parametrize("where", ["cpu", "disk"])
@pytest.mark.parametrize("case", list(BAD_PARTS))
def test_a_missing_or_misshapen_part_is_refused_naming_it_before_anything_is_read(
    folders: dict[str, Path], bnb4_double: Path, tmp_path: Path, case: str, where: str
) -> None:
    """A 4-bit absmax of 7 values for 64 blocks loaded and ran (reading past its end under
    autograd), a missing one raised a bare KeyError, a wrong-shaped scale failed at the first
    forward: each is named from the headers, with its file, what was expected and the fix."""
    stored, change, needles = BAD_PARTS[case]
    folder = _mutated(bnb4_double if stored == "bnb4dq" else folders[stored], tmp_path / "bad", change)
    model = bigviz.model_from_config(folder)
    with pytest.raises(CheckpointError) as err:
        bigviz.load_checkpoint_and_dispatch(model, folder, MAPS[where], offload_folder=tmp_path / "offload")
    message = str(err.value)
    for needle in [*needles, "(in model.safetensors)", "nothing was loaded", "copy its files again"]:
        assert needle in message, message
    assert "shape mismatch" not in message and len(err.value.problems) == 1, message  # only what is wrong
    assert all(p.is_meta for p in model.parameters())


def test_intact_double_quantized_4bit_still_loads_as_transformers_loads_it(bnb4_double: Path, tmp_path: Path) -> None:
    _, logits = _run(bnb4_double, MAPS["cpu"], tmp_path)
    assert torch.equal(logits, _transformers(bnb4_double))


@pytest.mark.parametrize(
    "config",
    [{"quant_method": "bitsandbytes", "load_in_4bit": True}, {"quant_method": "bitsandbytes", "load_in_8bit": True}],
)
def test_a_float_checkpoint_whose_config_claims_a_quantization_is_refused(
    folders: dict[str, Path], tmp_path: Path, config: dict
) -> None:
    folder = _with_config(folders["float"], tmp_path / "c", {"quantization_config": config})
    model = bigviz.model_from_config(folders["float"])
    with pytest.raises(CheckpointError, match="none of its tensors is") as err:
        bigviz.load_checkpoint_and_dispatch(model, folder, {"": "cpu"})
    assert "remove quantization_config from config.json" in str(err.value)
    assert all(p.is_meta for p in model.parameters())


# ---- transformers' config objects: carried out as from_pretrained does, or refused ----------------
def _unsupported_configs() -> dict[str, tuple[object, str]]:
    from torchao.quantization import Int8WeightOnlyConfig
    from torchao.quantization.granularity import PerGroup, PerTensor
    from transformers import BitsAndBytesConfig, TorchAoConfig

    return {
        "per group": (TorchAoConfig(Int8WeightOnlyConfig(granularity=PerGroup(32))), "granularity=PerGroup"),
        "per tensor": (TorchAoConfig(Int8WeightOnlyConfig(granularity=PerTensor())), "granularity=PerTensor"),
        "embeddings": (TorchAoConfig(Int8WeightOnlyConfig(), include_input_output_embeddings=True), "include_input"),
        "double quant": (BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_use_double_quant=True), "double_quant=True"),
        "storage": (
            BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_storage=torch.bfloat16),
            "quant_storage=bfloat16",
        ),
        "fp32 offload": (BitsAndBytesConfig(load_in_4bit=True, llm_int8_enable_fp32_cpu_offload=True), "cpu_offload"),
    }


@pytest.mark.parametrize("case", ["per group", "per tensor", "embeddings", "double quant", "storage", "fp32 offload"])
def test_a_transformers_config_setting_bigviz_does_not_carry_out_is_refused_naming_it(
    folders: dict[str, Path], case: str
) -> None:
    config, setting = _unsupported_configs()[case]
    model = bigviz.model_from_config(folders["float"])
    with pytest.raises(ValueError, match="bigviz does not carry these out") as err:
        bigviz.load_checkpoint_and_dispatch(model, folders["float"], {"": "cpu"}, quantization=config)
    assert setting in str(err.value) and "from_pretrained" in str(err.value)
    with pytest.raises(ValueError, match=setting):
        bigviz.plan(folders["float"], {"cpu": "1GiB"}, quantization=config)
    assert all(p.is_meta for p in model.parameters())


def _honoured_configs() -> dict[str, object]:
    from torchao.quantization import Int8WeightOnlyConfig
    from transformers import BitsAndBytesConfig, TorchAoConfig

    return {
        "skip mlp": BitsAndBytesConfig(load_in_4bit=True, llm_int8_skip_modules=["mlp"]),
        "skip down_proj": BitsAndBytesConfig(load_in_4bit=True, llm_int8_skip_modules=["down_proj"]),
        "skip none": BitsAndBytesConfig(load_in_4bit=True, llm_int8_skip_modules=[]),
        "bf16 compute": BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_compute_dtype=torch.bfloat16),
        "torchao skip layer 0": TorchAoConfig(Int8WeightOnlyConfig(), modules_to_not_convert=["model.layers.0"]),
    }


@pytest.mark.parametrize("case", ["skip mlp", "skip down_proj", "skip none", "bf16 compute", "torchao skip layer 0"])
def test_a_transformers_config_quantizes_what_from_pretrained_quantizes_bit_for_bit(
    folders: dict[str, Path], tmp_path: Path, case: str
) -> None:
    """Modules named to skip replace transformers' defaults (the lm_head is then quantized too),
    matched as transformers matches them; bnb_4bit_compute_dtype is the 4-bit layers' compute."""
    from transformers import LlamaForCausalLM

    config = _honoured_configs()[case]
    theirs = LlamaForCausalLM.from_pretrained(folders["float"], device_map="cpu", quantization_config=config)
    ours = _load(folders["float"], MAPS["cpu"], tmp_path, quantization=config)
    kinds = {n: type(p).__name__ for n, p in theirs.named_parameters()}
    assert {n: type(p).__name__ for n, p in ours.named_parameters()} == kinds
    if case.startswith("skip"):
        assert kinds["lm_head.weight"] == "Params4bit"  # no default skips once the config names its own
    computes = {n: getattr(m, "compute_dtype", None) for n, m in theirs.named_modules()}
    assert {n: getattr(m, "compute_dtype", None) for n, m in ours.named_modules()} == computes
    with torch.no_grad():
        assert torch.equal(ours(IDS).logits, theirs(IDS).logits)


# ---- bitsandbytes layers keep the checkpoint's bias dtype -----------------------------------------
@pytest.fixture(scope="module")
def qwen_bf16(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A tiny Qwen2 (biased q/k/v projections) in bfloat16, and stored in bitsandbytes 4-bit."""
    from transformers import BitsAndBytesConfig, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False,
    )  # fmt: skip
    root = tmp_path_factory.mktemp("qwen")
    Qwen2ForCausalLM(config).to(torch.bfloat16).save_pretrained(root / "float")
    stored = Qwen2ForCausalLM.from_pretrained(
        root / "float", quantization_config=BitsAndBytesConfig(load_in_4bit=True), device_map="cpu"
    )
    stored.save_pretrained(root / "bnb4")
    return {"float": root / "float", "bnb4": root / "bnb4"}


@pytest.mark.parametrize("source", ["float", "bnb4"])
def test_bitsandbytes_layers_keep_the_checkpoints_bias_dtype_so_held_bytes_equal_the_plan(
    qwen_bf16: dict[str, Path], tmp_path: Path, source: str
) -> None:
    kwargs = {"quantization": "int4"} if source == "float" else {}
    plan = bigviz.plan(qwen_bf16[source], {"cpu": "1GiB"}, **kwargs)
    model = _load(qwen_bf16[source], plan, tmp_path, **kwargs)
    assert model.model.layers[0].self_attn.q_proj.bias.dtype == torch.bfloat16  # bitsandbytes made it float32
    assert held_bytes(model)["cpu"] == plan.usage_of("cpu").used


# ---- saving a model quantized while loading ------------------------------------------------------
def test_saving_int8_tensor_subclasses_is_refused_saying_what_to_do(folders: dict[str, Path], tmp_path: Path) -> None:
    model = _load(folders["float"], MAPS["cpu"], tmp_path, quantization="int8")
    with pytest.raises(bigviz.UsageError, match="Int8Tensor tensor subclasses") as err:
        bigviz.save_sharded(model, tmp_path / "out", progress=False, config=model.config)
    assert "Save the float checkpoint" in str(err.value)
    assert not (tmp_path / "out").exists()


def test_saving_int4_without_a_quantization_config_is_refused_and_with_one_reloads_bit_for_bit(
    folders: dict[str, Path], tmp_path: Path
) -> None:
    from transformers import BitsAndBytesConfig

    model = _load(folders["float"], MAPS["cpu"], tmp_path, quantization="int4")
    with pytest.raises(bigviz.UsageError, match="has no quantization_config"):
        bigviz.save_sharded(model, tmp_path / "out", progress=False, config=model.config)
    assert not (tmp_path / "out").exists()
    config = model.config.to_dict() | {
        "quantization_config": BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4").to_dict()
    }
    bigviz.save_sharded(model, tmp_path / "out", progress=False, config=config)
    logits = _forward(model)
    assert torch.equal(_run(tmp_path / "out", MAPS["cpu"], tmp_path / "again")[1], logits)
    from bitsandbytes.functional import has_avx512bf16

    if has_avx512bf16():  # bitsandbytes repacks 4-bit weights for its CPU kernel at the first forward
        with pytest.raises(bigviz.UsageError, match="repacked for its CPU kernel"):
            bigviz.save_sharded(model, tmp_path / "later", progress=False, config=config)
        assert not (tmp_path / "later").exists()
    else:  # a CPU without AVX-512 BF16 keeps the stored layout: saved after a forward, it reloads the same
        bigviz.save_sharded(model, tmp_path / "later", progress=False, config=config)
        assert torch.equal(_run(tmp_path / "later", MAPS["cpu"], tmp_path / "again2")[1], logits)
