"""One inventory of a model, made once per call: every tensor, the slots that hold it, ties,
non-persistent buffers, parametrizations, module classes and the weights read without a call.

Sizing (:func:`~bigviz.modeling.sizes.module_tree`), planning, checkpoint matching, dispatch
and pipeline stages all read a :class:`ModelInventory`; nothing else in bigviz walks a model's
``named_modules()`` or ``named_parameters()`` with a rule of its own. One call
(``load_checkpoint_and_dispatch``) walks the model once.

**A tie** (one rule, here): tensors that are one object (a shared module, ``head.weight =
emb.weight``), tensors that are the same view of the same memory, and the embedding tie a
transformers model declares (``tie_word_embeddings``) but has not made yet (built on meta,
``tie_weights()`` not run).

Example:
    >>> import torch.nn as nn
    >>> model = nn.ModuleDict({"emb": nn.Embedding(3, 2), "head": nn.Linear(2, 3, bias=False)})
    >>> model["head"].weight = model["emb"].weight
    >>> inventory = ModelInventory.of(model)
    >>> [t.aliases for t in inventory.tensors], inventory.ties
    ([('emb.weight', 'head.weight')], (('emb.weight', 'head.weight'),))
    >>> inventory.tree().total("")  # the tied tensor counted once
    24
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any
from dataclasses import dataclass, replace
from functools import cached_property

import torch
from torch import nn

from bigviz.core.dtypes import canonical_dtype
from bigviz.core.names import join, leaf, parent
from bigviz.core.tree import SizeTree, TensorSpec
from bigviz.modeling.packed import is_packed, packed_kind, stored_nbytes
from bigviz.modeling.reads import reads_of

__all__ = ["Slot", "ModelTensor", "ModelInventory", "merge_groups", "is_container", "tie_model"]

_PLAIN = (torch.Tensor, nn.Parameter)  # a quick test before asking whether a tensor is packed

Slot = tuple[nn.Module, str, str]
"""Where a tensor lives: ``(module, attribute, "param" | "buffer")``."""


@dataclass(frozen=True)
class ModelTensor:
    """One tensor object of a model and every name it is reachable under.

    Attributes:
        name: the first name (definition order), used for device maps and results.
        aliases: every name of this tensor object, ``name`` first (a shared module's
            tensors, or ``head.weight = emb.weight``).
        shape: its shape.
        dtype: its dtype.
        kind: ``"param"`` or ``"buffer"``.
        persistent: False for buffers registered with ``persistent=False`` under every name
            (the model computes them; no checkpoint holds them).
        is_meta: True while it has no data.
        requires_grad: kept when the tensor is replaced.
        device: where it is now, e.g. ``"meta"``, ``"cpu"``, ``"cuda:0"``.
    """

    name: str
    aliases: tuple[str, ...]
    shape: tuple[int, ...]
    dtype: torch.dtype
    kind: str
    persistent: bool
    is_meta: bool
    requires_grad: bool
    device: str = "cpu"

    @property
    def nbytes(self) -> int:
        """Bytes of its elements (works on meta)."""
        numel = 1
        for d in self.shape:
            numel *= d
        return numel * self.dtype.itemsize


def is_container(module: nn.Module) -> bool:
    """True for modules whose forward is never called (``ModuleList``, ``ModuleDict``).

    Example:
        >>> is_container(nn.ModuleList()), is_container(nn.Sequential())
        (True, False)
    """
    return type(module).forward is nn.Module.forward


class ModelInventory:
    """Everything bigviz needs to know about a model's structure, from one walk.

    Build it with :meth:`ModelInventory.of`. The structure (modules, names, slots, ties)
    does not change when a load fills the tensors; :meth:`refreshed` re-reads the tensors
    from their slots (no walk) after a load.

    Attributes:
        model: the model.
        modules: every module name (a shared module under each of its names) -> module,
            in definition order, ``""`` first.
        slots: tensor name -> its slot, in definition order.
        tensors: one :class:`ModelTensor` per tensor object, in definition order.
        ties: groups of tensor names that are one tensor (see the module docstring), the
            first-defined name first.
    """

    def __init__(
        self, model: nn.Module, modules: dict[str, nn.Module], slots: dict[str, Slot], computed: frozenset[str]
    ) -> None:
        self.model = model
        self.modules = modules
        self.slots = slots
        self._computed = computed  # names of non-persistent buffers
        self._described = tuple(_describe(slots, computed))  # the tensors as they are now
        self.ties: tuple[tuple[str, ...], ...] = tuple(
            tuple(g)
            for g in merge_groups(
                _identity_ties(self._described) + _storage_ties(slots) + _declared_ties(model, modules, slots)
            )
        )
        self._trees: dict[tuple[object, ...], SizeTree] = {}

    @classmethod
    def of(cls, model: nn.Module | ModelInventory) -> ModelInventory:
        """The inventory of ``model`` (one ``named_modules`` walk); an inventory is returned
        as it is, so every function can take either."""
        if isinstance(model, ModelInventory):
            return model
        modules: dict[str, nn.Module] = {}
        slots: dict[str, Slot] = {}
        computed: set[str] = set()
        for mname, module in model.named_modules(remove_duplicate=False):
            modules[mname] = module
            for kind, table in (("param", module._parameters), ("buffer", module._buffers)):
                for attr, tensor in table.items():
                    if tensor is not None:
                        slots[join(mname, attr)] = (module, attr, kind)
            computed.update(join(mname, b) for b in module._non_persistent_buffers_set if b in module._buffers)
        return cls(model, modules, slots, frozenset(computed))

    def refreshed(self) -> ModelInventory:
        """The same structure with each tensor re-read from its slot (after a load replaced
        them); no module walk."""
        return ModelInventory(self.model, self.modules, self.slots, self._computed)

    # ---- modules -------------------------------------------------------------------------
    @cached_property
    def classes(self) -> dict[str, str]:
        """Module name -> class name, definition order."""
        return {name: type(m).__name__ for name, m in self.modules.items()}

    @cached_property
    def containers(self) -> frozenset[str]:
        """Modules whose forward is never called (``ModuleList``, ``ModuleDict``)."""
        return frozenset(name for name, m in self.modules.items() if is_container(m))

    @cached_property
    def parametrized(self) -> frozenset[str]:
        """Modules holding a weight computed by ``torch.nn.utils.parametrize`` (weight norm)."""
        return frozenset(parent(name) for name in self.modules if leaf(name) == "parametrizations")

    @cached_property
    def reads(self) -> dict[str, str]:
        """Modules whose tensors an ancestor's code reads without calling them -> that reader
        (see :mod:`bigviz.modeling.reads`)."""
        return reads_of(self.modules.items())

    @cached_property
    def no_split(self) -> tuple[str, ...]:
        """The block classes the model declares (``_no_split_modules``)."""
        declared = getattr(self.model, "_no_split_modules", None) or ()
        return (declared,) if isinstance(declared, str) else tuple(declared)

    @cached_property
    def same_module(self) -> dict[str, str]:
        """Module names that are another name of an earlier module (one object shared under
        two names) -> that earlier name."""
        return {name: first for name, m in self.modules.items() if (first := self._first_names[id(m)]) != name}

    def name_of(self, module: nn.Module) -> str | None:
        """The first name of ``module`` in this model, or None."""
        return self._first_names.get(id(module))

    @cached_property
    def _first_names(self) -> dict[int, str]:
        names: dict[int, str] = {}
        for name, module in self.modules.items():
            names.setdefault(id(module), name)
        return names

    # ---- tensors -------------------------------------------------------------------------
    def tensor(self, name: str) -> torch.Tensor:
        """The tensor in slot ``name`` now."""
        module, attr, kind = self.slots[name]
        return (module._parameters if kind == "param" else module._buffers)[attr]  # type: ignore[return-value]

    @cached_property
    def tensors(self) -> tuple[ModelTensor, ...]:
        """One :class:`ModelTensor` per tensor object, definition order, as the tensors were
        when the inventory was made (sizing and planning never need them: made on first use)."""
        return tuple(ModelTensor(*fields) for fields in self._described)

    @cached_property
    def by_name(self) -> dict[str, ModelTensor]:
        """Every tensor name (aliases included) -> its :class:`ModelTensor`."""
        return {alias: t for t in self.tensors for alias in t.aliases}

    def names(self) -> Iterator[str]:
        """Every tensor name, definition order."""
        return iter(self.slots)

    def has_meta(self) -> bool:
        """True if some tensor has no data yet."""
        return any(t.is_meta for t in self.tensors)

    # ---- the size tree -------------------------------------------------------------------
    def tree(self, dtype: object = None, special_dtypes: Mapping[str, object] | None = None) -> SizeTree:
        """The model's :class:`~bigviz.core.tree.SizeTree`, optionally re-sized to ``dtype``
        (floating tensors only; ``special_dtypes`` maps module or tensor names to a dtype
        that wins for them). Made once per dtype."""
        special = {k: str(v) for k, v in (special_dtypes or {}).items()}
        key = (None if dtype is None else str(dtype), tuple(sorted(special.items())))
        if key not in self._trees:
            base = self._trees.get((None, ()))
            if base is None:
                base = self._trees[(None, ())] = self._build_tree()
            self._trees[key] = base.with_dtype(key[0], special) if key != (None, ()) else base
        return self._trees[key]

    def _build_tree(self) -> SizeTree:
        specs = []
        computed = self._computed
        shapes = {alias: (shape, dtype) for _, aliases, shape, dtype, *_ in self._described for alias in aliases}
        dtypes: dict[torch.dtype, str] = {}
        for name, (module, attr, kind) in self.slots.items():
            shape, torch_dtype = shapes[name]
            dtype = dtypes.get(torch_dtype) or dtypes.setdefault(torch_dtype, canonical_dtype(torch_dtype))
            spec = TensorSpec(name, _numel(shape), dtype, shape, kind, name not in computed)
            tensor = (module._parameters if kind == "param" else module._buffers)[attr]
            if type(tensor) not in _PLAIN and is_packed(tensor):  # a quantized weight: its packed bytes
                spec = replace(spec, stored=stored_nbytes(tensor, module=module), quant=packed_kind(tensor))
            specs.append(spec)
        return SizeTree.build(specs, self.classes, self.ties, containers=self.containers)

    def __repr__(self) -> str:
        return f"ModelInventory({type(self.model).__name__}, {len(self.modules)} modules, {len(self.slots)} tensors)"


def tie_model(model: nn.Module) -> None:
    """Let a transformers-style model make the ties it declares (a no-op for other modules).

    A transformers model built on meta is not tied until ``tie_weights()`` runs; a loader
    ties it first, so the tied duplicate (``lm_head.weight``) is one object with its
    partner. This rebinds parameters only; it reads no data.
    """
    tie = getattr(model, "tie_weights", None)
    if callable(tie):
        tie()


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


Described = tuple[str, tuple[str, ...], tuple[int, ...], torch.dtype, str, bool, bool, bool, str]
"""The fields of a :class:`ModelTensor`, in its order: a tuple is made several times faster
than the frozen dataclass, and an inventory is made at every planning call."""


def _describe(slots: Mapping[str, Slot], computed: frozenset[str]) -> Iterator[Described]:
    """The fields of one :class:`ModelTensor` per tensor object, grouped by identity,
    definition order."""
    groups: dict[int, list[Any]] = {}  # id -> [first name, tensor, kind, other names...]
    for name, (module, attr, kind) in slots.items():
        tensor = (module._parameters if kind == "param" else module._buffers)[attr]
        members = groups.get(id(tensor))
        if members is None:
            groups[id(tensor)] = [name, tensor, kind]
        else:
            members.append(name)
    device_names: dict[torch.device, str] = {}  # str(device) is slow; a model has few devices
    for name, tensor, kind, *more in groups.values():
        device = tensor.device
        where = device_names.get(device) or device_names.setdefault(device, str(device))
        persistent = kind == "param" or name not in computed or any(m not in computed for m in more)
        yield (
            name,
            (name, *more),
            tuple(tensor.shape),
            tensor.dtype,
            kind,
            persistent,
            tensor.is_meta,  # what device.type == "meta" says, without making the type string
            tensor.requires_grad,
            where,
        )


def _identity_ties(described: Iterable[Described]) -> list[list[str]]:
    return [list(aliases) for _, aliases, *_ in described if len(aliases) > 1]


def _storage_ties(slots: Mapping[str, Slot]) -> list[list[str]]:
    """Distinct tensor objects that are the same view of the same memory."""
    by_key: dict[tuple[object, ...], list[str]] = {}
    seen: set[int] = set()
    for name, (module, attr, kind) in slots.items():
        tensor = (module._parameters if kind == "param" else module._buffers)[attr]
        assert tensor is not None
        if (
            tensor.is_meta
            or tensor.numel() == 0
            or id(tensor) in seen
            or (type(tensor) not in _PLAIN and is_packed(tensor))
        ):
            continue  # meta tensors have no memory; an object's own names are identity ties; packed: several
        seen.add(id(tensor))
        key = (
            tensor.device,
            tensor.untyped_storage().data_ptr(),
            tensor.storage_offset(),
            tuple(tensor.shape),
            tuple(tensor.stride()),
            tensor.dtype,
        )
        by_key.setdefault(key, []).append(name)
    return [names for names in by_key.values() if len(names) > 1]


def _declared_ties(model: nn.Module, modules: Mapping[str, nn.Module], slots: Mapping[str, Slot]) -> list[list[str]]:
    """The embedding tie a transformers model will make in ``tie_weights()`` but has not yet."""
    config = getattr(model, "config", None)
    if not getattr(config, "tie_word_embeddings", False):
        return []
    try:
        inp, out = model.get_input_embeddings(), model.get_output_embeddings()  # type: ignore[operator]
    except (AttributeError, NotImplementedError):
        return []
    if inp is None or out is None or getattr(inp, "weight", None) is getattr(out, "weight", None):
        return []
    where: dict[int, str] = {}
    for name, module in modules.items():
        where.setdefault(id(module), name)
    a, b = join(where.get(id(inp), "?"), "weight"), join(where.get(id(out), "?"), "weight")
    return [[a, b]] if a in slots and b in slots else []


def merge_groups(groups: list[list[str]]) -> list[list[str]]:
    """Union overlapping groups (a declared tie may extend an identity tie), in linear time
    (union-find: rescanning every merged group per group was quadratic in the ties).

    Groups come out in the order of the last group that touched them, names in the order of
    the last group naming them.

    Example:
        >>> merge_groups([["a", "b"], ["c", "d"], ["b", "e"]])
        [['c', 'd'], ['a', 'b', 'e']]
    """
    parents: dict[str, str] = {}

    def root(name: str) -> str:
        while parents[name] != name:
            parents[name] = parents[parents[name]]  # path halving
            name = parents[name]
        return name

    for group in groups:
        for name in group:
            parents.setdefault(name, name)
        for name in group[1:]:
            parents[root(name)] = root(group[0])
    order = {n: i for i, g in enumerate(groups) for n in g}
    members: dict[str, list[str]] = {}
    for name in parents:
        members.setdefault(root(name), []).append(name)
    merged = sorted(members.values(), key=lambda m: max(order[n] for n in m))
    return [sorted(m, key=lambda n: (order[n], n)) for m in merged]
