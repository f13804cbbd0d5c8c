"""Models from their config alone: the configs bigviz ships (published hyperparameters of
well-known models), and a transformers model (or one of bigviz's reference models) built on
``meta`` from a ``config.json``, to plan a model you do not have.

Its own home, not the workload module's: planning, sizing and the CLI build models from
configs without planning a run.

Example:
    >>> model = model_from_config(config_path("llama-3.1-8b"))
    >>> type(model).__name__, next(model.parameters()).device.type
    ('LlamaForCausalLM', 'meta')
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from bigviz.core.errors import UsageError

__all__ = ["CONFIG_DIR", "model_from_config", "is_config_source", "shipped_configs", "config_path"]

_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")

CONFIG_DIR = Path(__file__).resolve().parents[1] / "configs"


def shipped_configs() -> list[str]:
    """Names of the configs bigviz ships (published hyperparameters of well-known models).

    Example:
        >>> "llama-3.1-70b" in shipped_configs() and "deepseek-v3" in shipped_configs()
        True
    """
    return sorted(p.stem for p in CONFIG_DIR.glob("*.json"))


def config_path(name: str) -> Path:
    """The path of a shipped config by name (``"llama-3.1-70b"``), to plan a model you do not have.

    Raises:
        ValueError: naming the configs there are.

    Example:
        >>> config_path("mixtral-8x7b").name
        'mixtral-8x7b.json'
    """
    path = CONFIG_DIR / f"{name.removesuffix('.json')}.json"
    if not path.is_file():
        raise UsageError(f"bigviz ships no config named {name!r}; it has: {', '.join(shipped_configs())}")
    return path


def is_config_source(source: object) -> bool:
    """True for a ``config.json`` path, or a folder that holds a ``config.json`` and no weights.

    Example:
        >>> import json, os, tempfile
        >>> folder = tempfile.mkdtemp()
        >>> _ = open(os.path.join(folder, "config.json"), "w").write("{}")
        >>> is_config_source(folder), is_config_source(os.path.join(folder, "nothing.json"))
        (True, False)
    """
    if not isinstance(source, (str, os.PathLike)):
        return False
    path = Path(source)
    if path.is_file():
        return path.suffix == ".json" and not path.name.endswith("index.json")
    if path.is_dir() and (path / "config.json").is_file():
        return not any(p.name.endswith(_WEIGHT_SUFFIXES) for p in path.iterdir())
    return False


def model_from_config(source: Any) -> nn.Module:
    """Build a transformers model on ``meta`` (no memory) from its config alone.

    ``source`` is a ``config.json`` path, a folder holding one, a dict of its contents or a
    ``PretrainedConfig``. The architecture named in the config is built (a causal LM when the
    config names one, else the base model), in the config's dtype, with its ties made. A
    config of one of bigviz's reference models (``bigviz.save_sharded(model, folder,
    config=model.config)`` writes one) builds that model, without transformers.

    Raises:
        ValueError: when the file is not JSON, names no model type transformers knows, or
            transformers is not installed (saying how to install it).

    Example:
        >>> model = model_from_config(config_path("mixtral-8x7b"))
        >>> type(model).__name__, round(sum(p.numel() for p in model.parameters()) / 1e9, 1)
        ('MixtralForCausalLM', 46.7)
    """
    reference = _reference_model(source)
    if reference is not None:
        return reference
    try:
        from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, PretrainedConfig
    except ImportError as err:  # an optional dependency: planning from checkpoints needs none
        raise UsageError(
            "planning from a config.json builds the model with transformers: pip install transformers"
        ) from err
    config = _read_config(source, AutoConfig, PretrainedConfig)
    dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    dtype = getattr(torch, str(dtype).removeprefix("torch."), None) if dtype is not None else None
    kwargs = {"dtype": dtype} if isinstance(dtype, torch.dtype) else {}
    with torch.device("meta"):
        try:
            model = AutoModelForCausalLM.from_config(config, **kwargs)
        except ValueError:  # no causal-LM head for this architecture: the base model
            model = AutoModel.from_config(config, **kwargs)
    model.tie_weights()
    return model.eval()


def _reference_model(source: Any) -> nn.Module | None:
    """The bigviz reference model a config describes (on meta, eval), or None for any other."""
    from bigviz.models import MODEL_TYPES, from_config

    data: Any = source
    if isinstance(source, (str, os.PathLike)):
        path = Path(source) / "config.json" if Path(source).is_dir() else Path(source)
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            return None  # not readable here: _read_config says why
    if not isinstance(data, Mapping) or data.get("model_type") not in MODEL_TYPES:
        return None
    with torch.device("meta"):
        return from_config(data).eval()


def _read_config(source: Any, auto_config: Any, base: type) -> Any:
    if isinstance(source, base):
        return source
    if isinstance(source, Mapping):
        data = dict(source)
        where = "the config dict"
    else:
        path = Path(source)
        path = path / "config.json" if path.is_dir() else path
        where = str(path)
        try:
            data = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as err:
            raise UsageError(f"cannot read {where} as a model config: {err}") from err
    model_type = data.pop("model_type", None)
    if not model_type:
        raise UsageError(
            f'{where} has no \'model_type\' key: it must be a transformers config.json (e.g. "model_type": "llama")'
        )
    try:
        return auto_config.for_model(model_type, **data)
    except (ValueError, KeyError) as err:
        raise UsageError(
            f"{where}: model_type {model_type!r} is not one transformers knows ({err}); "
            f"upgrade transformers or check the file"
        ) from err
