"""Quantizing a model's weights: which weights, made with which library, and the model
prepared for them (torch side of :mod:`bigviz.core.quant`).

bigviz quantizes with the libraries transformers uses on a CPU and calls them as transformers
does, so a weight quantized while bigviz loads it is the weight ``from_pretrained(...,
quantization_config=...)`` makes from the same float tensor:

* ``int8``: torchao's ``Int8WeightOnlyConfig`` through ``torchao.quantization.quantize_`` on
  the linear layer (transformers' ``TorchAoQuantize``); the weight becomes an ``Int8Tensor``,
  and its layer an :class:`~bigviz.modeling.int8_linear.Int8Linear`, which runs it on torch's
  packed CPU kernel (torchao's own CPU path widens the whole weight at every call).
* ``int4``: bitsandbytes 4-bit: the linear layers are replaced by ``bnb.nn.Linear4bit`` on
  ``meta`` (transformers' ``replace_with_bnb_linear``), and each weight becomes a
  ``Params4bit`` made as transformers' ``Bnb4bitQuantize`` makes it.

Which weights (:func:`quant_targets`): the weights of ``nn.Linear`` layers, except the modules
transformers keeps in high precision (``get_keys_to_not_convert``: output embeddings, tied
weights, the module of the last parameter; and ``_keep_in_fp32_modules``), and the config's
``modules_to_not_convert``. For a model that is not a transformers model the same rule is
applied to its own ties, ``get_output_embeddings()`` if it has one, and its last parameter.

torchao and bitsandbytes are optional (``pip install 'bigviz[quant]'``): :func:`require` says
which is missing, before anything is loaded.

Example:
    >>> import torch.nn as nn
    >>> model = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 10))
    >>> quant_targets(model, as_quant_config("int8"))  # the last module stays in float
    ['1.weight']
"""

from __future__ import annotations

import importlib.util
import re
import sys
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from bigviz.core.errors import UsageError
from bigviz.core.names import join, parent
from bigviz.core.quant import QuantConfig
from bigviz.core.quant import as_quant_config as _core_config
from bigviz.modeling.int8_linear import use_int8_kernel
from bigviz.modeling.inventory import ModelInventory
from bigviz.modeling.twin import is_transformers_model

__all__ = [
    "as_quant_config",
    "TransformersQuantConfig",
    "require",
    "not_converted",
    "quant_targets",
    "prepare_model",
    "quantize_weight",
    "replace_linear",
    "torch_dtype",
    "quiet_torchao",
    "QuantizationUnavailable",
]

_INSTALL = "pip install 'bigviz[quant]'"


class QuantizationUnavailable(ImportError):
    """A quantization needs a library that is not installed (the message says which and how)."""


def require(library: str, why: str) -> None:
    """Raise :class:`QuantizationUnavailable` when ``library`` cannot be imported.

    Example:
        >>> require("torch", "tensors")  # present: nothing happens
    """
    if importlib.util.find_spec(library) is None:
        raise QuantizationUnavailable(
            f"{why} needs the {library} package, which is not installed: {_INSTALL} "
            f"(or pip install {library}); nothing was loaded"
        )


