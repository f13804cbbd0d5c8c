"""The planning entry points users call: ``plan``, ``infer_auto_device_map`` and
``check_device_map``, for an ``nn.Module``, a :class:`SizeTree` or a checkpoint path, and
``plan_pipeline`` (stages across ranks, run by ``torch.distributed``; see ``bigviz.distributed``).

This layer sits above ``modeling`` (trees from modules) and ``checkpoint`` (trees from
headers) so that one call takes either; ``engine`` and ``ui`` build on it.

Example:
    >>> import torch.nn as nn
    >>> model = nn.Sequential(*[nn.Linear(100, 100) for _ in range(4)])  # 40,400 bytes each
    >>> infer_auto_device_map(model, {0: "150KB", "cpu": "1GB"})  # accelerate's default: in order
    {'0': 0, '1': 'cpu', '2': 'cpu', '3': 'cpu'}
"""
from __future__ import annotations

import os
from collections.abc import Collection, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Union

import torch
import torch.nn as nn

from bigviz.checkpoint.hf import meta_model_from_folder
from bigviz.checkpoint.tree import detect_no_split, tree_from_checkpoint
from bigviz.core.devicemap import device_of, validate_device_map
from bigviz.core.names import is_prefix
from bigviz.core.pipeline import PipelinePlan
from bigviz.core.plan import DevicePlan, PlanOptions
from bigviz.core.stages import make_pipeline_plan
from bigviz.core.strategies import PlanError, check_no_split, is_no_split, make_plan
from bigviz.core.tree import SizeTree
from bigviz.core.devices import Device, device_label
from bigviz.core.workload import RunSpec, Workload, longest_fit
from bigviz.modeling.budgets import get_max_memory
from bigviz.modeling.inventory import ModelInventory
from bigviz.modeling.sizes import module_tree
from bigviz.modeling.workload import is_config_source, model_from_config, run_spec

__all__ = ["plan", "infer_auto_device_map", "check_device_map", "plan_pipeline", "as_tree", "default_no_split",
           "max_context", "workload_bytes", "resolve_model"]

ModelLike = Union[nn.Module, ModelInventory, SizeTree, str, "os.PathLike[str]"]


def resolve_model(model: ModelLike) -> ModelLike:
    """A ``config.json`` path, or a folder holding only one, becomes its model built on
    ``meta``; anything else is returned as it is."""
    return model_from_config(model) if is_config_source(model) else model


def as_tree(model: ModelLike, dtype: torch.dtype | str | None = None,
            special_dtypes: Mapping[str, torch.dtype | str] | None = None) -> SizeTree:
    """A size tree from a model, a tree, or a checkpoint path (headers only, no weights).

    A checkpoint folder with a transformers ``config.json`` is described in the model's names
    (built on meta from the config; checkpoint keys converted as the loader converts them,
    tied duplicates and computed buffers included), so a map planned on it names what the
    model has and runs in ``from_pretrained(device_map=...)`` as in bigviz. Without one, the
    tree has the checkpoint's own names.
    """
    if isinstance(model, SizeTree):
        special = {k: str(v) for k, v in (special_dtypes or {}).items()}
        return model.with_dtype(str(dtype) if dtype is not None else None, special)
    if isinstance(model, (nn.Module, ModelInventory)):
        return module_tree(model, dtype, special_dtypes)
    if isinstance(model, (str, os.PathLike)):
        if is_config_source(model):
            return as_tree(model_from_config(model), dtype, special_dtypes)
        meta = meta_model_from_folder(model)
        return as_tree(tree_from_checkpoint(model, model=meta), dtype, special_dtypes)
    raise TypeError(f"expected an nn.Module, a SizeTree or a checkpoint path, got {type(model).__name__}")


def default_no_split(model: ModelLike, tree: SizeTree) -> list[str]:
    """The model's own no-split classes (``_no_split_modules``), or, for a checkpoint, those
    of the transformers model its ``config.json`` names, else the repeated numbered blocks
    found in its tensor names."""
    declared = getattr(model.model if isinstance(model, ModelInventory) else model, "_no_split_modules", None)
    if declared:
        return list(declared)
    if isinstance(model, (str, os.PathLike)):
        meta = meta_model_from_folder(model)
        declared = getattr(meta, "_no_split_modules", None)
        return list(declared) if declared else list(detect_no_split(list(tree.tensors)))
    return []


