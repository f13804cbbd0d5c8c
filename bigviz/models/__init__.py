"""Small reference architectures for teaching, demos and tests: GPT-2 and Llama families.

Each model lives in one readable file (:mod:`bigviz.models.gpt`, :mod:`bigviz.models.llama`);
both share a :class:`KVCache` and the same ``forward(idx, targets=None, *, cache=None)`` and
``generate(idx, max_new_tokens, ...)`` contract. Only torch is imported here.

Example:
    >>> import torch
    >>> with torch.device("meta"):
    ...     model = build("gpt2-xl")
    >>> round(sum(p.numel() for p in model.parameters()) / 1e9, 2)
    1.56
"""
from __future__ import annotations

from typing import Any

from torch import nn

from bigviz.models.cache import KVCache
from bigviz.models.gpt import GPT, GPT_PRESETS, Block, GPTConfig
from bigviz.models.llama import LLAMA_PRESETS, Llama, LlamaConfig, LlamaDecoderLayer

__all__ = [
    "GPT", "GPTConfig", "Block", "Llama", "LlamaConfig", "LlamaDecoderLayer", "KVCache",
    "build", "PRESETS",
]  # fmt: skip

# every preset name, for menus and error messages
PRESETS: tuple[str, ...] = (*GPT_PRESETS, *LLAMA_PRESETS)


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
