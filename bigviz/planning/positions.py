"""How long a context a model's positions allow, and what a plan past it means.

Two kinds of limit, told apart from the model itself, not from a list of architectures:

* **a table**: learned (GPT-2's ``wpe``, OPT, BERT, bigviz's GPT) or sinusoidal (Marian) position
  embeddings, an ``nn.Embedding`` with one row per position. No position past its last row
  exists: the forward fails (an index error) or reads garbage, so a plan past it is refused.
* **a trained length**: rotary (Llama, Mistral, Qwen, bigviz's Llama), ALiBi or no positions at
  all. ``max_position_embeddings`` says how long a context the model was trained (or extended
  with ``rope_scaling``) for; transformers runs past it without a word, and so does the plan,
  with a note and a warning that quality past it is not known. Dynamic NTK scaling
  (``rope_type: "dynamic"``) is made to stretch past it, so it gets no warning.

Example:
    >>> import torch
    >>> from bigviz.models import build
    >>> with torch.device("meta"):
    ...     gpt, llama = build("gpt-tiny"), build("llama-tiny")
    >>> position_rule(gpt), position_rule(llama)
    (PositionLimit(tokens=64, key='block_size', table=True, stretches=False), PositionLimit(tokens=128, key='max_seq_len', table=False, stretches=False))
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.nn as nn

from bigviz.checkpoint.hf import meta_model_from_folder
from bigviz.core.errors import PlanError
from bigviz.modeling.configs import ConfigError, model_from_config
from bigviz.modeling.inventory import ModelInventory

__all__ = ["PositionLimit", "position_rule", "position_limit", "check_context"]

_KEYS = ("max_position_embeddings", "n_positions", "block_size", "max_seq_len")
_STRETCHING = ("dynamic",)  # rope types made to run past max_position_embeddings


@dataclass(frozen=True)
class PositionLimit:
    """The longest context a model's positions allow.

    Attributes:
        tokens: the limit.
        key: the config key that says it, as the config spells it (``n_positions`` for GPT-2).
        table: True when a table has one row per position (no position past it exists).
        stretches: True when the positions are scaled to run past it (dynamic NTK rotary).
    """

    tokens: int
    key: str
    table: bool
    stretches: bool = False


def position_rule(model: Any) -> PositionLimit | None:
    """The position limit of a model (an ``nn.Module``, its inventory, or a checkpoint folder
    whose ``config.json`` builds one), or None when it does not say."""
    module = _module(model)
    config = getattr(module, "config", None)
    for key in _KEYS:
        value = getattr(config, key, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            written = getattr(config, "attribute_map", {}).get(key, key)
            table = _has_table(module, config, value)
            return PositionLimit(value, written, table, not table and _rope_type(config) in _STRETCHING)
    return None


def position_limit(model: Any) -> int | None:
    """The longest context a model's positions allow, when it says."""
    rule = position_rule(model)
    return None if rule is None else rule.tokens


def check_context(rule: PositionLimit | None, context_length: int) -> str | None:
    """Refuse a context past a table of positions (``PlanError``); past a trained length, warn
    and return the note a plan shows (None: within the limit, or no limit).

    Example:
        >>> check_context(PositionLimit(1024, "n_positions", True), 2048)
        Traceback (most recent call last):
        ...
        bigviz.core.errors.PlanError: context_length=2048 is past the model's n_positions=1024: its position embeddings have one row per position, and there is none past 1024. Plan at most 1024 tokens
    """
    if rule is None or context_length <= rule.tokens:
        return None
    if rule.table:
        raise PlanError(
            f"context_length={context_length} is past the model's {rule.key}={rule.tokens}: its position "
            f"embeddings have one row per position, and there is none past {rule.tokens}. "
            f"Plan at most {rule.tokens} tokens"
        )
    if rule.stretches:
        return None
    note = (
        f"context {context_length:,} tokens is past {rule.key}={rule.tokens:,}, the longest the model was "
        "trained for: its positions have no hard end, so the run is planned, but its quality past it is not known"
    )
    warnings.warn(
        f"planning past the model's {rule.key}={rule.tokens}: the positions have no hard end (rotary or none), "
        "quality past it is not known",
        stacklevel=3,
    )
    return note


def _module(model: Any) -> nn.Module | None:
    if isinstance(model, ModelInventory):
        return model.model
    if isinstance(model, nn.Module):
        return model
    if isinstance(model, (str, os.PathLike)):
        return _folder_model(Path(model))
    return None


def _folder_model(path: Path) -> nn.Module | None:
    """The model a checkpoint folder's ``config.json`` describes (transformers or bigviz), if any."""
    folder = path if path.is_dir() else path.parent
    if not (folder / "config.json").is_file():
        return None
    try:
        return meta_model_from_folder(folder) or model_from_config(folder / "config.json")
    except ConfigError:
        return None  # a config that builds no model: the checks that need it say why


def _has_table(module: nn.Module | None, config: Any, tokens: int) -> bool:
    """An ``nn.Embedding`` with one row per position (OPT and BART keep 2 more), other than the
    token embeddings."""
    if module is None:
        return False
    getter = getattr(module, "get_input_embeddings", None)
    try:
        tokens_table = getter() if callable(getter) else None
    except (NotImplementedError, AttributeError):
        tokens_table = None
    sizes = [m.num_embeddings for m in module.modules() if isinstance(m, nn.Embedding) and m is not tokens_table]
    near = sum(tokens <= n <= tokens + 2 for n in sizes)
    vocab = getattr(config, "vocab_size", None)
    vocab_near = tokens_table is None and isinstance(vocab, int) and tokens <= vocab <= tokens + 2
    return near > (1 if vocab_near else 0)


def _rope_type(config: Any) -> str | None:
    for key in ("rope_parameters", "rope_scaling"):
        value = getattr(config, key, None)
        if isinstance(value, dict):
            kind = value.get("rope_type", value.get("type"))
            if isinstance(kind, str):
                return kind
    return None
