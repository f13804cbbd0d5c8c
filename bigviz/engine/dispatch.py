"""``dispatch_model``: make a device map real on a model, with hooks that stream offloaded units.

What each map value does (``main_device`` is where offloaded units execute: the first GPU
in the map, else the CPU):

=============  ==========================================================================
``0``, ``1``   the entry's tensors are moved to that GPU and stay there
``"cpu"``      with the CPU executing: stays in RAM. With a GPU executing: copied once
               into pinned RAM, streamed to the GPU for each forward (side stream)
``"disk"``     read at forward time from safetensors: the checkpoint's own files (passed
               as ``weights``, e.g. ``LoadResult.disk``) or, for weights in memory, files
               written once to ``offload_folder``. The CPU computes straight on the
               memory-mapped pages (no copy); a GPU gets them via pinned staging buffers
=============  ==========================================================================

Offloaded tensors sit on ``meta`` between forwards (``is_meta``; their ``.device`` says where they
run: :class:`~bigviz.engine.weights.Offloaded`). One hook per offloaded entry fetches
all its tensors; the next entry is fetched while the current one computes (``prefetch``).

Example:
    >>> import torch, tempfile
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    >>> x = torch.randn(3, 4)
    >>> expected = model(x)
    >>> with tempfile.TemporaryDirectory() as folder:
    ...     _ = dispatch_model(model, {"0": "cpu", "1": "cpu", "2": "disk"}, offload_folder=folder)
    ...     torch.equal(model(x), expected), model[2].weight.is_meta, model[2].weight.device.type
    (True, True, 'cpu')
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from bigviz.checkpoint.offload_folder import offload_problems, offload_weights
from bigviz.checkpoint.packed_weights import PackedWeights, flatten
from bigviz.core.dispatch_plan import DispatchPlan
from bigviz.core.errors import BigvizError, DeviceMapError, StateError
from bigviz.engine.binding import Binding, BoundUnit, bind, called_modules
from bigviz.engine.devices import torch_device
from bigviz.engine.hooks import GUARDED_METHODS, add_hook_to_module, remove_hook_from_module
from bigviz.engine.mapped import MappedFiles
from bigviz.engine.offload_hooks import AlignDevicesHook, CpuOffload, ForwardLock, OffloadHook
from bigviz.core.stream_plan import StreamOptions, StreamPlan, make_stream_plan
from bigviz.engine.fetchers import make_fetcher
from bigviz.engine.fetchers.ring import RingFetcher
from bigviz.engine.resident import Residency
from bigviz.engine.resident_copy import ResidentCopy, start_resident_copy
from bigviz.engine.scheduler import Scheduler
from bigviz.engine.weights import as_slot_value, pin, set_slot
from bigviz.modeling.inventory import ModelInventory
from bigviz.planning.chain import plan_chain

__all__ = [
    "dispatch_model",
    "dispatch_inventory",
    "execute_dispatch",
    "DispatchOptions",
    "DispatchState",
    "DEFAULT_SKIP_KEYS",
    "refuse_dispatched",
    "AlreadyDispatchedError",
]

DEFAULT_SKIP_KEYS: tuple[str, ...] = ("cache", "past_key_values")


@dataclass(frozen=True)
class DispatchOptions:
    """The knobs of :func:`dispatch_model`, gathered (see its docstring)."""

    main_device: torch.device
    offload_folder: Path | None = None
    offload_buffers: bool = False
    prefetch: bool = True
    skip_keys: tuple[str, ...] = DEFAULT_SKIP_KEYS
    preload_module_classes: tuple[str, ...] = ()
    no_split_module_classes: tuple[str, ...] = ()


@dataclass(eq=False)
class DispatchState:
    """What a dispatch set up on a model (``model._bigviz_dispatch``), for inspection and undo.

    Attributes:
        device_map: The normalised map.
        options: The options used.
        plan: The dispatch plan carried out (units, storage, fetch order, resident tensors).
        units: Offload units bound to the model, in the plan's order.
        scheduler: The prefetch scheduler (``scheduler.order``: recorded execution order).
        owned: Stores opened by the dispatch (closed by ``remove_hooks``).
        lock: Held by a forward of the model (threads calling it take turns).
        mapped: The files its CPU weights are memory-mapped from, checked before each forward.
        residency: How the weights are kept and streamed, as carried out (``bigviz.residency``).
    """

    device_map: dict[str, int | str]
    options: DispatchOptions
    plan: DispatchPlan | None = None
    units: list[BoundUnit] = field(default_factory=list)
    scheduler: Scheduler | None = None
    owned: list[Any] = field(default_factory=list)
    lock: ForwardLock = field(default_factory=ForwardLock)  # one forward at a time, whatever the thread
    mapped: MappedFiles | None = None
    residency: Residency | None = None

    def close(self) -> None:
        """Detach remaining unit hooks, stop prefetching and close the files opened."""
        for unit in self.units:
            if getattr(unit.module, "_hf_hook", None) is not None:
                remove_hook_from_module(unit.module)
        if self.scheduler is not None:
            self.scheduler.close()
        for store in self.owned:
            close = getattr(store, "close", None)
            if close is not None:
                close()
        self.owned.clear()
        if self.mapped is not None:
            self.mapped.close()
            self.mapped = None
        copy = self.residency.copy if self.residency is not None else None
        if isinstance(copy, ResidentCopy):  # still copying: stopped; what is not copied stays mapped
            copy.close()


class _RootHook(AlignDevicesHook):
    """The model's own hook: inputs in, outputs back, pass boundaries, and the undo."""

    def __init__(self, state: DispatchState, *, skip_keys: Iterable[str]) -> None:
        super().__init__(state.options.main_device, io_same_device=True, skip_keys=skip_keys, scheduler=state.scheduler)
        self.state = state

    def pre_forward(self, module: nn.Module, *args: Any, **kwargs: Any) -> tuple[tuple, dict]:
        self.state.lock.acquire(self)  # first: another thread's forward finishes before this one starts
        if self.state.mapped is not None:
            self.state.mapped.verify()  # a truncated shard under zero-copy CPU weights: an error, not SIGBUS
        return super().pre_forward(module, *args, **kwargs)

    def post_forward(self, module: nn.Module, output: Any) -> Any:
        try:
            return super().post_forward(module, output)
        finally:
            self.state.lock.release(self)

    def on_forward_error(self, module: nn.Module) -> None:
        error = sys.exc_info()[1]
        try:
            if self.scheduler is not None and error is not None and "meta" in str(error):
                _explain_meta_error(error, self.scheduler.not_fetched())
            super().on_forward_error(module)
        finally:
            self.state.lock.release(self)

    def detach_hook(self, module: nn.Module) -> nn.Module:
        self.state.close()
        for attr in ("hf_device_map", "_bigviz_dispatch"):
            module.__dict__.pop(attr, None)
        return module


