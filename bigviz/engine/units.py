"""From a device map to offload *units*: what each hook fetches, and what stays resident.

An offload unit is one device-map entry mapped to an offloaded storage (``"disk"``, or
``"cpu"`` while a GPU executes): a whole ``Block``, not every leaf module as in accelerate.
One hook per unit materialises all of the unit's tensors at once, so there are fewer hooks
(and fewer ``torch.compile`` graph breaks) and one fetch per unit to prefetch.

:func:`layout_model` decides, per tensor (per tie group), whether it is resident on a
device or fetched by the units that use it, and from which store it is read. It moves
nothing and writes nothing: :mod:`bigviz.engine.dispatch` carries the layout out.

Example:
    >>> import torch
    >>> model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    >>> layout = layout_model(model, {"0": "cpu", "1": "disk"}, main_device=torch.device("cpu"))
    >>> [(u.name, u.storage, sorted(u.slots)) for u in layout.units]
    [('1', 'disk', ['1.bias', '1.weight'])]
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from bigviz.core.names import ancestors, is_prefix, join, owner, parent
from bigviz.core.devices import normalize_device, streamed_devices
from bigviz.engine.devices import torch_device
from bigviz.modeling.reads import direct_reads
from bigviz.engine.weights import Slot, TensorGroup, find_source, meta_like, nbytes, set_slot, tensor_groups

__all__ = ["Unit", "Layout", "layout_model", "offloaded_storages", "is_container", "called_modules"]


@dataclass(eq=False)
class Unit:
    """One offloaded device-map entry: a module whose tensors are fetched at forward time.

    Attributes:
        name: The module the hook sits on (the entry, or a preload ancestor of it).
        module: That module.
        storage: ``"disk"`` or ``"cpu"`` (pinned CPU memory streamed to a GPU).
        slots: store key -> the slots that key fills (several: a tie inside the unit).
        sources: store key -> the mapping it is read from (set at dispatch).
        placeholders: slot -> the ``meta`` tensor it holds between forwards.
        materialised: keys that were in memory before dispatch (restored by ``remove_hooks``).
        dtypes: key -> the dtype the model declares for it (a store's other dtype is cast).
        key_nbytes: key -> its bytes (their sum, ``nbytes``, is fetched per forward).
    """

    name: str
    module: nn.Module
    storage: str
    order: int
    slots: dict[str, list[Slot]] = field(default_factory=dict)
    sources: dict[str, Mapping[str, Tensor]] = field(default_factory=dict)
    placeholders: dict[tuple[int, str], tuple[Slot, Tensor]] = field(default_factory=dict)
    materialised: set[str] = field(default_factory=set)
    dtypes: dict[str, torch.dtype] = field(default_factory=dict)
    key_nbytes: dict[str, int] = field(default_factory=dict)
    requires_grad: bool = False

    @property
    def nbytes(self) -> int:
        return sum(self.key_nbytes.values())

    def __repr__(self) -> str:
        return f"Unit({self.name!r}, storage={self.storage!r}, tensors={len(self.slots)}, nbytes={self.nbytes})"

    def keys_by_source(self) -> list[tuple[Mapping[str, Tensor], list[str]]]:
        """The unit's keys grouped by the store holding them (one prefetch call per store)."""
        grouped: dict[int, tuple[Mapping[str, Tensor], list[str]]] = {}
        for key in self.slots:
            store = self.sources[key]
            grouped.setdefault(id(store), (store, []))[1].append(key)
        return list(grouped.values())

    def reset(self) -> None:
        """Point every slot back at its ``meta`` placeholder (no copy back: nothing to save)."""
        for slot, placeholder in self.placeholders.values():
            set_slot(slot, placeholder)


@dataclass
class Layout:
    """What a dispatch does with every tensor of the model (see :func:`layout_model`).

    Attributes:
        units: Offload units in definition order.
        resident: ``(group, device, (key, store) or None)``: tensors that live on a device;
            the source is where a tensor on ``meta`` is read from.
        to_write: Materialised tensors of disk units, to write once to the offload folder.
        to_pin: Materialised tensors of cpu units with a GPU executing, to pin once.
        problems: Everything wrong (collected, raised together by the caller).
    """

    units: list[Unit] = field(default_factory=list)
    resident: list[tuple[TensorGroup, torch.device, tuple[str, Mapping[str, Tensor]] | None]] = field(
        default_factory=list
    )
    to_write: dict[str, Tensor] = field(default_factory=dict)
    to_pin: dict[str, Tensor] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)


def offloaded_storages(main_device: torch.device) -> frozenset[str]:
    """Map values whose modules are fetched at forward time rather than kept resident.

    Example:
        >>> sorted(offloaded_storages(torch.device("cpu"))), sorted(offloaded_storages(torch.device("cuda", 0)))
        (['disk'], ['cpu', 'disk'])
    """
    return frozenset(streamed_devices("cpu" if main_device.type == "cpu" else main_device.type))