def plan(model: ModelLike, max_memory: Mapping[object, object] | None = None, *,
         strategy: str = "auto", no_split_module_classes: Collection[str] | None = None,
         dtype: torch.dtype | str | None = None, reserve: Mapping[object, object] | None = None,
         overrides: Mapping[str, object] | None = None,
         special_dtypes: Mapping[str, torch.dtype | str] | None = None,
         offload_reserve: bool = True, prefetch: bool = True,
         batch_size: int = 1, context_length: int | None = None, kv_dtype: torch.dtype | str | None = None,
         kv_cache: Mapping[str, int] | None = None, activations: Mapping[str, int] | None = None) -> DevicePlan:
    """Plan where every module goes, with bytes and a reason for each placement.

    Args:
        model: an ``nn.Module`` (on meta is fine), a :class:`SizeTree`, a checkpoint path, or
            a ``config.json`` (or a folder holding only one: the model is built on meta).
        max_memory: ``{0: "10GiB", "cpu": "30GiB", "disk": ...}``; default: this machine's
            free memory. GPUs the machine does not have can be planned for.
        strategy: ``"auto"``, ``"balanced"``, ``"balanced_low_0"`` or ``"sequential"``.
        no_split_module_classes: classes (or name globs like ``"transformer.h.*"``) kept whole;
            default: the model's ``_no_split_modules``. Each entry must match a class of the
            model or, for a glob, a module name: a typo raises ``PlanError`` listing the
            model's classes.
        dtype: plan for this dtype (floating tensors only), e.g. ``torch.float16``.
        reserve: bytes per device kept free for activations and KV cache.
        overrides: ``{module: device}`` to honour; the rest is planned around them.
        batch_size: sequences run together (with ``context_length``).
        context_length: plan the run too: each layer's KV cache (or recurrent state) for this
            many tokens on the device the layer runs on (its own; the execution device when it
            is streamed in from cpu or disk), and on every device that runs a layer, room for
            the activations of the largest step, the prefill of ``context_length`` tokens.
        kv_dtype: the cache's dtype (default: the compute dtype).
        kv_cache, activations: ``{module: bytes}`` given by hand, for a model whose layout
            bigviz does not know (they replace what bigviz would read from the model).

    Example:
        >>> import torch.nn as nn
        >>> p = plan(nn.Sequential(nn.Linear(10, 10), nn.Linear(10, 10)), {"cpu": "1KB"})
        >>> p.device_map, p.placements[0].reason
        ({'': 'cpu'}, 'fits: 880 B of 1000 B left on CPU')
    """
    model = resolve_model(model)
    model = ModelInventory.of(model) if isinstance(model, nn.Module) else model  # one walk for the call
    tree = as_tree(model, dtype, special_dtypes)
    if no_split_module_classes is not None:  # yours: a typo would split every block silently
        no_split_module_classes = _as_names(no_split_module_classes)
        check_no_split(tree, no_split_module_classes)
    no_split = no_split_module_classes if no_split_module_classes is not None else default_no_split(model, tree)
    budgets = get_max_memory(max_memory)
    workload = Workload(batch_size, context_length or 0, None if kv_dtype is None else str(kv_dtype))
    kv, act = workload_bytes(model, tree, workload, dtype=dtype, device_type=_device_type(budgets),
                             kv_cache=kv_cache, activations=activations)
    options = PlanOptions(strategy=strategy, no_split=frozenset(no_split), reserve=dict(reserve or {}),
                          overrides=dict(overrides or {}), offload_reserve=offload_reserve, prefetch=prefetch,
                          kv_cache=kv, activations=act, workload=workload if (kv or act) else None)
    result = make_plan(tree, budgets, options)
    return _keep_direct_reads_resident(result, _module_of(model), tree, budgets, options)


def _device_type(budgets: Mapping[Device, int]) -> str:
    """Where the model executes: ``"cuda"`` when a GPU is planned for, else ``"cpu"``."""
    return "cuda" if any(isinstance(d, int) or d == "mps" for d in budgets) else "cpu"