def _explain_meta_error(error: BaseException, idle: list[BoundUnit]) -> None:
    """A forward that touched a weight still on meta: name the offloaded modules whose hook
    never ran (their weights were read without calling them) and the fix."""
    if not idle or not hasattr(error, "add_note"):
        return
    names = ", ".join(repr(u.name) for u in idle[:5]) + (", ..." if len(idle) > 5 else "")
    error.add_note(
        f"bigviz: offloaded modules whose forward did not run in this pass: {names}. If the code of a "
        "parent module reads their weights directly (not by calling them), keep those modules on a "
        "device that computes, or pass preload_module_classes=[<the parent's class name>] so the "
        "parent fetches them."
    )


class AlreadyDispatchedError(BigvizError, ValueError):
    """A model (or a module in it) that a dispatch already hooked, given to a dispatch again."""


_DISPATCH_HOOKS = (AlignDevicesHook, OffloadHook, CpuOffload)


def refuse_dispatched(model: nn.Module, entry: str) -> None:
    """The one guard of every dispatching entry point, run before anything is read, opened or
    moved: a model already dispatched (by bigviz or accelerate: its modules carry their
    hooks) is refused. Dispatching it again would stack hooks on hooks, and leak the first
    dispatch's open files and prefetch threads.

    Raises:
        AlreadyDispatchedError: naming the entry point and where the model is hooked.

    Example:
        >>> import torch
        >>> model = dispatch_model(torch.nn.Sequential(torch.nn.Linear(2, 2)), {"": "cpu"}, force_hooks=True)
        >>> refuse_dispatched(model, "cpu_offload")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        bigviz.engine.dispatch.AlreadyDispatchedError: cpu_offload: this model is already dispatched ...
    """
    hooked = []
    for name, module in model.named_modules():
        hook = getattr(module, "_hf_hook", None)
        hooks = getattr(hook, "hooks", (hook,)) if hook is not None else ()
        ours = getattr(module, "_bigviz_dispatch", None) is not None
        if ours or any(isinstance(h, _DISPATCH_HOOKS) or type(h).__module__.startswith("accelerate.") for h in hooks):
            hooked.append(repr(name) if name else "the model itself")
    if hooked:
        shown = ", ".join(hooked[:4]) + (f" and {len(hooked) - 4} more modules" if len(hooked) > 4 else "")
        raise AlreadyDispatchedError(
            f"{entry}: this model is already dispatched (hooks on {shown}); dispatching it again would stack "
            "hooks and leave the first dispatch's files and threads open. Call bigviz.remove_hooks(model) "
            "first (weights go back where they were before), then dispatch it again"
        )


