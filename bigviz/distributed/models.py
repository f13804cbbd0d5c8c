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

import json
from collections import Counter
from pathlib import Path
from typing import Any

from torch import nn

from bigviz.checkpoint.index import CheckpointIndex
from bigviz.core.pipeline import PipelineError
from bigviz.core.dtypes import FLOATING_DTYPES
from bigviz.modeling.meta import init_empty_weights
from bigviz.models import MODEL_TYPES, from_config

__all__ = ["read_config", "empty_model", "checkpoint_dtype", "generation_config"]


def _folder(checkpoint: str | Path) -> Path:
    path = Path(checkpoint)
    return path if path.is_dir() else path.parent


def read_config(checkpoint: str | Path) -> dict[str, Any]:
    """``config.json`` of a checkpoint folder (or of the folder holding a checkpoint file).

    Raises:
        PipelineError: no such file, or not a JSON object with a ``model_type``; with the fix.
    """
    path = _folder(checkpoint) / "config.json"
    fix = (
        "Fix: save bigviz models with bigviz.save_sharded(model, folder, config=model.config) and "
        "transformers models with model.save_pretrained(folder)"
    )
    if not path.is_file():
        raise PipelineError(f"{path} does not exist: the checkpoint does not say which model it holds", fix=fix)
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise PipelineError(f"{path} is not valid JSON ({err})", fix=fix) from err
    if not isinstance(data, dict) or not isinstance(data.get("model_type"), str):
        raise PipelineError(f"{path} has no 'model_type': cannot tell which model to build", fix=fix)
    return data


def empty_model(checkpoint: str | Path) -> nn.Module:
    """The model ``checkpoint``'s ``config.json`` describes: weights on meta, buffers real, eval mode.

    Raises:
        PipelineError: no usable config, or a transformers model without transformers installed.
    """
    config = read_config(checkpoint)
    if config["model_type"] in MODEL_TYPES:
        with init_empty_weights():
            return from_config(config).eval()
    try:
        from transformers import AutoConfig, AutoModelForCausalLM
    except ImportError as err:
        raise PipelineError(
            f"{checkpoint} holds a transformers model ({config['model_type']}), and transformers is not installed",
            fix="Fix: pip install transformers",
        ) from err
    hf_config = AutoConfig.from_pretrained(_folder(checkpoint))
    with init_empty_weights():
        return AutoModelForCausalLM.from_config(hf_config).eval()


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