def quiet_torchao() -> None:
    """Import torchao without its import-time noise: it logs a warning, with the file's absolute
    path, for each prebuilt kernel library this machine cannot load (CUDA ones on a CPU), and
    torch warns about an enum it registers. Neither concerns the CPU kernels bigviz uses."""
    if "torchao" in sys.modules:
        return
    import logging

    loggers = [logging.getLogger(n) for n in ("torchao", "torch.utils._pytree")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        import torchao  # noqa: F401
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


@dataclass(frozen=True)
class TransformersQuantConfig(QuantConfig):
    """A :class:`~bigviz.core.quant.QuantConfig` made from a transformers config object, which
    carries out two of its settings as ``from_pretrained`` does with the same object.

    Attributes:
        default_skips: also keep transformers' own high-precision modules (the output
            embeddings, tied weights, the last module). transformers adds them only when the
            config names no modules (``llm_int8_skip_modules`` / ``modules_to_not_convert`` is
            None): a config that names its own keeps only those (and ``_keep_in_fp32_modules``).
        compute_dtype: the dtype bitsandbytes' 4-bit layers compute in
            (``bnb_4bit_compute_dtype``, float32 unless set), whatever the model's dtype.

    The config's modules are matched as transformers matches them (``should_convert_module``:
    from the start of a name up to a dot, as a regex, or as a suffix), so ``"mlp"`` skips
    ``mlp`` but not ``model.layers.0.mlp.up_proj``.

    Example:
        >>> TransformersQuantConfig("int8", modules_to_not_convert=("mlp",), default_skips=False).skips("layers.0.mlp.fc")
        False
    """

    default_skips: bool = True
    compute_dtype: str | None = None

    def skips(self, module: str) -> bool:
        return not _converts(module, self.modules_to_not_convert)


def as_quant_config(value: object) -> QuantConfig | None:
    """A :class:`~bigviz.core.quant.QuantConfig` from ``"int8"``, ``"int4"``, ``None``, a
    ``QuantConfig``, or a transformers config: ``TorchAoConfig(Int8WeightOnlyConfig())`` or
    ``BitsAndBytesConfig(load_in_4bit=True, ...)`` (a :class:`TransformersQuantConfig`: its quant
    type, compute dtype and skipped modules kept, by transformers' rule). A setting bigviz does
    not carry out (a granularity other than per row, double quantization, ...) is refused, not
    dropped: the weights would differ from ``from_pretrained``'s with the same object.

    Raises:
        ValueError: a config bigviz does not run, or a setting of it bigviz does not carry out
            (each named, with what it takes instead).

    Example:
        >>> as_quant_config("int4").quant_type
        'nf4'
    """
    method = getattr(value, "quant_method", None)
    if method is None or isinstance(value, (str, QuantConfig)):
        return _core_config(value)
    method = str(getattr(method, "value", method))
    skip = getattr(value, "modules_to_not_convert", None)
    if skip is None:
        skip = getattr(value, "llm_int8_skip_modules", None)
    named = {"modules_to_not_convert": tuple(skip or ()), "default_skips": skip is None}
    if method == "torchao":
        kind = type(getattr(value, "quant_type", None)).__name__
        if kind == "Int8WeightOnlyConfig":
            _refuse_settings(f"TorchAoConfig({kind})", _torchao_unsupported(value), "int8")
            return TransformersQuantConfig("int8", **named)  # type: ignore[arg-type]
        raise UsageError(
            f"quantization=TorchAoConfig({kind}): bigviz quantizes with torchao's Int8WeightOnlyConfig only "
            "(the torchao config with a CPU kernel here); use quantization='int8', or 'int4' (bitsandbytes)"
        )
    if method == "bitsandbytes" and getattr(value, "load_in_4bit", False):
        _refuse_settings("BitsAndBytesConfig(load_in_4bit=True)", _bnb4_unsupported(value), "int4")
        compute = str(getattr(value, "bnb_4bit_compute_dtype", None) or "float32").removeprefix("torch.")
        return TransformersQuantConfig(
            "int4",
            quant_type=str(value.bnb_4bit_quant_type),
            compute_dtype=compute,
            **named,  # type: ignore[arg-type]
        )
    raise UsageError(
        f"quantization config {type(value).__name__} ({method}): bigviz quantizes while loading with "
        "'int8' (torchao) or 'int4' (bitsandbytes 4-bit); a checkpoint stored quantized (bitsandbytes 8-bit "
        "included) loads as it is, with no quantization= argument"
    )


def _torchao_unsupported(value: Any) -> list[str]:
    """The settings of a ``TorchAoConfig(Int8WeightOnlyConfig(...))`` bigviz does not carry out:
    it quantizes per output row (torchao's default, ``PerRow()``) and leaves embeddings as they are."""
    quant = value.quant_type
    out = []
    granularity = getattr(quant, "granularity", None)
    if type(granularity).__name__ != "PerRow" or getattr(granularity, "dim", -1) != -1:
        out.append(f"granularity={granularity!r} (bigviz quantizes per row: PerRow())")
    if getattr(quant, "group_size", None) is not None:
        out.append(f"group_size={quant.group_size!r} (bigviz quantizes per row)")
    for flag in ("include_input_output_embeddings", "untie_embedding_weights"):
        if getattr(value, flag, False):
            out.append(f"{flag}=True (bigviz keeps the embeddings in high precision, tied as they are)")
    return out


def _bnb4_unsupported(value: Any) -> list[str]:
    """The settings of a ``BitsAndBytesConfig(load_in_4bit=True, ...)`` bigviz does not carry
    out: it packs one float32 absmax per 64 values into uint8 and quantizes wherever a layer lives."""
    out = []
    if getattr(value, "bnb_4bit_use_double_quant", False):
        out.append("bnb_4bit_use_double_quant=True (bigviz quantizes with one float32 absmax per 64 values)")
    storage = str(getattr(value, "bnb_4bit_quant_storage", None) or "uint8").removeprefix("torch.")
    if storage != "uint8":
        out.append(f"bnb_4bit_quant_storage={storage} (bigviz stores packed 4-bit values as uint8)")
    if getattr(value, "llm_int8_enable_fp32_cpu_offload", False):
        out.append(
            "llm_int8_enable_fp32_cpu_offload=True (bigviz quantizes layers on the CPU and disk too; name the "
            "modules to keep in high precision in llm_int8_skip_modules)"
        )
    return out


def _refuse_settings(what: str, problems: Sequence[str], method: str) -> None:
    if problems:
        raise UsageError(
            f"quantization={what} with {'; '.join(problems)}: bigviz does not carry these out, and would not "
            f"quantize as from_pretrained does with this config. Leave them at their defaults (or pass "
            f"quantization={method!r}), or load with transformers' from_pretrained"
        )


def not_converted(model: nn.Module | ModelInventory, *, defaults: bool = True) -> list[str]:
    """Module names kept in high precision by default: transformers' rule
    (``get_keys_to_not_convert`` and ``_keep_in_fp32_modules``) for its models; for others the
    same rule on the model's own ties, output embeddings and last parameter. ``defaults=False``
    (a transformers config that names its own modules): ``_keep_in_fp32_modules`` only.

    Example:
        >>> sorted(not_converted(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))))
        ['1']
    """
    inventory = ModelInventory.of(model)
    module = inventory.model
    if is_transformers_model(module):
        from transformers.quantizers.base import get_keys_to_not_convert

        keep = list(getattr(module, "_keep_in_fp32_modules", None) or [])
        return sorted((set(get_keys_to_not_convert(module)) if defaults else set()) | set(keep))
    if not defaults:
        return []
    names = {parent(n) for group in inventory.ties for n in group}
    params = [n for n, (_, _, kind) in inventory.slots.items() if kind == "param"]
    if params:
        names.add(parent(params[-1]))
    output = getattr(module, "get_output_embeddings", None)
    head = output() if callable(output) else None
    if isinstance(head, nn.Module):
        names.add(inventory.name_of(head) or "")
    return sorted(n for n in names if n)


def _converts(name: str, patterns: Sequence[str]) -> bool:
    """transformers' ``should_convert_module``: a pattern matches ``name`` from its start up to
    a module boundary (also as a regex), or as a suffix."""
    boundary = r"(?:(?<=\.)|(?=\.|$))"
    return not any(re.match(rf"(?:{p}){boundary}", name) or name.endswith(p) for p in patterns)


def quant_targets(model: nn.Module | ModelInventory, config: QuantConfig) -> list[str]:
    """The weights ``config`` quantizes: each ``nn.Linear`` weight (``bnb.nn.Linear4bit`` too,
    once the model is prepared), but for the modules kept in high precision (see
    :func:`not_converted`) and the config's ``modules_to_not_convert``; a weight tied to
    another stays as it is.

    Example:
        >>> m = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2), nn.Linear(2, 2))
        >>> quant_targets(m, QuantConfig("int8", modules_to_not_convert=("0",)))
        ['1.weight']
    """
    inventory = ModelInventory.of(model)
    defaults = not isinstance(config, TransformersQuantConfig) or config.default_skips
    skip = [*not_converted(inventory, defaults=defaults), *config.modules_to_not_convert]
    tied = {n for group in inventory.ties for n in group}
    out = []
    for name, module in inventory.modules.items():
        if not name or inventory.same_module.get(name) is not None or not _linear(module):
            continue
        weight = join(name, "weight")
        if weight in inventory.slots and weight not in tied and _converts(name, skip) and not config.skips(name):
            if len(inventory.tensor(weight).shape) == 2:
                out.append(weight)
    return out


def _linear(module: nn.Module) -> bool:
    if isinstance(module, nn.Linear):
        return True
    return type(module).__name__ == "Linear4bit" and type(module).__module__.startswith("bitsandbytes")


def prepare_model(model: nn.Module, config: QuantConfig, *, dtype: torch.dtype | None = None) -> list[str]:
    """Make ``model`` (on meta) ready to receive ``config``'s weights; returns the targets.

    ``int8`` makes each target's layer an :class:`~bigviz.modeling.int8_linear.Int8Linear`
    (torchao's weights are tensor subclasses in the same layers; that layer runs them on
    torch's packed CPU kernel);
    ``int4`` replaces each target's ``nn.Linear`` by ``bnb.nn.Linear4bit`` with transformers'
    ``replace_with_bnb_linear`` (compute dtype: a transformers config's ``bnb_4bit_compute_dtype``,
    else ``dtype``, else the layer's).

    Raises:
        QuantizationUnavailable: the library the method needs is not installed.
    """
    require(config.library, f"quantization={config.method!r}")
    targets = quant_targets(model, config)
    if config.method == "int8":
        use_int8_kernel(model, sorted({parent(t) for t in targets}))
    if config.method != "int4" or not targets:
        return targets
    chosen = torch_dtype(config.compute_dtype) if isinstance(config, TransformersQuantConfig) else None
    compute = chosen or dtype or ModelInventory.of(model).tensor(targets[0]).dtype
    settings = {"load_in_4bit": True, "bnb_4bit_quant_type": config.quant_type, "bnb_4bit_compute_dtype": compute}
    replace_linear(model, {parent(t) for t in targets}, settings)
    return quant_targets(model, config)


def replace_linear(
    model: nn.Module, modules: Collection[str], settings: Mapping[str, Any], *, pre_quantized: bool = False
) -> None:
    """Replace the ``nn.Linear`` layers named in ``modules`` (on meta) by bitsandbytes' layers,
    with transformers' ``replace_with_bnb_linear`` and a ``BitsAndBytesConfig`` of
    ``settings``; every other linear layer stays as it is. Each new layer keeps the bias of the
    layer it replaces, in its dtype (as ``from_pretrained`` does), not bitsandbytes' float32."""
    require("transformers", "bitsandbytes layers")
    from transformers import BitsAndBytesConfig
    from transformers.integrations.bitsandbytes import replace_with_bnb_linear

    chosen = set(modules)
    linear = {n: m for n, m in model.named_modules() if n and isinstance(m, nn.Linear)}
    others = [n for n in linear if n not in chosen]
    config = BitsAndBytesConfig.from_dict(dict(settings))
    keep = [f"^{re.escape(n)}$" for n in others] or None
    _quietly(
        replace_with_bnb_linear,
        model,
        modules_to_not_convert=keep,
        quantization_config=config,
        pre_quantized=pre_quantized,
    )
    for name in chosen & set(linear):  # new layers keep the mode of those they replace (eval: no training path)
        layer, old = model.get_submodule(name), linear[name]
        layer.train(old.training)
        if isinstance(getattr(layer, "bias", None), Tensor) and old.bias is not None:
            layer.bias = old.bias  # its dtype (bitsandbytes' layers make a float32 one): the bytes the plan counts


def _quietly(fn: Any, *args: Any, **kwargs: Any) -> Any:
    import logging

    logger = logging.getLogger("transformers.integrations.bitsandbytes")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        return fn(*args, **kwargs)
    finally:
        logger.setLevel(level)


def quantize_weight(weight: Tensor, config: QuantConfig, *, placeholder: Tensor | None = None) -> Tensor:
    """``weight`` (a float tensor, in the dtype the model computes with) packed by ``config``.

    Args:
        weight: the float weight, on the device it will live on.
        config: the method.
        placeholder: the model's parameter it replaces (bitsandbytes' ``Params4bit`` on meta
            carries the quant type, storage and module its weight is made with).

    Example:
        >>> w = torch.randn(8, 16)
        >>> q = quantize_weight(w, QuantConfig("int8"))
        >>> type(q).__name__, q.shape, float((q.dequantize() - w).abs().max()) < 0.05
        ('Int8Tensor', torch.Size([8, 16]), True)
    """
    if config.method == "int8":
        require("torchao", "quantization='int8'")
        quiet_torchao()
        from torchao.quantization import Int8WeightOnlyConfig, quantize_

        holder = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
        holder.weight = nn.Parameter(weight, requires_grad=False)
        quantize_(holder, Int8WeightOnlyConfig())  # what transformers' TorchAoQuantize runs
        return holder.weight.detach()
    require("bitsandbytes", "quantization='int4'")
    import bitsandbytes as bnb

    fields = dict(getattr(placeholder, "__dict__", {}))
    fields.setdefault("quant_type", config.quant_type)
    fields.pop("quant_state", None)
    fields.pop("bnb_quantized", None)
    value = bnb.nn.Params4bit(weight, requires_grad=False, **fields)
    return value.to(weight.device)  # bitsandbytes quantizes on the move, as Bnb4bitQuantize does


def torch_dtype(dtype: object) -> torch.dtype | None:
    """``torch.float16`` for ``"float16"``, ``"torch.float16"`` or ``torch.float16``; None for None.

    Example:
        >>> torch_dtype("bfloat16"), torch_dtype(None)
        (torch.bfloat16, None)
    """
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    found = getattr(torch, str(dtype).removeprefix("torch."), None)
    return found if isinstance(found, torch.dtype) else None