def dispatch_model(
    model: nn.Module,
    device_map: Mapping[str, int | str | torch.device],
    *,
    main_device: int | str | torch.device | None = None,
    offload_folder: str | Path | None = None,
    offload_buffers: bool = False,
    prefetch: bool = True,
    skip_keys: str | Sequence[str] | None = None,
    preload_module_classes: Sequence[str] | None = None,
    no_split_module_classes: Sequence[str] | None = None,
    weights: Mapping[str, Tensor] | None = None,
    state_dict: Mapping[str, Tensor] | None = None,
    offload_dir: str | Path | None = None,
    force_hooks: bool = False,
) -> nn.Module:
    """Place ``model`` according to ``device_map`` and hook it so it runs as one module.

    Devices are checked before anything moves; every problem with the map (uncovered
    tensors, weights on ``meta`` that no store holds, a missing ``offload_folder``) is
    collected and raised together, also before anything moves.

    Args:
        model: The model: materialised, on ``meta`` (with ``weights``), or a mix.
        device_map: Module (or tensor) name -> ``0``/``"cuda:1"``/``"cpu"``/``"disk"``/``"mps"``.
        main_device: Where offloaded units run. Default: the first GPU in the map, else CPU.
        offload_folder: Where disk-mapped weights that are in memory are written once, as
            safetensors. Not needed when they come from ``weights``.
        offload_buffers: Stream buffers of offloaded modules too (else they stay on
            ``main_device``).
        prefetch: Fetch the next offloaded module while the current one computes.
        skip_keys: Forward kwargs never moved between devices. Default: the model's
            ``_skip_keys_device_placement`` plus ``"cache"`` and ``"past_key_values"``.
        preload_module_classes: Class names whose instances fetch all their offloaded
            weights at the start of their forward (modules whose children's weights are
            read without calling the children).
        no_split_module_classes: Block classes: an offloaded entry holding blocks is
            fetched block by block (default: the model's ``_no_split_modules``).
        weights: Tensors for what is on ``meta`` in the model (e.g. ``LoadResult.disk``).
        state_dict: accelerate's name for more such tensors (used like ``weights``).
        offload_dir: accelerate's name for ``offload_folder``.
        force_hooks: Hook the model even when everything is on one device.

    Returns:
        The model, with ``hf_device_map`` set. ``.to()``, ``.cuda()``, ``.half()`` ... raise
        while it is dispatched over several devices: call
        :func:`~bigviz.engine.hooks.remove_hooks` first.

    Raises:
        ValueError: the map names devices this machine lacks, or is wrong for this model.

    Example:
        >>> import torch
        >>> model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
        >>> _ = dispatch_model(model, {"0": "cpu", "1": "cpu"})
        >>> model.hf_device_map
        {'0': 'cpu', '1': 'cpu'}
    """
    return dispatch_inventory(
        ModelInventory.of(model),
        device_map,
        main_device=main_device,
        offload_folder=offload_folder if offload_folder is not None else offload_dir,
        offload_buffers=offload_buffers,
        prefetch=prefetch,
        skip_keys=skip_keys,
        preload_module_classes=preload_module_classes,
        no_split_module_classes=no_split_module_classes,
        stores=[s for s in (weights, state_dict) if s is not None],
        force_hooks=force_hooks,
    )


