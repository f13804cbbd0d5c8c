"""Small reference architectures for teaching, demos and tests: GPT-2 and Llama families.

Each model lives in one readable file (:mod:`bigviz.models.gpt`, :mod:`bigviz.models.llama`);
both share a :class:`KVCache` and the same ``forward(idx, targets=None, *, cache=None)`` and
``generate(idx, max_new_tokens, ...)`` contract. Only torch is imported here. One small GPT
is shipped trained, so that its text is readable: :func:`tiny_gpt` (:mod:`bigviz.models.trained`).

Example:
    >>> import torch
    >>> with torch.device("meta"):
    ...     model = build("gpt2-xl")
    >>> round(sum(p.numel() for p in model.parameters()) / 1e9, 2)
    1.56
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import nn

from bigviz.models.cache import KVCache
from bigviz.models.gpt import GPT, GPT_PRESETS, Block, GPTConfig
from bigviz.models.llama import LLAMA_PRESETS, Llama, LlamaConfig, LlamaDecoderLayer
from bigviz.models.presets import from_config_dict
from bigviz.models.trained import decode_bytes, encode_bytes, tiny_corpus, tiny_gpt, tiny_gpt_folder

__all__ = [
    "GPT", "GPTConfig", "Block", "Llama", "LlamaConfig", "LlamaDecoderLayer", "KVCache",
    "build", "PRESETS", "MODEL_TYPES", "from_config",
    "tiny_gpt", "tiny_gpt_folder", "tiny_corpus", "encode_bytes", "decode_bytes",
]  # fmt: skip

# every preset name, for menus and error messages
PRESETS: tuple[str, ...] = (*GPT_PRESETS, *LLAMA_PRESETS)
# config.json "model_type" -> (config class, model class): how a checkpoint says what it holds
MODEL_TYPES: dict[str, tuple[type, type[nn.Module]]] = {
    GPTConfig.model_type: (GPTConfig, GPT),
    LlamaConfig.model_type: (LlamaConfig, Llama),
}


def build(name: str, **overrides: Any) -> nn.Module:
    """Build a reference model by preset name, picking the family from the name.

    Builds on the current default device, so wrap it in ``torch.device("meta")`` (or
    ``bigviz.init_empty_weights()``) to size a big model without allocating it.

    Args:
        name: A GPT preset ("gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl", "gpt-tiny",
            "gpt-mini") or a Llama preset ("llama-7b", "llama-13b", "llama-70b", "llama-tiny").
        **overrides: Config fields to change, e.g. ``n_layer=4`` or ``vocab_size=1000``.

    Raises:
        ValueError: ``name`` is not a preset (the message lists them all).

    Example:
        >>> type(build("llama-tiny", n_layers=1)).__name__
        'Llama'
    """
    if name in GPT_PRESETS:
        return GPT(GPTConfig.preset(name, **overrides))
    if name in LLAMA_PRESETS:
        return Llama(LlamaConfig.preset(name, **overrides))
    raise ValueError(f"unknown model preset {name!r}; valid presets: {', '.join(PRESETS)}")


def from_config(data: Mapping[str, Any]) -> nn.Module:
    """Build the reference model a ``config.json`` describes (``config.to_dict()`` data).

    Builds on the current default device (wrap in ``bigviz.init_empty_weights()`` to allocate
    nothing). Save a checkpoint that records its config with
    ``bigviz.save_sharded(model, folder, config=model.config)``.

    Raises:
        ValueError: an unknown ``model_type`` or unknown fields.

    Example:
        >>> model = from_config(GPTConfig.preset("gpt-tiny", n_layer=1).to_dict())
        >>> type(model).__name__, model.config.n_layer
        ('GPT', 1)
    """
    config = from_config_dict({k: v[0] for k, v in MODEL_TYPES.items()}, data)
    return MODEL_TYPES[type(config).model_type][1](config)