def layout_model(
    model: nn.Module,
    device_map: Mapping[str, int | str],
    *,
    main_device: torch.device,
    offload_buffers: bool = False,
    preload_module_classes: Sequence[str] = (),
    block_classes: Sequence[str] = (),
    stores: Sequence[Mapping[str, Tensor]] = (),
    ties: Iterable[Iterable[str]] = (),
) -> Layout:
    """Decide, for every tensor of ``model``, where it lives and which unit fetches it.

    Args:
        model: The model (materialised, on ``meta``, or a mix).
        device_map: Normalised map (values: GPU index, ``"cpu"``, ``"disk"``, ``"mps"``).
        main_device: Where offloaded units execute.
        offload_buffers: Fetch buffers of offloaded units too (else they stay resident).
        preload_module_classes: Class names whose instances fetch all their offloaded
            tensors at once (for modules whose children's weights are used directly).
        block_classes: Class names of blocks (``_no_split_modules``): an offloaded entry
            holding blocks is fetched block by block.
        stores: Mappings that hold tensors that are on ``meta`` in the model.
        ties: Extra tie groups (names) for finding a tensor saved under another name.

    Example:
        >>> import torch
        >>> m = torch.nn.Sequential(torch.nn.Linear(2, 2))
        >>> layout_model(m, {"": "disk"}, main_device=torch.device("cpu")).to_write.keys()
        dict_keys(['0.weight', '0.bias'])
    """
    offloaded = offloaded_storages(main_device)
    modules = dict(model.named_modules(remove_duplicate=False))
    order = {name: i for i, name in enumerate(modules)}
    preload = frozenset(preload_module_classes)
    above_blocks = _above_blocks(modules, frozenset(block_classes))
    readers = direct_reads(model)
    layout, units = Layout(), {}
    for group in tensor_groups(model, ties=ties):
        entries = _entries_of(group, device_map, layout.problems)
        if entries is None:
            continue
        resident_on = _resident_device(group, entries, device_map, offloaded, main_device, offload_buffers)
        if resident_on is not None:
            _add_resident(layout, group, resident_on, stores)
            continue
        found = _offload_source(group, entries, device_map, stores, layout)
        if found is None:
            continue
        placeholder = meta_like(group.tensor, group.kind)
        for name in group.names:
            entry = owner(name, device_map)
            assert entry is not None  # checked by _entries_of
            unit = _unit_for(name, entry, device_map[entry], modules, order, preload, above_blocks, units, readers)
            _add_slot(unit, group, name, found, placeholder)
    layout.units = sorted(units.values(), key=lambda u: u.order)
    return layout


def _entries_of(group: TensorGroup, device_map: Mapping[str, object], problems: list[str]) -> list[str] | None:
    entries: list[str] = []
    for name in group.names:
        entry = owner(name, device_map)
        if entry is None:
            problems.append(f"{name}: no device-map entry covers it (add it, or one of its parents)")
            return None
        if entry not in entries:
            entries.append(entry)
    return entries


def _resident_device(
    group: TensorGroup,
    entries: list[str],
    device_map: Mapping[str, int | str],
    offloaded: frozenset[str],
    main_device: torch.device,
    offload_buffers: bool,
) -> torch.device | None:
    kept = [device_map[e] for e in entries if device_map[e] not in offloaded]
    if kept:
        return torch_device(kept[0])  # a tie with one resident home is resident for all its users
    if group.kind == "buffer" and not offload_buffers:
        return main_device  # buffers are small and often read outside forward: keep them
    return None


def _add_resident(
    layout: Layout, group: TensorGroup, device: torch.device, stores: Sequence[Mapping[str, Tensor]]
) -> None:
    found = find_source(group, stores) if group.is_meta else None
    if group.is_meta and found is None:
        layout.problems.append(_not_found(group))
        return
    layout.resident.append((group, device, found))


def _not_found(group: TensorGroup) -> str:
    return (
        f"{group.names[0]}: on meta and in no weights mapping; load it first "
        "(load_checkpoint_in_model) or pass weights= holding it"
    )


def _offload_source(
    group: TensorGroup,
    entries: list[str],
    device_map: Mapping[str, int | str],
    stores: Sequence[Mapping[str, Tensor]],
    layout: Layout,
) -> tuple[str, Mapping[str, Tensor] | None] | None:
    """``(key, store)`` the units read ``group`` from; store None: written or pinned at dispatch."""
    on_disk = any(device_map[e] == "disk" for e in entries)
    found = find_source(group, stores) if group.is_meta else None
    if found is not None:
        if on_disk:
            return found
        layout.to_pin[found[0]] = found[1][found[0]]  # cpu storage means pinned RAM, even from a file
        return found[0], None
    if group.is_meta:
        layout.problems.append(_not_found(group))
        return None
    key = group.names[0]
    (layout.to_write if on_disk else layout.to_pin)[key] = group.tensor
    return key, None