def dispatch_inventory(
    inventory: ModelInventory,
    device_map: Mapping[str, Any],
    *,
    main_device: Any = None,
    offload_folder: str | Path | None = None,
    offload_buffers: bool = False,
    prefetch: bool = True,
    skip_keys: str | Sequence[str] | None = None,
    preload_module_classes: Sequence[str] | None = None,
    no_split_module_classes: Sequence[str] | None = None,
    stores: Sequence[Mapping[str, Tensor]] = (),
    force_hooks: bool = False,
    owned: Sequence[Any] = (),
) -> nn.Module:
    """`dispatch_model` on a model's inventory: plan (one validation pass: names, devices,
    coverage, all problems at once, before anything moves), then execute."""
    refuse_dispatched(inventory.model, "dispatch_model")
    _, _, plan = plan_chain(
        inventory,
        None,
        dict(device_map),
        main_device=main_device,
        no_split_module_classes=no_split_module_classes,
        preload_module_classes=preload_module_classes,
        offload_buffers=offload_buffers,
        prefetch=prefetch,
        resident="map",  # weights in memory, or a store the caller opened: kept as they are
    )
    assert plan is not None
    return execute_dispatch(
        inventory,
        plan,
        stores,
        skip_keys=skip_keys,
        force_hooks=force_hooks,
        offload_folder=offload_folder,
        owned=owned,
    )


def execute_dispatch(
    inventory: ModelInventory,
    plan: DispatchPlan,
    stores: Sequence[Mapping[str, Tensor]] = (),
    *,
    skip_keys: str | Sequence[str] | None = None,
    force_hooks: bool = False,
    offload_folder: str | Path | None = None,
    owned: Sequence[Any] = (),
    stamps: Iterable[tuple[int, ...]] = (),
    progress: bool = False,
) -> nn.Module:
    """Carry out a checked dispatch plan on ``inventory``'s model: bind it (every problem
    raised at once, before anything moves), write or pin what streams from memory, place the
    resident tensors, copy them into RAM when its stream plan says so, and hook the units
    with the fetcher, read-ahead and ring it names. Returns the model, with ``hf_device_map``
    set. Nothing here decides: what is copied and how units stream is ``plan.stream``.

    ``owned`` are stores the dispatch closes on ``remove_hooks`` (a load's disk weights);
    ``progress`` shows a bar while a resident copy is read. ``stamps``: the files' stamps when
    a load opened them (a checkpoint index's), so that the files under zero-copy CPU weights
    are compared with those (:class:`MappedFiles`); a model with such weights is hooked even
    on one device, for that check.
    """
    model = inventory.model
    options = DispatchOptions(
        main_device=torch_device(plan.main_device),
        offload_folder=_folder(offload_folder),
        offload_buffers=plan.rule.offload_buffers,
        prefetch=plan.prefetch,
        skip_keys=_skip_keys(model, skip_keys),
        preload_module_classes=tuple(sorted(plan.rule.preload)),
        no_split_module_classes=tuple(sorted(plan.rule.blocks)),
    )
    stream = plan.stream if plan.stream is not None else _zero_copy(plan)
    binding = _checked_binding(inventory, plan, options, stores, loaded=bool(owned))
    state = DispatchState(dict(plan.device_map), options, plan, owned=list(owned))
    _materialise(binding, options, state)
    copied, copying = start_resident_copy(model, plan, stream, progress)
    try:
        mapped = MappedFiles.of(model, stamps, skip=copying)  # what stays memory-mapped: checked before each forward
        if len(set(plan.device_map.values())) > 1 or binding.units or force_hooks or len(mapped):
            state.mapped = mapped if len(mapped) else None
            _attach(inventory, binding, state, stream)
        else:
            mapped.close()
    except BaseException:
        if isinstance(copied, ResidentCopy):  # a dispatch that failed leaves no copy running
            copied.close()
        raise
    fetcher = state.scheduler.fetcher if state.scheduler is not None and binding.units else None
    if isinstance(copied, ResidentCopy):  # one bar: the copy and the first forward's reads (if the fetcher tells)
        copied.show_stream(getattr(fetcher, "pass_bytes", 0), fetcher)
    ring = (fetcher.capacity or 0) if isinstance(fetcher, RingFetcher) else 0
    state.residency = Residency(stream, copied, type(fetcher).__name__ if fetcher is not None else "", ring)
    model.hf_device_map = dict(plan.device_map)
    return model


