"""Bind a dispatch plan to a live model: each planned unit gets its module, its slots and the
store each of its tensors is read from.

The :class:`~bigviz.core.dispatch_plan.DispatchPlan` decided everything (which module
fetches which tensor from which storage, what stays resident where); binding only finds the
objects: the module a unit's hook sits on, the slots its tensors fill, the ``meta``
placeholder each slot holds between forwards, and, for a tensor on ``meta``, the store key
holding its data (its own name, or another name of its tie group). Tensors in memory that a
unit streams are handed back to be written once to the offload folder (disk) or pinned (cpu).
Nothing is moved or written here: :mod:`bigviz.engine.dispatch` carries the binding out.

Example:
    >>> import torch
    >>> from bigviz.modeling.inventory import ModelInventory
    >>> from bigviz.planning.chain import plan_chain
    >>> model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    >>> inventory = ModelInventory.of(model)
    >>> binding = bind(plan_chain(inventory, None, {"0": "cpu", "1": "disk"}).dispatch, inventory)
    >>> [(u.name, u.storage, sorted(u.slots)) for u in binding.units], sorted(binding.to_write)
    ([('1', 'disk', ['1.bias', '1.weight'])], ['1.bias', '1.weight'])
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from bigviz.core.devicemap import device_of
from bigviz.core.dispatch_plan import DispatchPlan
from bigviz.core.names import join
from bigviz.core.offload_units import Fetch, OffloadUnit, Resident
from bigviz.engine.devices import torch_device
from bigviz.engine.weights import Slot, nbytes, offloaded_placeholder, set_slot
from bigviz.modeling.inventory import ModelInventory, is_container
from bigviz.modeling.packed import release_module_state, split

__all__ = ["BoundUnit", "Binding", "bind", "bound_units", "called_modules", "is_container", "find_source"]


@dataclass(eq=False)
class BoundUnit:
    """One planned offload unit bound to the model: the module its hook sits on, and for
    each store key, the slots it fills and the mapping it is read from.

    Attributes:
        plan: the planned unit (name, storage, fetches, bytes).
        module: the module the hook sits on.
        slots: store key -> the slots that key fills (several: a tie inside the unit).
        sources: store key -> the mapping it is read from (set at dispatch).
        placeholders: slot -> the ``meta`` tensor it holds between forwards (reporting the
            execution device: :class:`~bigviz.engine.weights.Offloaded`).
        materialised: keys that were in memory before dispatch (restored by ``remove_hooks``).
        dtypes: key -> the dtype the model declares for it (a store's other dtype is cast).
        key_nbytes: key -> its bytes (their sum, ``nbytes``, is fetched per forward).
    """

    plan: OffloadUnit
    module: nn.Module
    slots: dict[str, list[Slot]] = field(default_factory=dict)
    sources: dict[str, Mapping[str, Tensor]] = field(default_factory=dict)
    placeholders: dict[tuple[int, str], tuple[Slot, Tensor]] = field(default_factory=dict)
    materialised: set[str] = field(default_factory=set)
    dtypes: dict[str, torch.dtype] = field(default_factory=dict)
    key_nbytes: dict[str, int] = field(default_factory=dict)
    requires_grad: bool = False
    grads: dict[str, Tensor] = field(default_factory=dict)  # key -> its placeholder (whose requires_grad counts)

    @property
    def name(self) -> str:
        return self.plan.name

    @property
    def storage(self) -> str:
        return self.plan.storage

    @property
    def order(self) -> int:
        return self.plan.order

    @property
    def nbytes(self) -> int:
        return sum(self.key_nbytes.values())

    def __repr__(self) -> str:
        return f"BoundUnit({self.name!r}, storage={self.storage!r}, tensors={len(self.slots)}, nbytes={self.nbytes})"

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
            release_module_state(slot[0])  # what a layer keeps of its packed weight goes with it


@dataclass
class Binding:
    """A dispatch plan bound to the model (see :func:`bind`).

    Attributes:
        units: bound offload units, in the plan's order.
        resident: ``(slots, tensors, device, (key, store) or None)``: tensors placed on a
            device; a source is where a tensor on ``meta`` is read from.
        to_write: materialised tensors of disk units, to write once to the offload folder.
        to_pin: materialised tensors of cpu units with a GPU executing, to pin once.
        problems: everything wrong (collected, raised together by the caller).
    """

    units: list[BoundUnit] = field(default_factory=list)
    resident: list[tuple[list[Slot], list[Tensor], torch.device, tuple[str, Mapping[str, Tensor]] | None]] = field(
        default_factory=list
    )
    to_write: dict[str, Tensor] = field(default_factory=dict)
    to_pin: dict[str, Tensor] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)


def bind(plan: DispatchPlan, inventory: ModelInventory, stores: Sequence[Mapping[str, Tensor]] = ()) -> Binding:
    """Find every object the plan names in ``inventory``'s model, and the store of every
    tensor on ``meta``.

    Args:
        plan: a checked dispatch plan for this model.
        inventory: the model's inventory, current (after a load: ``refreshed()``).
        stores: mappings holding the data of tensors on ``meta`` (a load's ``disk`` store,
            ``weights=``, ``state_dict=``).
    """
    binding = Binding()
    group_of = {n: g for g in inventory.tree().ties for n in g}
    sources: dict[str, tuple[str, Mapping[str, Tensor] | None] | None] = {}
    placeholders: dict[int, Tensor] = {}  # one per tensor object: a tie stays one object on meta
    device = torch_device(plan.main_device)  # where offloaded weights are used: what they report
    for unit in plan.units:
        bound = BoundUnit(unit, inventory.modules[unit.name])
        for fetch in unit.fetches:
            if fetch.key not in sources:
                group = group_of.get(fetch.key, (fetch.key,))
                sources[fetch.key] = _stream_source(plan, inventory, fetch.key, group, stores, binding)
            found = sources[fetch.key]
            if found is not None:
                _add_fetch(bound, inventory, fetch, found, placeholders, device)
        binding.units.append(bound)
    for resident in plan.resident:
        _bind_resident(binding, inventory, resident, stores)
    return binding


def bound_units(
    model: nn.Module,
    device_map: Mapping[str, object],
    *,
    main_device: object = None,
    stores: Sequence[Mapping[str, Tensor]] = (),
) -> list[BoundUnit]:
    """The offload units of ``device_map`` on ``model``, planned and bound (nothing moves).

    Example:
        >>> import torch
        >>> model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
        >>> [u.name for u in bound_units(model, {"0": "disk", "1": "disk"}, main_device="cpu")]
        ['0', '1']
    """
    from bigviz.planning.chain import plan_chain

    inventory = ModelInventory.of(model)
    plan = plan_chain(inventory, None, dict(device_map), main_device=main_device, resident="map").dispatch
    assert plan is not None
    return bind(plan, inventory, stores).units


def _stream_source(
    plan: DispatchPlan,
    inventory: ModelInventory,
    key: str,
    group: tuple[str, ...],
    stores: Sequence[Mapping[str, Tensor]],
    binding: Binding,
) -> tuple[str, Mapping[str, Tensor] | None] | None:
    """``(key, store)`` the units read a streamed tensor from; store None: written (disk) or
    pinned (cpu) at dispatch."""
    tensor = inventory.tensor(key)
    on_disk = any(device_of(name, plan.device_map) == "disk" for name in group)
    found = find_source(_lookup_names(inventory, group), stores) if tensor.is_meta else None
    if found is not None:
        if on_disk:
            return found
        binding.to_pin[found[0]] = found[1][found[0]]  # cpu storage means pinned RAM, even from a file
        return found[0], None
    if tensor.is_meta:
        binding.problems.append(_not_found(key))
        return None
    (binding.to_write if on_disk else binding.to_pin)[key] = _whole(inventory, key, tensor)
    return key, None


def _whole(inventory: ModelInventory, key: str, tensor: Tensor) -> Tensor:
    """A packed weight with everything it needs (bitsandbytes' ``Linear8bitLt`` keeps its
    weight's row scales in ``module.state`` once it ran: they travel with the weight)."""
    module = inventory.slots[key][0]
    packed = split(tensor, module=module)
    if packed is None or packed.kind != "bitsandbytes Int8Params" or getattr(tensor, "SCB", None) is not None:
        return tensor
    return packed.build(packed.parts)


def _add_fetch(
    unit: BoundUnit,
    inventory: ModelInventory,
    fetch: Fetch,
    found: tuple[str, Mapping[str, Tensor] | None],
    placeholders: dict[int, Tensor],
    device: torch.device,
) -> None:
    key, store = found
    tensor = inventory.tensor(fetch.key)
    if store is not None:
        unit.sources[key] = store
    if key not in unit.slots:
        unit.slots[key] = []
        stored = getattr(store, "stored_nbytes", None)  # a packed weight on meta: its store knows its bytes
        packed = stored(key) if stored is not None else None
        unit.key_nbytes[key] = packed if packed is not None else nbytes(tensor)
        unit.dtypes[key] = tensor.dtype
        if not tensor.is_meta:
            unit.materialised.add(key)
    for name in fetch.names:
        slot = inventory.slots[name]
        current = inventory.tensor(name)
        if (id(slot[0]), slot[1]) not in unit.placeholders:  # a shared module's slot: once
            unit.slots[key].append(slot)
            if id(current) not in placeholders:
                placeholders[id(current)] = offloaded_placeholder(
                    current, slot[2], device=device, name=name, unit=unit.name
                )
            unit.placeholders[(id(slot[0]), slot[1])] = (slot, placeholders[id(current)])
            unit.grads.setdefault(key, placeholders[id(current)])  # its requires_grad, read per forward in C
        unit.requires_grad |= slot[2] == "param" and current.requires_grad


def _bind_resident(
    binding: Binding, inventory: ModelInventory, resident: Resident, stores: Sequence[Mapping[str, Tensor]]
) -> None:
    slots = [inventory.slots[n] for n in resident.names]
    tensors = list({id(t): t for t in (inventory.tensor(n) for n in resident.names)}.values())
    found = None
    if any(t.is_meta for t in tensors):
        found = find_source(_lookup_names(inventory, resident.names), stores)
        if found is None:
            binding.problems.append(_not_found(resident.key))
            return
    binding.resident.append((slots, tensors, torch_device(resident.device), found))


def _lookup_names(inventory: ModelInventory, group: Iterable[str]) -> list[str]:
    """Names a tensor's data may be stored under: each name of its tie group, the first first."""
    return list(dict.fromkeys(alias for name in group for alias in inventory.by_name[name].aliases))


def _not_found(name: str) -> str:
    return (
        f"{name}: on meta and in no weights mapping; load it first "
        "(load_checkpoint_in_model) or pass weights= holding it"
    )


def find_source(
    names: Sequence[str], stores: Iterable[Mapping[str, Tensor]]
) -> tuple[str, Mapping[str, Tensor]] | None:
    """The first ``(key, store)`` holding a tensor under one of ``names``.

    Example:
        >>> import torch
        >>> find_source(["a.weight", "b.weight"], [{"b.weight": torch.ones(1)}])[0]
        'b.weight'
    """
    stores = list(stores)
    for name in names:
        for store in stores:
            if name in store:
                return name, store
    return None


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
