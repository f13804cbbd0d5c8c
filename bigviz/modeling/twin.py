"""A transformers model built again on ``meta`` from its own class and config: a *twin*, to
ask the architecture what it does without touching the user's model or allocating a byte.

Two questions are answered this way, both by transformers' own code rather than by a table
of field names:

* what a run's cache keeps (:mod:`bigviz.modeling.cache_probe` runs a step on a twin);
* what dtype ``from_pretrained(dtype=...)`` gives a buffer the model computes in
  ``__init__``: transformers builds the model under ``torch.set_default_dtype(dtype)``, so a
  float buffer made without an explicit dtype (Falcon-H1's ``mup_vector``, Gemma's
  ``embed_scale``) follows it, while one computed in float32 on purpose (rotary ``inv_freq``)
  stays float32. A twin built with ``dtype`` holds exactly those dtypes.

Twins are cached per (class, config, dtype, kernels): building one for a large model takes
a second or two on meta, and ``max_context`` plans many times.

Example:
    >>> import torch
    >>> meta_twin(torch.nn.Linear(2, 2), torch.bfloat16) is None    # not a transformers model
    True
"""

from __future__ import annotations

import copy
import sys
from collections import OrderedDict
from typing import Any

import torch
from torch import nn

__all__ = ["meta_twin", "computed_buffer_dtypes", "is_transformers_model"]


def is_transformers_model(model: object) -> bool:
    """True for a transformers ``PreTrainedModel`` (checked without importing transformers).

    Example:
        >>> is_transformers_model(torch.nn.Linear(1, 1))
        False
    """
    if "transformers" not in sys.modules:
        return False
    from transformers import PreTrainedModel

    return isinstance(model, PreTrainedModel)


def meta_twin(
    model: nn.Module, dtype: torch.dtype, *, attn_implementation: str | None = None, probe: bool = False
) -> nn.Module | None:
    """``type(model)`` built again from ``model.config`` on ``meta``, as ``from_pretrained``
    builds it under ``dtype`` (eval mode), or None for a model transformers cannot rebuild.

    Args:
        model: a transformers ``PreTrainedModel`` (its weights are never read).
        dtype: the default dtype the twin is built under.
        attn_implementation: the twin's attention kernel (``"eager"`` runs on meta with any
            mask; the cache it fills has the same shapes under every kernel).
        probe: build it to run a step on meta: experts then use transformers' ``batched_mm``
            path (its ``grouped_mm`` and eager routing need real data on some dtypes).
    """
    if not is_transformers_model(model):
        return None
    config = getattr(model, "config", None)
    try:
        key = config.to_json_string(use_diff=False)  # type: ignore[union-attr]
    except Exception:  # noqa: BLE001 - a config that does not serialise: no twin, no cache
        return None
    cache_key = (type(model), key, dtype, attn_implementation, probe)
    if cache_key not in _TWINS:
        _TWINS[cache_key] = _build(type(model), config, dtype, attn_implementation, probe)
        while len(_TWINS) > 4:  # a few twins (meta: modules, no storage), most recent kept
            _TWINS.popitem(last=False)
    _TWINS.move_to_end(cache_key)
    return _TWINS[cache_key]


_TWINS: OrderedDict[tuple[Any, ...], nn.Module | None] = OrderedDict()


def _build(
    cls: type, config: Any, dtype: torch.dtype, attn_implementation: str | None, probe: bool
) -> nn.Module | None:
    kwargs: dict[str, Any] = {"dtype": dtype}
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    if probe and getattr(cls, "_can_set_experts_implementation", lambda: False)():
        kwargs["experts_implementation"] = "batched_mm"
    try:
        with torch.device("meta"):
            twin = cls._from_config(copy.deepcopy(config), **kwargs)  # _from_config writes its dtype into the config
    except Exception:  # noqa: BLE001 - any failure means "cannot be asked this way"; callers fall back
        return None
    return twin.eval()


def computed_buffer_dtypes(model: nn.Module, dtype: torch.dtype) -> dict[str, torch.dtype]:
    """The dtype ``from_pretrained(dtype=dtype)`` gives each non-persistent buffer of ``model``
    (the buffers the model computes itself), read from a twin built under ``dtype``; empty for
    a model transformers cannot rebuild.

    Example:
        >>> import transformers
        >>> config = transformers.LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        ...                                   num_attention_heads=2, vocab_size=10)
        >>> model = transformers.LlamaForCausalLM(config)
        >>> computed_buffer_dtypes(model, torch.bfloat16)["model.rotary_emb.inv_freq"]   # float32 on purpose
        torch.float32
    """
    twin = meta_twin(model, dtype)
    if twin is None:
        return {}
    out = {}
    for name, module in twin.named_modules():
        for buffer in module._non_persistent_buffers_set:
            tensor = module._buffers.get(buffer)
            if tensor is not None:
                out[f"{name}.{buffer}" if name else buffer] = tensor.dtype
    return out