def _zero_copy(plan: DispatchPlan) -> StreamPlan:
    """The stream plan of a dispatch plan made without one: memory maps kept, the fetcher of
    the execution device."""
    units = [(u.name, u.storage, u.nbytes) for u in plan.units]
    return make_stream_plan(units, {}, plan.main_device, None, StreamOptions(resident="map", prefetch=plan.prefetch))


def _folder(folder: str | Path | None) -> Path | None:
    return None if folder is None else Path(folder)


def _skip_keys(model: nn.Module, skip_keys: str | Sequence[str] | None) -> tuple[str, ...]:
    if skip_keys is not None:
        return (skip_keys,) if isinstance(skip_keys, str) else tuple(skip_keys)
    declared = getattr(model, "_skip_keys_device_placement", None) or ()
    declared = (declared,) if isinstance(declared, str) else tuple(declared)
    # the model's own names plus the usual cache names: a cache tuple must never be moved
    return tuple(dict.fromkeys((*declared, *DEFAULT_SKIP_KEYS)))


def _checked_binding(
    inventory: ModelInventory,
    plan: DispatchPlan,
    options: DispatchOptions,
    stores: Sequence[Mapping[str, Tensor]],
    *,
    loaded: bool = False,
) -> Binding:
    """The plan bound to the model's tensors, every problem raised at once before anything
    moves. ``loaded``: the model was just loaded from a checkpoint (load_checkpoint_and_dispatch),
    which the messages name."""
    binding = bind(plan, inventory, stores)
    problems = list(binding.problems)
    if binding.to_write and options.offload_folder is not None:
        problems += offload_problems(options.offload_folder)  # files bigviz did not write: refused
    if binding.to_write and options.offload_folder is None:
        units = sorted({u.name for u in binding.units if u.storage == "disk" and u.materialised})
        shown = f"{', '.join(units[:5])}{', ...' if len(units) > 5 else ''}"
        if loaded:  # from a checkpoint: what is in memory is what no checkpoint file holds
            problems.append(
                f"modules mapped to 'disk' hold tensors the checkpoint does not have ({shown}: buffers "
                "the model makes itself, such as rotary inv_freq, are not saved): pass offload_folder= "
                "to write them there once as safetensors, or offload_buffers=False to keep buffers in memory"
            )
        else:
            problems.append(
                f"modules mapped to 'disk' hold weights in memory ({shown}): pass offload_folder= to write "
                "them there once as safetensors (or load them from a checkpoint with load_checkpoint_and_dispatch)"
            )
    caller = "load_checkpoint_and_dispatch" if loaded else "dispatch_model"
    DeviceMapError.check(problems, f"{caller}: cannot dispatch with this device map")
    return binding


def _materialise(binding: Binding, options: DispatchOptions, state: DispatchState) -> None:
    new_sources: dict[str, Mapping[str, Tensor]] = {}
    if binding.to_write:
        assert options.offload_folder is not None  # checked in _checked_binding
        flat, recipes = flatten(binding.to_write)  # a quantized weight is written packed: its parts
        store: Mapping[str, Tensor] = offload_weights(flat, options.offload_folder)  # what this write made, locked
        store = PackedWeights(store, recipes) if recipes else store
        state.owned.append(store)
        new_sources.update(dict.fromkeys(binding.to_write, store))
    if binding.to_pin:
        pinned = {key: pin(tensor) for key, tensor in binding.to_pin.items()}
        new_sources.update(dict.fromkeys(pinned, pinned))
    binding.to_write, binding.to_pin = {}, {}  # drop references: the RAM copies can be freed
    for unit in binding.units:
        for key in unit.slots:
            if key in new_sources:
                unit.sources[key] = new_sources[key]
    for slots, tensors, device, found in binding.resident:
        _place(slots, tensors, device, found)
    state.units = binding.units


