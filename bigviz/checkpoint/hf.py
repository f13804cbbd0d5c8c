"""What bigviz asks a transformers model before loading it, through transformers' own functions.

``from_pretrained`` does more than copy tensors: it renames and fuses checkpoint keys
(``get_model_conversion_mapping``), keeps some modules in float32 (``_get_dtype_plan``),
ignores keys the class declares ignorable, and computes what no checkpoint holds (sinusoidal
positions, rotary frequencies) with the model's ``_init_weights``. bigviz reads those rules from
the installed transformers, never from copies of its tables, so a new architecture behaves
here as it does there. Every function returns a neutral answer for other modules, and
transformers is imported only when the model is one of its.

Example:
    >>> import torch
    >>> conversion_rules(torch.nn.Linear(2, 2)) is None, fp32_patterns(torch.nn.Linear(2, 2), torch.float16)
    (True, ())
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from bigviz.core.names import parent
from bigviz.modeling.configs import ConfigError, checked_config, hf_config
from bigviz.modeling.inventory import ModelInventory
from bigviz.modeling.twin import is_transformers_model
from bigviz.core.errors import UsageError

__all__ = [
    "conversion_rules",
    "fp32_patterns",
    "initialise_computed",
    "meta_model_from_folder",
]


def conversion_rules(model: nn.Module, key_mapping: Mapping[str, str] | None = None) -> list[Any] | None:
    """The weight transforms ``from_pretrained`` applies to checkpoint keys for ``model``.

    transformers' ``get_model_conversion_mapping`` (renamings, expert fusions, legacy names,
    per-submodel scopes), plus ``key_mapping`` (regex -> replacement) as ``from_pretrained``
    takes it. None when ``model`` is not a transformers model or nothing applies.
    """
    if not is_transformers_model(model):
        if key_mapping:
            raise UsageError("key_mapping= needs a transformers model (its rules are transformers' WeightRenaming)")
        return None
    from transformers.conversion_mapping import get_model_conversion_mapping

    rules = get_model_conversion_mapping(model, dict(key_mapping) if key_mapping else None)  # fresh copies
    return rules or None


def fp32_patterns(model: nn.Module, dtype: torch.dtype | None) -> tuple[str, ...]:
    """Regex patterns of tensors ``from_pretrained(dtype=dtype)`` keeps in float32.

    transformers' rule (``PreTrainedModel._get_dtype_plan``): ``_keep_in_fp32_modules`` under
    float16 only; ``_keep_in_fp32_modules_strict`` under float16 and bfloat16. A pattern is
    searched anywhere in a tensor's name (``"wo"`` matches ``...DenseReluDense.wo.weight``),
    ``*`` standing for any characters.
    """
    if dtype is None or not is_transformers_model(model):
        return ()
    plan = model._get_dtype_plan(dtype)  # type: ignore[operator]
    return tuple(sorted(p.replace("*", ".*") for p, d in plan.items() if d == torch.float32))


def ignorable_unexpected(model: nn.Module) -> tuple[str, ...]:
    """Regexes of checkpoint keys the model does not load and does not need, as
    ``from_pretrained`` judges them: the class's ``_keys_to_ignore_on_load_unexpected``, and the
    two rules transformers adds at load time for every model rather than as class attributes
    (``PreTrainedModel._adjust_missing_and_unexpected_keys``): old checkpoints' per-layer
    ``rotary_emb.inv_freq`` where the model has such a buffer (it moved to the model's top), and
    ``position_ids`` where the model has that buffer (it used to be persistent). Read in the
    same way here so that every checkpoint ``from_pretrained`` loads, loads."""
    patterns = list(getattr(model, "_keys_to_ignore_on_load_unexpected", None) or ())
    if not is_transformers_model(model):  # transformers' rules for its own models only
        return tuple(patterns)
    buffers = [name for name, _ in model.named_buffers()]
    if any(name.endswith("rotary_emb.inv_freq") for name in buffers):
        patterns.append(r"rotary_emb\.inv_freq")
    if any(name.endswith("position_ids") for name in buffers):
        patterns.append(r"(^|\.)position_ids$")
    return tuple(patterns)


def ignorable_missing(model: nn.Module) -> tuple[str, ...]:
    """Regexes of missing keys the model class says it computes or does not need."""
    return tuple(getattr(model, "_keys_to_ignore_on_load_missing", None) or ())


def initialise_computed(inventory: ModelInventory, names: Iterable[str]) -> list[str]:
    """Compute tensors no checkpoint holds, as ``from_pretrained`` does: with the model's
    ``_init_weights`` (sinusoidal positions, rotary frequencies, a missing bias).

    Only the modules owning ``names`` are initialised, and every other tensor is protected for
    the call (transformers' init functions skip tensors flagged ``_is_hf_initialized``), so
    only ``names`` change; every flag is put back as it was. ``names`` must be materialised.

    Returns:
        The names that the model's ``_init_weights`` wrote (an empty list for other modules).
    """
    model = inventory.model
    names = set(names)
    if not names or not is_transformers_model(model):
        return []
    tensors = {n: inventory.tensor(n) for n in inventory.slots}
    protect = {id(t): t for n, t in tensors.items() if n not in names}
    for n in names:
        protect.pop(id(tensors[n]), None)  # a tie: its other name is computed too
    flagged = [t for t in protect.values() if not getattr(t, "_is_hf_initialized", False)]
    owners = {id(inventory.modules[parent(n)]) for n in names}
    modules = list({id(m): m for m in inventory.modules.values()}.values())
    before = [m.__dict__.get("_is_hf_initialized", _UNSET) for m in modules]
    for t in flagged:
        t._is_hf_initialized = True
    for m in modules:  # a model built outside from_pretrained marks every module initialised
        m._is_hf_initialized = id(m) not in owners
    try:
        model.initialize_weights()  # type: ignore[operator]
    finally:
        for t in flagged:
            del t._is_hf_initialized
        for m, flag in zip(modules, before):
            if flag is _UNSET:
                m.__dict__.pop("_is_hf_initialized", None)
            else:
                m._is_hf_initialized = flag
    return sorted(names)


_UNSET = object()


@functools.lru_cache(maxsize=8)
def _meta_model(folder: Path, stamp: float) -> nn.Module | None:
    return _build_meta_model(folder)


def meta_model_from_folder(folder: str | Path) -> nn.Module | None:
    """The transformers model a checkpoint folder describes, built on ``meta`` (no memory), or None.

    Needs ``config.json`` naming an ``architectures`` class the installed transformers has;
    anything else (no config, a model type or class transformers does not know, transformers
    missing) gives None, and the checkpoint is planned from its headers alone. Cached per folder
    while its config is unchanged.

    Raises:
        ConfigError: (a ``ValueError``) for a ``config.json`` bigviz will not build from at all:
            not a JSON object, ``auto_map`` (code to run), sizing numbers out of range.
    """
    folder = Path(folder)
    folder = folder if folder.is_dir() else folder.parent
    config = folder / "config.json"
    if not config.is_file():
        return None
    return _meta_model(folder.resolve(), config.stat().st_mtime)


def _build_meta_model(folder: Path) -> nn.Module | None:
    data, where = checked_config(folder / "config.json")  # refused loudly: hostile, not just unknown
    try:
        import transformers

        config = hf_config(data, where)
        cls = getattr(transformers, (config.architectures or [""])[0], None)
        if not (isinstance(cls, type) and issubclass(cls, transformers.PreTrainedModel)):
            return None
        with torch.device("meta"):
            model = cls._from_config(config)
    except (ConfigError, ImportError, OSError, ValueError, TypeError, AttributeError, KeyError, RuntimeError):
        return None  # a config transformers cannot build here: plan from the headers alone
    model.tie_weights()
    return model
