"""Describe an ``nn.Module`` as a :class:`~bigviz.core.tree.SizeTree`: the only bridge from
torch into the pure planner.

Parameters and buffers both count; a tied tensor counts once. Ties are found by object
identity, by shared storage (tensors that are views of the same memory), and, for
transformers models built on ``meta`` whose ``tie_weights()`` has not run yet, from the
config's ``tie_word_embeddings``.

Example:
    >>> import torch.nn as nn
    >>> compute_module_sizes(nn.Linear(4, 2))
    {'': 40}
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch
import torch.nn as nn

from bigviz.core.names import join
from bigviz.core.dtypes import canonical_dtype
from bigviz.core.tree import SizeTree, TensorSpec

if TYPE_CHECKING:
    import pandas as pd

__all__ = ["module_tree", "compute_module_sizes", "size_table", "find_tied_parameters"]


def _tensor_key(tensor: torch.Tensor) -> tuple[object, ...]:
    """Two tensors with the same key are one tensor in memory (a tie)."""
    if tensor.device.type == "meta" or tensor.numel() == 0:
        return ("id", id(tensor))
    return ("mem", tensor.device, tensor.untyped_storage().data_ptr(), tensor.storage_offset(),
            tuple(tensor.shape), tuple(tensor.stride()), tensor.dtype)


def _walk(model: nn.Module) -> tuple[dict[str, str], list[tuple[str, torch.Tensor, str]]]:
    """Module classes, and every (name, tensor, kind); kind is ``"param"``, ``"buffer"`` or
    ``"computed"`` (a non-persistent buffer: the model makes it, no checkpoint holds it)."""
    classes: dict[str, str] = {}
    tensors: list[tuple[str, torch.Tensor, str]] = []
    for mname, module in model.named_modules(remove_duplicate=False):
        classes[mname] = type(module).__name__
        tensors += [(join(mname, n), p, "param") for n, p in module._parameters.items() if p is not None]
        computed = module._non_persistent_buffers_set
        tensors += [(join(mname, n), b, "computed" if n in computed else "buffer")
                    for n, b in module._buffers.items() if b is not None]
    return classes, tensors


def find_tied_parameters(model: nn.Module) -> list[list[str]]:
    """Groups of parameter names that are one tensor, first-defined name first.

    Example:
        >>> import torch.nn as nn
        >>> m = nn.ModuleDict({"emb": nn.Embedding(3, 2), "head": nn.Linear(2, 3, bias=False)})
        >>> m["head"].weight = m["emb"].weight
        >>> find_tied_parameters(m)
        [['emb.weight', 'head.weight']]
    """
    tree = module_tree(model)  # one definition of a tie: identity, shared storage, declared
    return [list(g) for g in tree.ties if all(tree.tensors[n].kind == "param" for n in g)]


def _groups(tensors: list[tuple[str, torch.Tensor, str]]) -> list[list[str]]:
    by_key: dict[tuple[object, ...], list[str]] = {}
    for name, tensor, _ in tensors:
        by_key.setdefault(_tensor_key(tensor), []).append(name)
    return [names for names in by_key.values() if len(names) > 1]


def _declared_ties(model: nn.Module, names: set[str]) -> list[list[str]]:
    """Ties a transformers model will make in ``tie_weights()`` but has not made yet."""
    config = getattr(model, "config", None)
    if not getattr(config, "tie_word_embeddings", False):
        return []
    try:
        inp, out = model.get_input_embeddings(), model.get_output_embeddings()  # type: ignore[operator]
    except (AttributeError, NotImplementedError):
        return []
    if inp is None or out is None or inp.weight is out.weight:
        return []
    where = {id(m): n for n, m in model.named_modules()}
    a, b = join(where.get(id(inp), "?"), "weight"), join(where.get(id(out), "?"), "weight")
    return [[a, b]] if a in names and b in names else []


def module_tree(model: nn.Module, dtype: torch.dtype | str | None = None,
                special_dtypes: Mapping[str, torch.dtype | str] | None = None) -> SizeTree:
    """The model's :class:`SizeTree`, optionally re-sized to ``dtype`` (floating tensors only;
    ``special_dtypes`` maps module or tensor names to a dtype that wins for them).

    Example:
        >>> import torch.nn as nn
        >>> module_tree(nn.Linear(4, 2), dtype="float16").total("")
        20
    """
    classes, tensors = _walk(model)
    specs, seen = [], set()
    for name, tensor, kind in tensors:
        if name not in seen:  # a module reachable by two paths lists its tensors twice
            seen.add(name)
            specs.append(TensorSpec(name, tensor.numel(), canonical_dtype(tensor.dtype),
                                    tuple(tensor.shape), "param" if kind == "param" else "buffer",
                                    persistent=kind != "computed"))
    ties = _groups(tensors) + _declared_ties(model, seen)
    tree = SizeTree.build(specs, classes, _merge(ties))
    if dtype is None and not special_dtypes:
        return tree
    special = {k: str(v) for k, v in (special_dtypes or {}).items()}
    return tree.with_dtype(str(dtype) if dtype is not None else None, special)


def _merge(groups: list[list[str]]) -> list[list[str]]:
    """Union overlapping groups (a declared tie may extend an identity tie), in linear time
    (union-find: rescanning every merged group per group was quadratic in the ties).

    Groups come out in the order of the last group that touched them, names in the order of
    the last group naming them.

    Example:
        >>> _merge([["a", "b"], ["c", "d"], ["b", "e"]])
        [['c', 'd'], ['a', 'b', 'e']]
    """
    parent: dict[str, str] = {}

    def root(name: str) -> str:
        while parent[name] != name:
            parent[name] = parent[parent[name]]  # path halving
            name = parent[name]
        return name

    for group in groups:
        for name in group:
            parent.setdefault(name, name)
        for name in group[1:]:
            parent[root(name)] = root(group[0])
    order = {n: i for i, g in enumerate(groups) for n in g}
    members: dict[str, list[str]] = {}
    for name in parent:
        members.setdefault(root(name), []).append(name)
    merged = sorted(members.values(), key=lambda m: max(order[n] for n in m))
    return [sorted(m, key=lambda n: (order[n], n)) for m in merged]


def compute_module_sizes(model: nn.Module, dtype: torch.dtype | str | None = None,
                         special_dtypes: Mapping[str, torch.dtype | str] | None = None) -> dict[str, int]:
    """Bytes of every module (``""`` = the whole model), parameters and buffers, ties once.

    Example:
        >>> import torch.nn as nn
        >>> compute_module_sizes(nn.Sequential(nn.Linear(2, 2), nn.ReLU()), dtype="float16")
        {'': 12, '0': 12, '1': 0}
    """
    return module_tree(model, dtype, special_dtypes).size_map()


def size_table(model: nn.Module | SizeTree, dtype: torch.dtype | str | None = None,
               special_dtypes: Mapping[str, torch.dtype | str] | None = None, *,
               max_depth: int | None = None) -> pd.DataFrame:
    """A table of modules: module, class, parameters, bytes, share, tied-to, depth.

    Example:
        >>> import torch.nn as nn
        >>> size_table(nn.Sequential(nn.Linear(2, 2)))["bytes"].tolist()
        [24, 24]
    """
    import pandas as pd

    tree = model if isinstance(model, SizeTree) else module_tree(model, dtype, special_dtypes)
    total = tree.total("") or 1
    rows = []
    for name, node in tree.nodes.items():
        if max_depth is not None and node.depth > max_depth:
            continue
        tied = sorted({tree.leader_of[t] for t in node.tensors if t in tree.leader_of})
        rows.append({"module": name or "<model>", "class": node.class_name, "parameters": node.n_params,
                     "bytes": node.total_bytes, "share": node.total_bytes / total,
                     "tied_to": ", ".join(tied), "depth": node.depth})
    return pd.DataFrame(rows, columns=["module", "class", "parameters", "bytes", "share", "tied_to", "depth"])