def _place(
    slots: list[tuple[nn.Module, str, str]],
    tensors: list[Tensor],
    device: torch.device,
    found: tuple[str, Mapping[str, Tensor]] | None,
) -> None:
    if found is None:
        for tensor in tensors:
            if tensor.device != device:
                tensor.data = tensor.data.to(device)  # same object: ties and user references survive
        return
    key, store = found
    tensor = tensors[0]
    value = store[key]
    value = (
        value.to(device=device, dtype=tensor.dtype) if value.device != device or value.dtype != tensor.dtype else value
    )
    new = as_slot_value(value, slots[0][2], requires_grad=tensor.requires_grad)
    for slot in slots:
        set_slot(slot, new)


def _attach(inventory: ModelInventory, binding: Binding, state: DispatchState, stream: StreamPlan) -> None:
    model = inventory.model
    options = state.options
    fetcher = make_fetcher(
        stream.fetcher,
        binding.units,
        options.main_device,
        readers=stream.readers,
        background=options.prefetch,
        ahead=stream.ring_ahead,
    )
    wrap = options.main_device.type == "cpu"  # page-in hints only; GPU memory is not held between calls
    state.scheduler = Scheduler(
        binding.units, fetcher, prefetch=options.prefetch, wrap=wrap, depth=max(1, stream.depth)
    )
    add_hook_to_module(model, _RootHook(state, skip_keys=options.skip_keys), append=True)
    several = len({_exec_device(d, options.main_device) for d in state.device_map.values()}) > 1
    if several:
        _attach_align_hooks(inventory, binding.units, state)
    restored: dict[tuple[int, str], Tensor] = {}
    for unit in binding.units:
        hook = OffloadHook(unit, state.scheduler, skip_keys=options.skip_keys, restored=restored, lock=state.lock)
        add_hook_to_module(unit.module, hook, append=True)
    model._bigviz_dispatch = state
    if options.prefetch and stream.fetch_ahead:
        state.scheduler.fetch_ahead(stream.fetch_ahead)  # the first forward's first streamed units
    if binding.units or several:
        for method in GUARDED_METHODS:
            if hasattr(model, method):
                guard = functools.partial(_refuse_move, model, method)
                guard.bigviz_guard = True  # type: ignore[attr-defined]  (remove_hooks takes it off)
                setattr(model, method, guard)


def _attach_align_hooks(inventory: ModelInventory, units: list[BoundUnit], state: DispatchState) -> None:
    """With several execution devices, every module that runs moves its inputs to its device."""
    options = state.options
    modules = inventory.modules
    hooked: set[int] = set()
    targets = [(m, d) for name, d in state.device_map.items() if name for m in called_modules(name, modules)]
    targets += [(unit.module, "disk") for unit in units]  # units may sit below their entry
    for module, device in targets:
        if id(module) not in hooked:
            hooked.add(id(module))
            hook = AlignDevicesHook(_exec_device(device, options.main_device), skip_keys=options.skip_keys)
            add_hook_to_module(module, hook, append=True)


def _exec_device(device: int | str, main_device: torch.device) -> torch.device:
    return main_device if device == "disk" or (device == "cpu" and main_device.type != "cpu") else torch_device(device)


def _refuse_move(model: nn.Module, method: str, *args: Any, **kwargs: Any) -> Any:
    state: DispatchState = model._bigviz_dispatch
    offloaded = [f"{u.name} -> {u.storage}" for u in state.units[:3]]
    where = f"modules offloaded ({', '.join(offloaded)}{', ...' if len(state.units) > 3 else ''})"
    if not state.units:
        where = f"modules spread over {sorted({str(d) for d in state.device_map.values()})}"
    raise StateError(
        f"model.{method}() refused: this model is dispatched with {where}; moving or casting it "
        "would leave its hooks and offloaded weights behind. Call bigviz.remove_hooks(model) "
        "first (offloaded weights return where they were before dispatch), or dispatch again "
        "with another device map."
    )
