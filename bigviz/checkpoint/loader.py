"""Execute a checked `LoadPlan`: tensor by tensor into the model's slots, or back as it was.

Everything was decided before this runs (which key fills which tensor, on which device, in
which dtype, converted how; what stays on disk): see :mod:`bigviz.checkpoint.load_plan`.
This module only carries it out. Safetensors on the CPU with no dtype change become
zero-copy views of the memory-mapped files; tensors planned for ``"disk"`` stay on meta
and come back as `LazyWeights` over the original files (or over a one-time safetensors copy
in ``offload_folder`` of what cannot be read in place). Should anything fail midway, every
slot is put back as it was, and the files opened so far are closed.

Example:
    >>> import tempfile, torch, pathlib
    >>> from bigviz.checkpoint.save import save_sharded
    >>> from bigviz.checkpoint.load import plan_load
    >>> from bigviz.modeling.inventory import ModelInventory
    >>> folder = save_sharded(torch.nn.Linear(2, 2), pathlib.Path(tempfile.mkdtemp()) / "c", progress=False)
    >>> with torch.device("meta"):
    ...     model = torch.nn.Linear(2, 2)
    >>> inventory = ModelInventory.of(model)
    >>> index, plan = plan_load(inventory, folder)
    >>> execute_load(inventory, index, plan, progress=False).nbytes, model.weight.device.type
    (24, 'cpu')
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from bigviz.checkpoint import hf
from bigviz.checkpoint.convert import ConvertedWeights
from bigviz.checkpoint.index import CheckpointIndex
from bigviz.checkpoint.lazy import LazyWeights, WeightStores
from bigviz.checkpoint.load_plan import LoadPlan, TensorLoad
from bigviz.checkpoint.offload_folder import offload_weights
from bigviz.checkpoint.packed_weights import PackedWeights, flatten
from bigviz.checkpoint.quantized import is_packed_load, packed_store
from bigviz.checkpoint.progress import byte_bar
from bigviz.modeling.inventory import ModelInventory
from bigviz.modeling.packed import is_packed, stored_nbytes

__all__ = ["Executed", "execute_load"]


@dataclass
class Executed:
    """What executing a load plan did: bytes materialised, the offload folder written (if
    any) and the stores holding what stays on disk."""

    nbytes: int = 0
    folder: Path | None = None
    stores: list[Mapping[str, torch.Tensor]] = field(default_factory=list)

    def disk(self) -> Mapping[str, torch.Tensor] | None:
        """One mapping over every store (None when nothing stays on disk)."""
        if not self.stores:
            return None
        return self.stores[0] if len(self.stores) == 1 else WeightStores(self.stores)


def execute_load(
    inventory: ModelInventory, index: CheckpointIndex, plan: LoadPlan, *, progress: bool = True, inplace: bool = False
) -> Executed:
    """Carry out ``plan`` (already checked) on ``inventory``'s model; undo it all on any error.

    Args:
        inventory: the model's inventory (its slots are filled).
        index: the checkpoint the plan was made from.
        plan: the load plan.
        progress: show a progress bar over bytes once the work has run for a second.
        inplace: copy into tensors that hold data already (their objects and devices stay).
    """
    slots = _Slots(inventory, [*plan.loads, *plan.computed])
    done = Executed()
    try:
        disk = [load for load in plan.loads if load.device == "disk"]
        done.nbytes = _materialise(slots, index, plan, progress=progress, inplace=inplace, model=inventory.model)
        done.folder = _disk_weights(index, disk, plan.offload_folder, inventory.model, done.stores)
        _leave_on_meta(slots, disk)
        done.stores += _compute(inventory, slots, list(plan.computed))
    except BaseException:
        slots.restore()  # the model is as it was; the files opened so far are closed
        WeightStores(done.stores).close()
        raise
    return done


def _materialise(
    slots: _Slots, index: CheckpointIndex, plan: LoadPlan, *, progress: bool, inplace: bool, model: torch.nn.Module
) -> int:
    todo = [load for load in plan.loads if load.device != "disk"]
    plain = [load for load in todo if not load.fused]
    sources = {key for load in todo if load.fused for key in load.keys}
    names = {load.name: load.key for load in plain} | {key: key for key in sources}
    nbytes = 0
    with (
        LazyWeights(index, names) as weights,
        byte_bar(sum(load.nbytes for load in todo), "loading", enabled=progress) as bar,
    ):
        for load in plain:
            nbytes += slots.fill(load, _convert(weights[load.name], load), inplace=inplace)
            bar.update(load.nbytes)
        fused = [load for load in todo if load.fused]
        converted = ConvertedWeights(
            [load.conversion for load in fused],
            weights.__getitem__,  # type: ignore[misc]
            dtypes={load.name: load.dtype for load in fused},
            model=model,
        )
        for load in fused:
            value = converted[load.name]
            value = value if str(value.device) == load.device else value.to(load.device)
            nbytes += slots.fill(load, value, inplace=inplace)
            bar.update(load.nbytes)
    return nbytes


def _convert(tensor: torch.Tensor, load: TensorLoad) -> torch.Tensor:
    """Move and cast, narrowing before a device copy and widening after (fewer bytes moved)."""
    if tensor.dtype == load.dtype or not tensor.is_floating_point():
        return tensor.to(load.device)
    if tensor.element_size() > load.dtype.itemsize:
        return tensor.to(load.dtype).to(load.device)
    return tensor.to(load.device).to(load.dtype)


def _disk_weights(
    index: CheckpointIndex,
    disk: list[TensorLoad],
    offload_folder: str | None,
    model: torch.nn.Module,
    stores: list[Mapping[str, torch.Tensor]],
) -> Path | None:
    """Add to ``stores`` the disk tensors' sources: the safetensors files themselves (plain and
    renamed keys, read in place), and a one-time safetensors copy in ``offload_folder`` of what
    cannot be read in place (other formats, fused tensors); returns that folder, if written.
    Each tensor comes back in its load dtype."""
    stored = [load for load in disk if is_packed_load(load) and load.conversion.rule.in_place]  # type: ignore[union-attr]
    if stored:  # stored quantized: read in place, each weight built from its parts at each fetch
        stores.append(packed_store(index, stored))
    in_place = [load for load in disk if load.in_place]
    written = [load for load in disk if not load.in_place and load not in stored]
    if in_place:
        names = {alias: load.key for load in in_place for alias in load.aliases}
        dtypes = {alias: load.dtype for load in in_place for alias in load.aliases}
        stores.append(LazyWeights(index, names, dtypes=dtypes))
    if not written:
        return None
    assert offload_folder is not None  # checked before loading
    folder = Path(offload_folder)
    plain = [load for load in written if not load.fused]
    fused = [load for load in written if load.fused]
    sources = {key for load in fused for key in load.keys}
    with LazyWeights(index, {load.name: load.key for load in plain} | {k: k for k in sources}) as weights:
        converted = ConvertedWeights(
            [load.conversion for load in fused],
            weights.__getitem__,  # type: ignore[misc]
            dtypes={load.name: load.dtype for load in fused},
            model=model,
        )
        source = WeightStores([{load.name: weights[load.name] for load in plain}, converted])
        flat, recipes = flatten(source)  # weights quantized while loading: written packed, once
        names = {alias: load.name for load in written for alias in load.aliases if load.name not in recipes}
        dtypes = {alias: load.dtype for load in written for alias in load.aliases if load.name not in recipes}
        parts = {key: key for recipe in recipes.values() for key in recipe.keys.values()}
        store: Mapping[str, torch.Tensor] = offload_weights(flat, folder, names | parts, dtypes=dtypes)  # locked
        if recipes:
            store = PackedWeights(
                store, {a: recipes[load.name] for load in written if load.name in recipes for a in load.aliases}
            )
        stores.append(store)
    return folder


def _leave_on_meta(slots: _Slots, disk: list[TensorLoad]) -> None:
    """Disk tensors stay on meta in the model, in the dtype they load in (so the engine casts
    what it fetches to that dtype, and the model reports it)."""
    for load in disk:
        old = slots.current(load.name)
        if not old.is_meta or old.dtype != load.dtype:
            slots.fill(load, torch.empty(old.shape, dtype=load.dtype, device="meta"), inplace=False)


def _compute(inventory: ModelInventory, slots: _Slots, computed: list[TensorLoad]) -> list[Mapping[str, torch.Tensor]]:
    """Materialise and compute ``computed`` (a buffer computed at construction already is cast
    to its dtype); those planned for disk are handed back in a store held in RAM (they are
    in no file) and left on meta in the model."""
    if not computed:
        return []
    fresh = []
    for load in computed:
        old = slots.current(load.name)
        device = "cpu" if load.device == "disk" else load.device
        if old.is_meta:
            slots.fill(load, torch.empty(old.shape, dtype=load.dtype, device=device), inplace=False)
            fresh += load.aliases
        else:  # computed at construction already: only its dtype changes
            slots.fill(load, old.detach().to(device=device, dtype=load.dtype), inplace=False)
    hf.initialise_computed(inventory, fresh)
    on_disk = [load for load in computed if load.device == "disk"]
    store = {alias: slots.current(load.name).detach() for load in on_disk for alias in load.aliases}
    _leave_on_meta(slots, on_disk)
    return [store] if store else []


class _Slots:
    """Where each model tensor lives (its inventory slot), and what was there before.

    A load into a real tensor copies in place (optimizers and user references keep the same
    objects), so the value it overwrites is saved first, on the CPU: `restore` puts back the
    values as well as the objects. That costs up to the model's size in RAM until the load
    ends; loading into new tensors and swapping at the end would cost the same (every new
    tensor held at once) and would break the objects' identity.
    """

    def __init__(self, inventory: ModelInventory, loads: Sequence[TensorLoad]) -> None:
        self._saved: list[tuple[torch.Tensor, torch.Tensor]] = []  # (tensor overwritten, old value)
        self._slots: dict[str, tuple[dict, str, torch.Tensor]] = {}
        for load in loads:
            for alias in load.aliases:
                module, attr, kind = inventory.slots[alias]
                store = module._parameters if kind == "param" else module._buffers
                self._slots[alias] = (store, attr, store[attr])  # type: ignore[assignment]

    def current(self, name: str) -> torch.Tensor:
        """What slot ``name`` holds now."""
        store, leaf, _ = self._slots[name]
        return store[leaf]

    def fill(self, load: TensorLoad, tensor: torch.Tensor, *, inplace: bool) -> int:
        """Put ``tensor`` under every name of ``load`` (one object: a tie survives); its bytes."""
        store, leaf, old = self._slots[load.name]
        nbytes = stored_nbytes(tensor)
        if inplace and not old.is_meta:
            with torch.no_grad():
                self._saved.append((old, old.detach().to("cpu", copy=True)))
                old.copy_(tensor)
            return nbytes
        if is_packed(tensor):  # a quantized weight: as its library made it (inference only)
            tensor = (
                tensor if isinstance(tensor, torch.nn.Parameter) else torch.nn.Parameter(tensor, requires_grad=False)
            )
        elif isinstance(old, torch.nn.Parameter):
            grad = old.requires_grad and tensor.is_floating_point()
            tensor = torch.nn.Parameter(tensor, requires_grad=grad)
        for alias in load.aliases:
            alias_store, alias_leaf, _ = self._slots[alias]
            alias_store[alias_leaf] = tensor
        return nbytes

    def restore(self) -> None:
        with torch.no_grad():
            for tensor, value in reversed(self._saved):  # values first, then the objects
                tensor.copy_(value)
        self._saved.clear()
        for store, leaf, old in self._slots.values():
            store[leaf] = old
