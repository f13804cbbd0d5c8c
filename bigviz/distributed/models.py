"""The model a checkpoint folder describes, built with no weights: what every rank starts from.

A checkpoint folder says what it holds in ``config.json``: ``model_type`` ``"bigviz-gpt"`` or
``"bigviz-llama"`` for bigviz's reference models (written by
``bigviz.save_sharded(model, folder, config=model.config)``), anything else for transformers
(written by ``save_pretrained``; built with ``AutoConfig`` and
``AutoModelForCausalLM.from_config``). Weights are built on ``meta`` and buffers for real
(``bigviz.init_empty_weights``), so a rotary embedding's computed ``inv_freq`` is usable.

Example:
    >>> import tempfile, pathlib, torch, bigviz
    >>> from bigviz.models import GPT, GPTConfig
    >>> model = GPT(GPTConfig.preset("gpt-tiny"))
    >>> folder = bigviz.save_sharded(model, pathlib.Path(tempfile.mkdtemp()) / "ckpt",
    ...                              config=model.config, progress=False)
    >>> empty = empty_model(folder)
    >>> type(empty).__name__, empty.lm_head.weight.device.type, checkpoint_dtype(folder)
    ('GPT', 'meta', 'float32')
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

from torch import nn

from bigviz.checkpoint.index import CheckpointIndex
from bigviz.core.pipeline import PipelineError
from bigviz.core.dtypes import FLOATING_DTYPES
from bigviz.modeling.configs import NO_REMOTE_CODE, building, checked_config, hf_config
from bigviz.modeling.meta import init_empty_weights
from bigviz.models import MODEL_TYPES, from_config

__all__ = ["read_config", "empty_model", "checkpoint_dtype", "generation_config"]


def _folder(checkpoint: str | Path) -> Path:
    path = Path(checkpoint)
    return path if path.is_dir() else path.parent


def read_config(checkpoint: str | Path) -> dict[str, Any]:
    """``config.json`` of a checkpoint folder (or of the folder holding a checkpoint file), checked
    as :func:`bigviz.modeling.configs.checked_config` checks it (no ``auto_map``: no code is run
    from the checkpoint; sizing numbers in range).

    Raises:
        PipelineError: no such file, or no ``model_type``; with the fix.
        ConfigError: (a ``ValueError``) not a JSON object, ``auto_map``, numbers out of range.
    """
    path = _folder(checkpoint) / "config.json"
    fix = (
        "Fix: save bigviz models with bigviz.save_sharded(model, folder, config=model.config) and "
        "transformers models with model.save_pretrained(folder)"
    )
    if not path.is_file():
        raise PipelineError(f"{path} does not exist: the checkpoint does not say which model it holds", fix=fix)
    data, _where = checked_config(path)
    if not isinstance(data.get("model_type"), str):
        raise PipelineError(f"{path} has no 'model_type': cannot tell which model to build", fix=fix)
    return data


def empty_model(checkpoint: str | Path) -> nn.Module:
    """The model ``checkpoint``'s ``config.json`` describes: weights on meta, buffers real, eval mode.

    Raises:
        PipelineError: no usable config.
        ConfigError: a config bigviz does not build from, or a transformers model without
            transformers installed.
    """
    config = read_config(checkpoint)
    where = str(_folder(checkpoint) / "config.json")
    if config["model_type"] in MODEL_TYPES:
        with init_empty_weights(), building(f"a {config['model_type']!r} model", where):
            return from_config(config).eval()
    hf_config_ = hf_config(config, where)
    from transformers import AutoModelForCausalLM

    with init_empty_weights(), building(f"a {config['model_type']!r} model", where):
        return AutoModelForCausalLM.from_config(hf_config_, **NO_REMOTE_CODE).eval()


def checkpoint_dtype(checkpoint: str | Path | CheckpointIndex) -> str | None:
    """The floating dtype holding most of a checkpoint's bytes (``None`` when it has none)."""
    index = CheckpointIndex.open(checkpoint)
    counts: Counter[str] = Counter()
    for info in index.entries.values():
        if info.dtype in FLOATING_DTYPES:
            counts[info.dtype] += info.nbytes
    return counts.most_common(1)[0][0] if counts else None


def generation_config(checkpoint: str | Path) -> Any:
    """What single-process ``generate`` reads for this checkpoint: transformers'
    ``GenerationConfig`` from ``generation_config.json`` (as ``from_pretrained`` loads it),
    else the one the model's config implies; ``None`` for bigviz's models (their
    ``generate`` knows no end-of-sequence token).

    Example:
        >>> import tempfile, pathlib, bigviz
        >>> from bigviz.models import GPT, GPTConfig
        >>> model = GPT(GPTConfig.preset("gpt-tiny"))
        >>> folder = bigviz.save_sharded(model, pathlib.Path(tempfile.mkdtemp()) / "c",
        ...                              config=model.config, progress=False)
        >>> generation_config(folder) is None
        True
    """
    config = read_config(checkpoint)
    if config["model_type"] in MODEL_TYPES:
        return None
    from transformers import AutoConfig, GenerationConfig

    folder = _folder(checkpoint)
    if (folder / "generation_config.json").is_file():
        return GenerationConfig.from_pretrained(folder)
    return GenerationConfig.from_model_config(AutoConfig.from_pretrained(folder))
