"""A planned run's bytes per module (KV cache, activations), read from the model or its config.

Example:
    >>> import torch
    >>> from bigviz.models import build
    >>> from bigviz.core.workload import Workload
    >>> from bigviz.planning.models import as_tree
    >>> with torch.device("meta"):
    ...     model = build("gpt-tiny")
    >>> run = workload_bytes(model, as_tree(model), Workload(1, 8))
    >>> sorted(run.kv_cache)[:1], all(v > 0 for v in run.kv_cache.values())
    (['transformer.h.0'], True)
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path

import torch.nn as nn

from bigviz.core.devices import Device
from bigviz.core.tree import SizeTree
from bigviz.core.workload import RunBytes, RunSpec, Workload
from bigviz.modeling.inventory import ModelInventory
from bigviz.modeling.configs import model_from_config
from bigviz.modeling.workload import run_spec
from bigviz.planning.models import ModelLike
from bigviz.core.errors import UsageError

__all__ = ["workload_bytes", "with_given", "model_run_spec", "device_type"]


def device_type(budgets: Mapping[Device, int]) -> str:
    """Where the model executes: ``"cuda"`` when a GPU is planned for, else ``"cpu"``."""
    return "cuda" if any(isinstance(d, int) or d == "mps" for d in budgets) else "cpu"


def workload_bytes(
    model: ModelLike,
    tree: SizeTree,
    workload: Workload,
    *,
    dtype: object = None,
    device_type: str = "cuda",
    kv_cache: Mapping[str, int] | None = None,
    activations: Mapping[str, int] | None = None,
) -> RunBytes:
    """The run's bytes per module of ``tree`` for ``workload`` (empty without a context):
    read from the model (a checkpoint: from its ``config.json``) unless given by hand (bytes
    given by hand replace the model's, held outputs included)."""
    if not workload.active:
        return RunBytes()
    if kv_cache is not None and activations is not None:
        return RunBytes(dict(kv_cache), dict(activations))
    spec = model_run_spec(model, tree, dtype=dtype, device_type=device_type)
    return with_given(RunBytes.of(spec, workload), kv_cache, activations)


def with_given(run: RunBytes, kv_cache: Mapping[str, int] | None, activations: Mapping[str, int] | None) -> RunBytes:
    """``run`` with the bytes given by hand in place of the model's: activations given by hand
    replace the held outputs too (they say all a module keeps alive). One rule for
    ``bigviz.plan`` and the pipeline planner.

    Example:
        >>> with_given(RunBytes({"h.0": 8}, {"h.0": 4}, {"wte": 2}), None, {"h.0": 6})
        RunBytes(kv_cache={'h.0': 8}, activations={'h.0': 6}, held={})
    """
    return RunBytes(
        dict(kv_cache) if kv_cache is not None else run.kv_cache,
        dict(activations) if activations is not None else run.activations,
        run.held if activations is None else {},
    )


def model_run_spec(model: ModelLike, tree: SizeTree, *, dtype: object = None, device_type: str = "cuda") -> RunSpec:
    """The run spec of a model, with its modules named as in ``tree``."""
    source = model
    if isinstance(model, (str, os.PathLike)):
        config = Path(model) / "config.json" if Path(model).is_dir() else None
        if config is None or not config.is_file():
            raise UsageError(
                f"to plan a run (context_length) bigviz reads the attention layout from the "
                f"model or its config.json, and {str(model)!r} has none next to its weights: pass "
                f"the model, put its config.json there, or give kv_cache= and activations="
            )
        source = model_from_config(config)
    if isinstance(source, ModelInventory):
        source = source.model
    if not isinstance(source, nn.Module):
        raise UsageError(
            "to plan a run (context_length) from a SizeTree, give kv_cache= and activations= "
            "(bytes per module): a tree does not say how the model attends"
        )
    spec = run_spec(source, dtype=None if dtype is None else str(dtype), device_type=device_type)
    return _renamed(spec, tree)


def _renamed(spec: RunSpec, tree: SizeTree) -> RunSpec:
    """Key a spec by ``tree``'s module names: a checkpoint may lack or add the base prefix
    (``model.``) that the module built from its config has."""
    names = [*spec.caches, *spec.steps, *spec.held]
    if all(n in tree.nodes for n in names):
        return spec
    mapping: dict[str, str] = {}
    missing: list[str] = []
    for name in names:
        found = (
            name
            if name in tree.nodes
            else next(
                (c for c in (name.partition(".")[2], *(f"{p}.{name}" for p in _top_levels(tree))) if c in tree.nodes),
                None,
            )
        )
        if found is None:
            missing.append(name)
        else:
            mapping[name] = found
    if missing:
        raise UsageError(
            f"the checkpoint has no modules named like the model's layers ({', '.join(missing[:4])}"
            f"{' ...' if len(missing) > 4 else ''}): give kv_cache= and activations= by module name"
        )
    return replace(
        spec,
        caches={mapping[k]: v for k, v in spec.caches.items()},
        steps={mapping[k]: v for k, v in spec.steps.items()},
        held={mapping[k]: v for k, v in spec.held.items()},
    )


def _top_levels(tree: SizeTree) -> list[str]:
    return list(tree.nodes[""].children)