def workload_bytes(model: ModelLike, tree: SizeTree, workload: Workload, *, dtype: object = None,
                   device_type: str = "cuda", kv_cache: Mapping[str, int] | None = None,
                   activations: Mapping[str, int] | None = None) -> tuple[dict[str, int], dict[str, int]]:
    """``(KV cache bytes, activation bytes)`` per module of ``tree`` for ``workload``
    (empty without a context): read from the model (a checkpoint: from its ``config.json``)
    unless given by hand."""
    if not workload.active:
        return {}, {}
    if kv_cache is not None and activations is not None:
        return dict(kv_cache), dict(activations)
    spec = model_run_spec(model, tree, dtype=dtype, device_type=device_type)
    kv = dict(kv_cache) if kv_cache is not None else spec.kv_cache(workload)
    act = dict(activations) if activations is not None else spec.activations(workload)
    return kv, act


def model_run_spec(model: ModelLike, tree: SizeTree, *, dtype: object = None,
                   device_type: str = "cuda") -> RunSpec:
    """The run spec of a model, with its modules named as in ``tree``."""
    source = model
    if isinstance(model, (str, os.PathLike)):
        config = Path(model) / "config.json" if Path(model).is_dir() else None
        if config is None or not config.is_file():
            raise ValueError(f"to plan a run (context_length) bigviz reads the attention layout from the "
                             f"model or its config.json, and {str(model)!r} has none next to its weights: pass "
                             f"the model, put its config.json there, or give kv_cache= and activations=")
        source = model_from_config(config)
    if isinstance(source, ModelInventory):
        source = source.model
    if not isinstance(source, nn.Module):
        raise ValueError("to plan a run (context_length) from a SizeTree, give kv_cache= and activations= "
                         "(bytes per module): a tree does not say how the model attends")
    spec = run_spec(source, dtype=None if dtype is None else str(dtype), device_type=device_type)
    return _renamed(spec, tree)


def _renamed(spec: RunSpec, tree: SizeTree) -> RunSpec:
    """Key a spec by ``tree``'s module names: a checkpoint may lack or add the base prefix
    (``model.``) that the module built from its config has."""
    names = [*spec.caches, *spec.steps]
    if all(n in tree.nodes for n in names):
        return spec
    mapping, missing = {}, []
    for name in names:
        found = name if name in tree.nodes else next(
            (c for c in (name.partition(".")[2], *(f"{p}.{name}" for p in _top_levels(tree))) if c in tree.nodes), None)
        if found is None:
            missing.append(name)
        mapping[name] = found
    if missing:
        raise ValueError(f"the checkpoint has no modules named like the model's layers ({', '.join(missing[:4])}"
                         f"{' ...' if len(missing) > 4 else ''}): give kv_cache= and activations= by module name")
    return RunSpec(spec.dtype, {mapping[k]: v for k, v in spec.caches.items()},
                   {mapping[k]: v for k, v in spec.steps.items()}, spec.carried, spec.notes)


def _top_levels(tree: SizeTree) -> list[str]:
    return list(tree.nodes[""].children)


def max_context(model: ModelLike, max_memory: Mapping[object, object] | None = None, batch_size: int = 1, *,
                allow_offload: bool = False, device_map: DevicePlan | Mapping[str, object] | None = None,
                limit: int | None = None, **plan_kwargs: object) -> int:
    """The longest context whose run fits, by bisection on the (linear-time) planner.

    "Fits" means the plan succeeds with every device within its budget (weights, KV cache,
    activations of the prefill, reserves), and:

    * by default, nothing is offloaded: every module stays on the GPUs (or the CPU when no
      GPU is planned for);
    * with ``allow_offload=True``, the planner may stream modules in from cpu and disk,
      re-planning for each context;
    * with ``device_map`` (a plan or a map), that placement is kept as it is, offload
      included, and only the run must fit beside it.

    Args:
        model: what :func:`plan` takes.
        max_memory: budgets, as for :func:`plan`.
        batch_size: sequences run together.
        limit: the largest context worth trying (default: the model's position limit,
            ``max_position_embeddings`` / ``n_positions`` / ``block_size``, else 2**24).
        **plan_kwargs: more :func:`plan` options (``dtype``, ``kv_dtype``, ``strategy``, ...).

    Returns:
        The number of tokens, 0 when not even the weights fit.

    Example:
        >>> import torch
        >>> from bigviz.models import build
        >>> with torch.device("meta"):
        ...     model = build("gpt-tiny")        # 123.5 KiB of weights, block_size 64
        >>> max_context(model, {"cpu": "10MiB"}), max_context(model, {"cpu": 160_000})
        (64, 15)
    """
    model = resolve_model(model)
    budgets = get_max_memory(max_memory)
    top = limit if limit is not None else _position_limit(model) or 2**24
    model = ModelInventory.of(model) if isinstance(model, nn.Module) else model  # walked once, planned often
    kwargs = dict(plan_kwargs)
    if device_map is not None:
        units = device_map.unit_map if isinstance(device_map, DevicePlan) else device_map
        kwargs["overrides"] = {**dict(units), **dict(kwargs.get("overrides") or {})}  # type: ignore[arg-type]

    def fits(tokens: int) -> bool:
        try:
            result = plan(model, budgets, batch_size=batch_size, context_length=tokens, **kwargs)  # type: ignore[arg-type]
        except PlanError:
            return False
        if any(u.free < 0 for u in result.usage):
            return False
        return allow_offload or device_map is not None or not any(result.offloaded_bytes().values())

    return longest_fit(fits, top)


