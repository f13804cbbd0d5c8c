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

from collections.abc import Collection, Mapping
from typing import Any

import torch

from bigviz.core.counts import check_count
from bigviz.core.devicemap import validate_device_map
from bigviz.core.devices import Device
from bigviz.core.errors import UsageError
from bigviz.core.plan import DevicePlan
from bigviz.core.stream_plan import MachineFacts
from bigviz.core.workload import Workload
from bigviz.planning.inputs import place, planner_inputs
from bigviz.planning.models import ModelLike, as_tree

__all__ = ["plan", "infer_auto_device_map", "get_balanced_memory", "check_device_map"]


def plan(
    model: ModelLike,
    max_memory: Mapping[Any, object] | None = None,
    *,
    strategy: str = "auto",
    no_split_module_classes: Collection[str] | None = None,
    dtype: torch.dtype | str | None = None,
    reserve: Mapping[Any, object] | int | str | None = None,
    overrides: Mapping[str, object] | None = None,
    special_dtypes: Mapping[str, torch.dtype | str] | None = None,
    offload_reserve: bool = True,
    prefetch: bool = True,
    batch_size: int = 1,
    context_length: int | None = None,
    kv_dtype: torch.dtype | str | None = None,
    encoder_length: int | None = None,
    kv_cache: Mapping[str, int] | None = None,
    activations: Mapping[str, int] | None = None,
    preload_module_classes: Collection[str] | None = None,
    offload_buffers: bool = False,
    quantization: object = None,
    machine: MachineFacts | None = None,
) -> DevicePlan:
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
        reserve: bytes kept free: ``{device: size}``, or one size for every device. A plan of a
            run (``context_length``) keeps by default what a process needs beyond the tensors
            it counts, per device kind (:mod:`bigviz.core.headroom`: on a GPU 1 GiB for the
            CUDA context and cuBLAS workspace plus 10% of the run for fragmentation; on the CPU
            25% of the run for the allocator's slack), said in the plan's notes; a device
            ``reserve`` names keeps what it says instead, and ``reserve=0`` plans the bare
            arithmetic. A plan of weights only keeps what ``reserve`` says, as accelerate does.
        overrides: ``{module: device}`` to honour; the rest is planned around them.
        batch_size: sequences run together (with ``context_length``).
        context_length: plan the run too: each layer's KV cache (or recurrent state) for this
            many tokens on the device the layer runs on (its own; the execution device when it
            is streamed in from cpu or disk), and on every device that runs a layer, room for
            the activations of the largest step, the prefill of ``context_length`` tokens.
            An encoder-decoder's: the decoder's tokens.
        kv_dtype: the cache's dtype (default: the compute dtype).
        encoder_length: tokens the cross-attention layers attend to: an encoder-decoder's
            encoder input (its encoder runs over them once; each decoder layer caches them),
            Mllama's vision states. Default: the model's own (Mllama: one image), else
            ``context_length``.
        kv_cache, activations: ``{module: bytes}`` given by hand, for a model whose layout
            bigviz does not know (they replace what bigviz would read from the model).
        preload_module_classes, offload_buffers: as the dispatch will use them: the room kept
            for streamed weights is computed from the offload units the engine will fetch
            (:mod:`bigviz.core.offload_units`).
        quantization: ``"int8"`` or ``"int4"`` (or a `~bigviz.core.quant.QuantConfig`, or
            transformers' ``TorchAoConfig`` / ``BitsAndBytesConfig``): the linear layers'
            weights sized as the quantizer stores them (values, scales, zero points; the
            modules it keeps in high precision as they are), exactly what
            ``load_checkpoint_and_dispatch(..., quantization=...)`` puts in memory. A checkpoint
            stored quantized is sized as stored without it.
        machine: a `~bigviz.core.stream_plan.MachineFacts` to plan for another machine's RAM
            (without ``max_memory``; the default: this machine's available RAM now).

    Without ``max_memory``, this machine's free memory (or ``machine``'s RAM): a model larger than the RAM gets a
    "cpu" budget that leaves room for the ring its streamed units pass through (the stream
    plan's rule, :func:`bigviz.core.stream_plan.resident_room`). The inputs are prepared by
    :func:`bigviz.planning.inputs.planner_inputs`, as for the Planner widget.

    Example:
        >>> import torch.nn as nn
        >>> p = plan(nn.Sequential(nn.Linear(10, 10), nn.Linear(10, 10)), {"cpu": "1KB"})
        >>> p.device_map, p.placements[0].reason
        ({'': 'cpu'}, 'fits: 880 B of 1000 B left on CPU')
    """
    batch_size = check_count("batch_size", batch_size)  # NumPy integers become ints; 2.5 and True are refused
    if context_length is not None:
        context_length = check_count("context_length", context_length, minimum=0)
    inputs = planner_inputs(
        model,
        max_memory,
        strategy=strategy,
        no_split_module_classes=no_split_module_classes,
        dtype=dtype,
        special_dtypes=special_dtypes,
        reserve=reserve,
        overrides=overrides,
        offload_reserve=offload_reserve,
        prefetch=prefetch,
        workload=Workload(batch_size, context_length or 0, None if kv_dtype is None else str(kv_dtype), encoder_length),
        kv_cache=kv_cache,
        activations=activations,
        preload_module_classes=preload_module_classes,
        offload_buffers=offload_buffers,
        quantization=quantization,
        machine=machine,
    )
    return place(inputs)


def infer_auto_device_map(
    model: ModelLike,
    max_memory: Mapping[Any, object] | None = None,
    no_split_module_classes: Collection[str] | None = None,
    dtype: torch.dtype | str | None = None,
    special_dtypes: Mapping[str, torch.dtype | str] | None = None,
    verbose: bool = False,
    clean_result: bool = True,
    offload_buffers: bool = False,
    fallback_allocation: bool = False,
    *,
    strategy: str = "sequential",
    reserve: Mapping[Any, object] | None = None,
    overrides: Mapping[str, object] | None = None,
) -> dict[str, Device]:
    """Accelerate's function with bigviz's planner behind it: a ``{module: device}`` dict.

    Like accelerate's, it fills the devices in order (``strategy="sequential"``): GPU 0 up to
    its budget, then GPU 1, ..., then the CPU, then disk; a balanced spread comes from a
    balanced ``max_memory`` (as accelerate's ``get_balanced_memory`` makes), or from
    ``strategy="balanced"``. ``device_map="auto"`` in loading (and :func:`plan`'s default)
    balances, as transformers does. ``verbose=True`` prints each placement and its reason
    (the plan itself is inspectable with :func:`plan`). ``offload_buffers`` is accepted for
    compatibility; bigviz counts buffers in module sizes either way.

    ``fallback_allocation`` is accelerate's keyword (same position), accepted so ported code
    runs: ``False`` is what bigviz does. ``True`` is refused: in accelerate it fills a GPU that
    the next module skipped with a smaller module found further on (a breadth-first search),
    while bigviz's pass already keeps filling a GPU after a module too big for it went to the
    CPU or disk alone, and puts any other module where you say with ``overrides=``.

    Example:
        >>> import torch.nn as nn
        >>> infer_auto_device_map(nn.Linear(10, 10), {"cpu": "1KB"})
        {'': 'cpu'}
    """
    if fallback_allocation:
        raise UsageError(
            "infer_auto_device_map(fallback_allocation=True): bigviz does not run accelerate's fallback search "
            "(a smaller module moved onto a GPU the next module skipped); its pass keeps filling a GPU after a "
            "module too big for it goes to the CPU or disk. Drop fallback_allocation, or put a module on that GPU "
            "with overrides={module: gpu}"
        )
    result = plan(
        model,
        max_memory,
        strategy=strategy,
        no_split_module_classes=no_split_module_classes,
        dtype=dtype,
        special_dtypes=special_dtypes,
        reserve=reserve,
        overrides=overrides,
    )
    if verbose:
        print(result.summary())
        for p in result.placements:
            print(f"  {p.name or '<model>'}: {p.device} ({p.reason})")
    return result.device_map if clean_result else dict(result.unit_map)


def get_balanced_memory(
    model: ModelLike,
    max_memory: Mapping[Any, object] | None = None,
    no_split_module_classes: Collection[str] | str | None = None,
    dtype: torch.dtype | str | None = None,
    special_dtypes: Mapping[str, torch.dtype | str] | None = None,
    low_zero: bool = False,
) -> dict[Device, int]:
    """Accelerate's function: a ``max_memory`` (bytes per device) that spreads the model over
    the GPUs when :func:`infer_auto_device_map` fills them in order, by accelerate's arithmetic
    (:func:`bigviz.core.planner.balanced_budgets`): each GPU but the last at most an even share
    plus 1.25 blocks; ``low_zero`` keeps GPU 0 for what the others cannot hold. The model's
    sizes are bigviz's (``dtype``, ``special_dtypes`` as in :func:`plan`); the no-split classes
    are checked as :func:`plan` checks them (none named: none used, as accelerate does). ``strategy="balanced"`` in :func:`plan` is this and
    the fill in one step (and keeps GPU 0's largest layer free, as ``device_map="auto"`` does).

    Example:
        >>> import torch.nn as nn
        >>> model = nn.Sequential(*[nn.Linear(100, 100) for _ in range(8)])
        >>> get_balanced_memory(model, {0: "1MB", 1: "1MB", "cpu": "1GB"})
        {0: 212100, 1: 1000000, 'cpu': 1000000000}
    """
    from bigviz.core.planner import balanced_budgets

    inputs = planner_inputs(
        model,
        max_memory,
        no_split_module_classes=no_split_module_classes,
        dtype=dtype,
        special_dtypes=special_dtypes,
    )
    rule = inputs.options.rule
    # accelerate reads no blocks when none are named (the buffer is then the mean leaf), where
    # plan() would take the model's own _no_split_modules: its arithmetic is kept here.
    blocks = rule.blocks if rule is not None and no_split_module_classes is not None else frozenset()
    return balanced_budgets(inputs.tree, inputs.budgets, blocks, low_zero=low_zero)


def check_device_map(
    model: ModelLike, device_map: Mapping[str, object], *, devices: Collection[Device] | None = None
) -> dict[str, Device]:
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