def _unit_for(
    name: str,
    entry: str,
    storage: int | str,
    modules: Mapping[str, nn.Module],
    order: Mapping[str, int],
    preload: frozenset[str],
    above_blocks: frozenset[str],
    units: dict[int, Unit],
    readers: Mapping[str, str] | None = None,
) -> Unit:
    """The unit that fetches tensor ``name`` of device-map ``entry`` (created on first use)."""
    hook = _lift_to_readers(_hook_module_name(name, entry, modules, above_blocks), parent(name), readers or {})
    for candidate in reversed(list(ancestors(hook))):  # outermost preload ancestor wins
        if candidate in modules and type(modules[candidate]).__name__ in preload:
            hook = candidate
            break
    module = modules[hook]
    if id(module) not in units:
        units[id(module)] = Unit(hook, module, str(normalize_device(storage)), order[hook])
    unit = units[id(module)]
    if storage == "disk":
        unit.storage = "disk"  # a unit mixing cpu and disk entries (preload) streams like disk
    return unit


def _hook_module_name(name: str, entry: str, modules: Mapping[str, nn.Module], above_blocks: frozenset[str]) -> str:
    """The module whose hook fetches tensor ``name``: the entry's module, except that a unit
    is never bigger than a block. Going down towards the tensor, one level at a time, it
    skips containers (``ModuleList``, ``ModuleDict``: their forward is never called) and
    modules that hold blocks (``_no_split_modules`` instances): ``{"": "disk"}`` streams
    block by block, not the whole model at once."""
    hook = entry if entry in modules else parent(entry)  # a tensor-level entry hooks its module
    home = parent(name)
    while hook != home and (hook in above_blocks or is_container(modules[hook])):
        rest = home[len(hook) + 1 :] if hook else home
        hook = join(hook, rest.split(".", 1)[0])
    return hook


def _lift_to_readers(hook: str, home: str, readers: Mapping[str, str]) -> str:
    """Move the hook up to a module whose code reads the tensor's module's weights directly
    (``self.rel_embeddings.weight``): hooked on the tensor's own module, the fetch would never
    run, as that module is never called."""
    for module in reversed(list(ancestors(home))):  # outermost first
        reader = readers.get(module)
        if reader is not None and is_prefix(hook, module) and reader != hook and is_prefix(reader, hook):
            return _lift_to_readers(reader, home, readers)
    return hook


def is_container(module: nn.Module) -> bool:
    """True for modules whose forward is never called (``ModuleList``, ``ModuleDict``).

    Example:
        >>> is_container(nn.ModuleList()), is_container(nn.Sequential())
        (True, False)
    """
    return type(module).forward is nn.Module.forward


def called_modules(name: str, modules: Mapping[str, nn.Module]) -> list[nn.Module]:
    """The modules that run for map entry ``name``: itself, or through containers, their
    children (a tensor-level entry has none of its own).

    Example:
        >>> m = nn.Sequential(nn.ModuleList([nn.Linear(1, 1), nn.ReLU()]))
        >>> [type(x).__name__ for x in called_modules("0", dict(m.named_modules()))]
        ['Linear', 'ReLU']
    """
    module = modules.get(name)
    if module is None:
        return []
    if not is_container(module):
        return [module]
    return [found for child in module._modules for found in called_modules(join(name, child), modules)]


def _above_blocks(modules: Mapping[str, nn.Module], blocks: frozenset[str]) -> frozenset[str]:
    """Names of modules that contain an instance of a block class (not the blocks)."""
    above: set[str] = set()
    for name, module in modules.items():
        if name and type(module).__name__ in blocks:
            above.update(list(ancestors(name))[1:])
    return frozenset(above)


def _add_slot(
    unit: Unit,
    group: TensorGroup,
    name: str,
    found: tuple[str, Mapping[str, Tensor] | None],
    placeholder: Tensor,
) -> None:
    key, store = found
    if store is not None:
        unit.sources[key] = store
    if key not in unit.slots:
        unit.slots[key] = []
        unit.key_nbytes[key] = nbytes(group.tensor)
        unit.dtypes[key] = group.tensor.dtype
        if not group.is_meta:
            unit.materialised.add(key)
    slot = group.slot_of[name]
    if (id(slot[0]), slot[1]) not in unit.placeholders:  # a shared module's slot: once
        unit.slots[key].append(slot)
        unit.placeholders[(id(slot[0]), slot[1])] = (slot, placeholder)
    unit.requires_grad |= group.kind == "param" and group.tensor.requires_grad