def _position_limit(model: ModelLike) -> int | None:
    """The longest context a model's positions allow, when it says."""
    config = getattr(model, "config", None)
    for key in ("max_position_embeddings", "n_positions", "block_size", "max_seq_len"):
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def _module_of(model: ModelLike) -> ModelInventory | None:
    if isinstance(model, (nn.Module, ModelInventory)):
        return ModelInventory.of(model)
    if isinstance(model, (str, os.PathLike)):
        meta = meta_model_from_folder(model)
        return None if meta is None else ModelInventory.of(meta)
    return None


def _keep_direct_reads_resident(result: DevicePlan, model: ModelInventory | None, tree: SizeTree,
                                budgets: Mapping[Device, int], options: PlanOptions) -> DevicePlan:
    """Plan again with the modules read directly by a parent's code (not called: DeBERTa's
    ``rel_embeddings``, an ``nn.MultiheadAttention``'s ``out_proj``) on the execution device,
    where the plan had streamed them. bigviz's engine fetches such weights with their reader;
    accelerate's hooks, which run ``from_pretrained(device_map=...)``, fetch per called module
    and would leave them on meta. Reads inside a no-split block by the model's own code are
    left streamed with the block (they are on paths such as CUDA kernels or position
    interpolation); torch's own modules read their children's weights on every path.
    """
    if model is None:
        return result
    blocks = [n for n in tree.nodes if n and is_no_split(tree, n, options.no_split)]
    modules = model.modules
    reads = {m: r for m, r in model.reads.items() if m in tree.nodes and (
        not any(is_prefix(b, m) for b in blocks) or type(modules[r]).__module__.startswith("torch.nn."))}
    streamed = {"disk"} if result.main_device == "cpu" else {"cpu", "disk"}
    moved = [m for m in reads if m not in options.overrides and device_of(m, result.unit_map) in streamed]
    if not moved:
        return result
    overrides = {**options.overrides, **dict.fromkeys(moved, result.main_device)}
    again = make_plan(tree, budgets, replace(options, overrides=overrides))
    why = {m: f"read directly by {reads[m] or 'the model'}'s code (not called): kept on "
              f"{device_label(result.main_device)}, where every loader can use it" for m in moved}
    placements = tuple(replace(p, reason=why[p.name], override=False) if p.name in why else p
                       for p in again.placements)
    return replace(again, placements=placements, _cache={})


def _as_names(names: Collection[str] | str) -> list[str]:
    """``"Block"`` alone means ``["Block"]`` (not the letters B, l, o, c, k)."""
    return [names] if isinstance(names, str) else list(names)


