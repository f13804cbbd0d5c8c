"""Promise: a checkpoint stored quantized is never loaded as garbage. One bigviz cannot run here
(its ``config.json`` names a ``quant_method`` without a CPU path, a library is missing, a part
is missing) is refused before anything is read, naming the ``quant_method`` and what to do; and
``strict=False`` never drops the tensors that carry a quantization role (scales, packed values,
zero points), even when the ``quantization_config`` is gone. Checkpoints written by hand in
each layout; the model stays on meta and the files byte-identical."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import bigviz
from bigviz.checkpoint.errors import CheckpointError

from tests.hostile.helpers import snapshot

transformers = pytest.importorskip("transformers")

LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _config(quantization: object = None) -> dict:
    from transformers import LlamaConfig

    config = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=32, tie_word_embeddings=False,
    ).to_dict() | {"architectures": ["LlamaForCausalLM"]}  # fmt: skip
    if quantization is not None:
        config["quantization_config"] = quantization
    return config


def _state() -> dict[str, torch.Tensor]:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = {k: v for k, v in _config().items() if k not in ("architectures", "transformers_version")}
    return {k: v.contiguous() for k, v in LlamaForCausalLM(LlamaConfig(**config)).state_dict().items()}


def _write(
    folder: Path, state: dict[str, torch.Tensor], quantization: object = None, metadata: dict | None = None
) -> dict:
    folder.mkdir(parents=True)
    save_file(state, folder / "model.safetensors", metadata={"format": "pt", **(metadata or {})})
    (folder / "config.json").write_text(json.dumps(_config(quantization)))
    return snapshot(folder)


def _linear(name: str) -> bool:
    return name.endswith(tuple(f"{p}.weight" for p in LINEAR))


def _layout(kind: str) -> tuple[dict[str, torch.Tensor], dict]:
    """A tiny Llama's state in a quantizer's layout (values need not be right: nothing is read)."""
    state, metadata = {}, {}
    for key, value in _state().items():
        module = key.removesuffix(".weight")
        if not _linear(key):
            state[key] = value
        elif kind == "torchao":
            rows = value.shape[0]
            state |= {
                f"{module}._weight_qdata": value.to(torch.int8),
                f"{module}._weight_scale": torch.ones(rows, 1),
                f"{module}._weight_zero_point": torch.zeros(rows, 1, dtype=torch.int8),
            }
        elif kind == "bnb8":
            state |= {key: value.to(torch.int8), f"{module}.SCB": torch.ones(value.shape[0])}
        elif kind == "fp8":
            state |= {key: value.to(torch.float8_e4m3fn), f"{module}.weight_scale_inv": torch.ones(1, 1)}
        elif kind == "compressed-tensors":
            state |= {
                f"{module}.weight_packed": value.to(torch.int32)[:, ::4].contiguous(),
                f"{module}.weight_scale": torch.ones(value.shape[0], 1),
                f"{module}.weight_shape": torch.tensor(list(value.shape)),
            }
        elif kind == "gptq":
            state |= {
                f"{module}.qweight": value.to(torch.int32)[::8].contiguous(),
                f"{module}.qzeros": torch.zeros(1, value.shape[0] // 8, dtype=torch.int32),
                f"{module}.scales": torch.ones(1, value.shape[0]),
                f"{module}.g_idx": torch.zeros(value.shape[1], dtype=torch.int32),
            }
    return state, metadata


def _refused(call, model: torch.nn.Module, folder: Path, files: dict, *needles: str) -> str:
    with pytest.raises((CheckpointError, ImportError)) as err:
        call()
    message = str(err.value)
    for needle in needles:
        assert needle in message, message
    assert all(p.is_meta for p in model.parameters()), "nothing may be loaded"
    assert snapshot(folder) == files
    return message


@pytest.mark.parametrize(
    "kind, config",
    [
        ("gptq", {"quant_method": "gptq", "bits": 4, "group_size": 128}),
        ("gptq", {"quant_method": "awq", "bits": 4}),
        (
            "compressed-tensors",
            {
                "quant_method": "compressed-tensors",
                "format": "pack-quantized",
                "config_groups": {"g": {"targets": ["Linear"], "input_activations": {"num_bits": 8}}},
            },
        ),
        ("torchao", {"quant_method": "quanto", "weights": "int8"}),
        ("torchao", {"quant_method": "some-new-method"}),
        ("torchao", "int8"),  # not even an object
    ],
)
@pytest.mark.parametrize("entry", ["load_checkpoint_and_dispatch", "load_checkpoint_in_model", "load_plan"])
def test_a_quant_method_without_a_cpu_path_is_refused_up_front_naming_it(
    tmp_path: Path, kind: str, config: object, entry: str
) -> None:
    state, metadata = _layout(kind)
    folder = tmp_path / "ckpt"
    files = _write(folder, state, config, metadata)
    model = bigviz.model_from_config(_config())
    calls = {
        "load_checkpoint_and_dispatch": lambda: bigviz.load_checkpoint_and_dispatch(model, folder, {"": "cpu"}),
        "load_checkpoint_in_model": lambda: bigviz.load_checkpoint_in_model(model, folder, strict=False),
        "load_plan": lambda: bigviz.load_plan(model, folder),
    }
    method = config["quant_method"] if isinstance(config, dict) else repr(config)
    message = _refused(calls[entry], model, folder, files, "stored quantized", f"quant_method {method!r}")
    assert "quantization='int8'" in message or "compressed" in message  # and what to do instead


@pytest.mark.parametrize("kind", ["torchao", "bnb8", "fp8", "compressed-tensors", "gptq"])
def test_strict_false_never_drops_quantization_tensors_when_the_config_says_nothing(tmp_path: Path, kind: str) -> None:
    state, metadata = _layout(kind)
    folder = tmp_path / "ckpt"
    files = _write(folder, state, None, metadata)  # its quantization_config lost
    model = bigviz.model_from_config(_config())
    message = _refused(
        lambda: bigviz.load_checkpoint_in_model(model, folder, strict=False, progress=False),
        model,
        folder,
        files,
        "never dropped",
        "strict=False",
    )
    role = {"torchao": "_weight_scale", "bnb8": ".SCB", "fp8": "weight_scale_inv", "compressed-tensors": "weight_packed",
            "gptq": "qweight"}[kind]  # fmt: skip
    assert role in message


def test_strict_false_never_drops_them_from_a_plain_module_either(tmp_path: Path) -> None:
    folder = tmp_path / "ckpt"
    folder.mkdir()
    save_file({"weight": torch.ones(2, 2, dtype=torch.int8), "SCB": torch.ones(2), "bias": torch.zeros(2)},
              folder / "model.safetensors")  # fmt: skip
    with torch.device("meta"):
        model = torch.nn.Linear(2, 2)
    files = snapshot(folder)
    _refused(lambda: bigviz.load_checkpoint_in_model(model, folder, strict=False), model, folder, files, "SCB")


def test_an_fp8_weight_without_its_scale_is_named(tmp_path: Path) -> None:
    state, _ = _layout("fp8")
    dropped = next(k for k in state if k.endswith("weight_scale_inv"))
    del state[dropped]
    folder = tmp_path / "ckpt"
    files = _write(folder, state, {"quant_method": "fp8", "weight_block_size": [128, 128]})
    model = bigviz.model_from_config(_config())
    weight = dropped.removesuffix("_scale_inv")
    _refused(
        lambda: bigviz.load_checkpoint_and_dispatch(model, folder, {"": "cpu"}),
        model,
        folder,
        files,
        "without their weight_scale_inv",
        weight,
    )


def test_a_stored_quantization_that_cannot_run_is_still_planned_from_its_headers(tmp_path: Path) -> None:
    state, _ = _layout("gptq")
    folder = tmp_path / "ckpt"
    _write(folder, state, {"quant_method": "gptq", "bits": 4})
    plan = bigviz.plan(folder, {"cpu": "1GiB"})
    stored = sum(t.numel() * t.element_size() for t in state.values())
    assert plan.usage_of("cpu").used <= stored + 4 * 1024  # as stored (computed buffers aside), not as float32
