"""The size tree: every module of a model with its bytes, built from tensor names and sizes.

A ``SizeTree`` is what the planner works on. It can come from an ``nn.Module`` (see
``bigviz.modeling.module_tree``) or from checkpoint headers alone (see
``bigviz.checkpoint.tree_from_checkpoint``): both give a list of ``TensorSpec`` and,
optionally, the module classes and the groups of tied tensors.

A tied tensor (``lm_head.weight`` sharing storage with ``transformer.wte.weight``) is
counted once, by its *leader*: the first of its group in definition order.

Example:
    >>> tree = SizeTree.build(
    ...     [TensorSpec("emb.weight", 10, "float32"), TensorSpec("head.weight", 10, "float32"),
    ...      TensorSpec("head.bias", 2, "float32")],
    ...     ties=[("emb.weight", "head.weight")])
    >>> tree.total(""), tree.total("head"), tree.leader_of["head.weight"]
    (48, 8, 'emb.weight')
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, TypeVar

from bigviz.core.dtypes import FLOATING_DTYPES, canonical_dtype, tensor_nbytes
from bigviz.core.names import ancestors, owner, parent
from bigviz.core.errors import UsageError

__all__ = ["TensorSpec", "ModuleNode", "SizeTree"]

T = TypeVar("T")


@dataclass(frozen=True)
class TensorSpec:
    """One parameter or buffer: its full dotted name, element count and dtype name.

    A quantized weight keeps its logical ``dtype`` and ``shape`` (what the model computes with)
    and says in ``stored`` the bytes its format holds (packed values, scales, zero points) and
    in ``quant`` which format (see :mod:`bigviz.core.quant`).
    """

    name: str
    numel: int
    dtype: str
    shape: tuple[int, ...] = ()
    kind: str = "param"  # "param" or "buffer"
    persistent: bool = True  # False: a buffer the model computes itself (never in a checkpoint)
    stored: int | None = None  # bytes as a quantizer packs it (None: numel x the dtype's size)
    quant: str = ""  # the quantized format, e.g. "int8"; "" for a plain tensor

    @property
    def nbytes(self) -> int:
        """Bytes it takes: as packed when quantized, else its elements (sub-byte dtypes packed,
        rounded up)."""
        return self.stored if self.stored is not None else tensor_nbytes(self.dtype, self.numel)


@dataclass(frozen=True)
class ModuleNode:
    """A module in the tree. Byte counts include each tied tensor once (at its leader)."""

    name: str
    class_name: str
    children: tuple[str, ...]
    tensors: tuple[str, ...]  # tensors held directly by this module, tied followers included
    own_bytes: int
    total_bytes: int
    n_params: int
    depth: int
    container: bool = False  # its forward is never called (ModuleList, ModuleDict): never a unit


class SizeTree:
    """Modules in definition order (pre-order, ``""`` first) with per-subtree byte totals.

    Build one with :meth:`SizeTree.build`; it is immutable afterwards.
    """

    def __init__(
        self, nodes: dict[str, ModuleNode], tensors: dict[str, TensorSpec], ties: tuple[tuple[str, ...], ...]
    ) -> None:
        self.nodes = nodes
        self.tensors = tensors
        self.ties = ties
        self.leader_of = {f: group[0] for group in ties for f in group[1:]}
        self._memo: dict[tuple[object, ...], Any] = {}

    @classmethod
    def build(
        cls,
        tensors: Iterable[TensorSpec],
        modules: Mapping[str, str] | None = None,
        ties: Iterable[Sequence[str]] = (),
        *,
        containers: Collection[str] = (),
    ) -> SizeTree:
        """Build the tree. ``modules`` maps module name -> class name in definition order;
        modules it lacks are made from the tensor names (class name ``""``). ``containers``
        names the modules whose forward is never called (``ModuleList``, ``ModuleDict``).

        Raises:
            ValueError: if a tied group names a tensor that is not in ``tensors``.
        """
        specs = {t.name: t for t in tensors}
        classes = dict(modules or {})
        classes.setdefault("", "")
        for tensor in specs:  # every enclosing module of every tensor must exist
            for anc in list(ancestors(parent(tensor))):
                if anc in classes:
                    break
                classes[anc] = ""
        preorder, children, direct = _structure(classes, specs)
        # Leaders are the first tensor of a group in the order the planner walks the tree
        # (pre-order, a module's own tensors before its children's), whatever the input order.
        walk = {t: i for i, t in enumerate(t for name, _ in preorder for t in direct[name])}
        groups = _tie_groups(ties, walk)
        followers = {f for g in groups for f in g[1:]}
        nodes = _assemble(preorder, children, direct, classes, specs, followers, frozenset(containers))
        return cls(nodes, specs, groups)

    def memo(self, key: tuple[object, ...], make: Callable[[], T]) -> T:
        """``make()``, computed once per tree and ``key`` (a tree never changes)."""
        if key not in self._memo:
            self._memo[key] = make()
        return self._memo[key]  # type: ignore[no-any-return]

    @property
    def order(self) -> dict[str, int]:
        """Module name -> its position in definition order."""
        return self.memo(("order",), lambda: {name: i for i, name in enumerate(self.nodes)})

    # ---- queries -------------------------------------------------------------------
    def total(self, name: str) -> int:
        """Bytes of a module's subtree or of one tensor (0 for a tied follower)."""
        node = self.nodes.get(name)
        if node is not None:
            return node.total_bytes
        return self.tensor_bytes(name)

    def tensor_bytes(self, name: str) -> int:
        """Bytes a tensor adds to the model: 0 if it is a tied follower."""
        return 0 if name in self.leader_of else self.tensors[name].nbytes

    def size_map(self) -> dict[str, int]:
        """``{module: bytes}`` for every module, ``""`` being the whole model."""
        return {name: node.total_bytes for name, node in self.nodes.items()}

    def subtree_tensors(self, name: str) -> list[str]:
        """Every tensor below a module (or the tensor itself), in definition order."""
        if name in self.tensors and name not in self.nodes:
            return [name]
        out: list[str] = []
        stack = [name]
        while stack:
            node = self.nodes[stack.pop()]
            out.extend(node.tensors)
            stack.extend(reversed(node.children))
        return out

    def with_dtype(self, dtype: str | None, special: Mapping[str, str] | None = None) -> SizeTree:
        """The same tree with floating tensors re-sized to ``dtype`` (integer tensors keep
        theirs; a quantized tensor keeps its packed bytes and takes ``dtype`` as its compute
        dtype); ``special`` maps module prefixes to a dtype that wins for their tensors.

        Example:
            >>> t = SizeTree.build([TensorSpec("w", 4, "float32"), TensorSpec("i", 4, "int64")])
            >>> t.with_dtype("float16").total("")
            40
        """
        if dtype is None and not special:
            return self
        special = {k: canonical_dtype(v) for k, v in (special or {}).items()}
        dtype = canonical_dtype(dtype) if dtype is not None else None
        specs = []
        for spec in self.tensors.values():
            new = dtype
            key = owner(spec.name, special) if special else None
            if key is not None:
                new = special[key]
            if new is not None and spec.dtype in FLOATING_DTYPES:
                spec = replace(spec, dtype=new)
            specs.append(spec)
        classes = {name: node.class_name for name, node in self.nodes.items()}
        return SizeTree.build(specs, classes, self.ties, containers=self.containers)

    @property
    def containers(self) -> frozenset[str]:
        """Modules whose forward is never called (``ModuleList``, ``ModuleDict``)."""
        return frozenset(name for name, node in self.nodes.items() if node.container)

    def __len__(self) -> int:
        return len(self.nodes)

    def __repr__(self) -> str:
        return f"SizeTree({len(self.nodes)} modules, {len(self.tensors)} tensors, {self.total('')} bytes)"