def infer_auto_device_map(model: ModelLike, max_memory: Mapping[object, object] | None = None,
                          no_split_module_classes: Collection[str] | None = None,
                          dtype: torch.dtype | str | None = None,
                          special_dtypes: Mapping[str, torch.dtype | str] | None = None,
                          verbose: bool = False, clean_result: bool = True, offload_buffers: bool = False,
                          *, strategy: str = "sequential", reserve: Mapping[object, object] | None = None,
                          overrides: Mapping[str, object] | None = None) -> dict[str, Device]:
    """Accelerate's function with bigviz's planner behind it: a ``{module: device}`` dict.

    Like accelerate's, it fills the devices in order (``strategy="sequential"``): GPU 0 up to
    its budget, then GPU 1, ..., then the CPU, then disk; a balanced spread comes from a
    balanced ``max_memory`` (as accelerate's ``get_balanced_memory`` makes), or from
    ``strategy="balanced"``. ``device_map="auto"`` in loading (and :func:`plan`'s default)
    balances, as transformers does. ``verbose=True`` prints each placement and its reason
    (the plan itself is inspectable with :func:`plan`). ``offload_buffers`` is accepted for
    compatibility; bigviz counts buffers in module sizes either way.

    Example:
        >>> import torch.nn as nn
        >>> infer_auto_device_map(nn.Linear(10, 10), {"cpu": "1KB"})
        {'': 'cpu'}
    """
    result = plan(model, max_memory, strategy=strategy, no_split_module_classes=no_split_module_classes,
                  dtype=dtype, special_dtypes=special_dtypes, reserve=reserve, overrides=overrides)
    if verbose:
        print(result.summary())
        for p in result.placements:
            print(f"  {p.name or '<model>'}: {p.device} ({p.reason})")
    return result.device_map if clean_result else dict(result.unit_map)


def check_device_map(model: ModelLike, device_map: Mapping[str, object], *,
                     devices: Collection[Device] | None = None) -> dict[str, Device]:
    """Check that ``device_map`` covers every tensor of ``model`` with known devices.

    Returns the map with canonical devices (``"cuda:1"`` -> ``1``).

    Raises:
        ValueError: naming every module or tensor not covered, every unknown device and
            every key that names no module, with the fix.

    Example:
        >>> import torch.nn as nn
        >>> check_device_map(nn.Linear(2, 2), {"": "cuda:0"})
        {'': 0}
    """
    return validate_device_map(as_tree(model), device_map, devices)



def plan_pipeline(model_or_checkpoint: ModelLike, stages: int | Sequence[int | str], *,
                  no_split_module_classes: Collection[str] | None = None, balance: str = "bytes",
                  dtype: torch.dtype | str | None = None) -> PipelinePlan:
    """Cut a model into pipeline stages (one per rank) between its no-split blocks.

    Stages are contiguous runs of blocks in execution order; embeddings run in the first
    stage, the final norm and head in the last. The largest stage is as small as it can be
    (exact, in n log n), and every cut says why it is there. A tied tensor used in two
    stages (GPT-2's ``wte`` / ``lm_head``) is loaded by both, and the plan says so.

    Args:
        model_or_checkpoint: an ``nn.Module`` (on meta is fine), a :class:`SizeTree`, or a
            checkpoint path (planned from its headers).
        stages: the number of stages, or one byte budget per stage (``["40GiB", "40GiB"]``):
            stages then never exceed their budget and are balanced by fill fraction.
        no_split_module_classes: the blocks; default: the model's ``_no_split_modules`` (or,
            for a checkpoint, its repeated numbered blocks).
        balance: ``"bytes"`` (weights per stage) or ``"compute"`` (estimated FLOPs per token).
        dtype: plan for this dtype, e.g. ``torch.float16``.

    Raises:
        PipelineError: a bad stage count, more stages than blocks, or budgets too small
            (saying which stage does not fit and by how much).

    Example:
        >>> from bigviz.models import GPT, GPTConfig
        >>> with torch.device("meta"):
        ...     model = GPT(GPTConfig.preset("gpt-tiny", n_layer=4))
        >>> pipe = plan_pipeline(model, 2)
        >>> pipe.split_points, pipe.stages[1][-1], pipe.shared[0].leader
        (('transformer.h.2',), 'lm_head', 'transformer.wte.weight')
    """
    tree = as_tree(model_or_checkpoint, dtype)
    no_split = (no_split_module_classes if no_split_module_classes is not None
                else default_no_split(model_or_checkpoint, tree))
    label = str(dtype).removeprefix("torch.") if dtype is not None else None
    return make_pipeline_plan(tree, stages, no_split=list(no_split), balance=balance, dtype=label)