def _tie_groups(ties: Iterable[Sequence[str]], order: Mapping[str, int]) -> tuple[tuple[str, ...], ...]:
    groups = []
    unknown = [n for group in ties for n in group if n not in order]
    if unknown:
        raise UsageError(f"tied tensor names not in the model: {unknown}")
    for group in ties:
        members = sorted(set(group), key=order.__getitem__)
        if len(members) > 1:
            groups.append(tuple(members))
    return tuple(groups)


def _structure(
    classes: Mapping[str, str], specs: Mapping[str, TensorSpec]
) -> tuple[list[tuple[str, int]], dict[str, list[str]], dict[str, list[str]]]:
    """Pre-order (name, depth), children and direct tensors of every module."""
    children: dict[str, list[str]] = {name: [] for name in classes}
    direct: dict[str, list[str]] = {name: [] for name in classes}
    for name in classes:
        if name:
            children[parent(name)].append(name)
    for tensor in specs:
        direct[parent(tensor)].append(tensor)
    preorder: list[tuple[str, int]] = []
    stack = [("", 0)]
    while stack:  # iterative: a deep nn.Sequential must not hit the recursion limit
        name, depth = stack.pop()
        preorder.append((name, depth))
        stack.extend((child, depth + 1) for child in reversed(children[name]))
    return preorder, children, direct


def _assemble(
    preorder: list[tuple[str, int]],
    children: Mapping[str, list[str]],
    direct: Mapping[str, list[str]],
    classes: Mapping[str, str],
    specs: Mapping[str, TensorSpec],
    followers: set[str],
    containers: frozenset[str],
) -> dict[str, ModuleNode]:
    totals: dict[str, tuple[int, int, int]] = {}
    for name, _ in reversed(preorder):  # post-order accumulation
        counted = [specs[t] for t in direct[name] if t not in followers]
        own = sum(t.nbytes for t in counted)
        params = sum(t.numel for t in counted if t.kind == "param")
        sub = [totals[c] for c in children[name]]
        totals[name] = (own, own + sum(s[1] for s in sub), params + sum(s[2] for s in sub))
    return {
        name: ModuleNode(
            name, classes[name], tuple(children[name]), tuple(direct[name]), *totals[name], depth, name in containers
        )
        for name, depth in preorder
    }
