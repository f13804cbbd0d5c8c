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

from bigviz.core.tree import SizeTree
from bigviz.modeling.inventory import ModelInventory

if TYPE_CHECKING:
    import pandas as pd

__all__ = ["module_tree", "compute_module_sizes", "size_table", "find_tied_parameters"]

ModelOrInventory = nn.Module | ModelInventory


def find_tied_parameters(model: ModelOrInventory) -> list[list[str]]:
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


def module_tree(
    model: ModelOrInventory,
    dtype: torch.dtype | str | None = None,
    special_dtypes: Mapping[str, torch.dtype | str] | None = None,
) -> SizeTree:
    """The model's :class:`SizeTree`, optionally re-sized to ``dtype`` (floating tensors only;
    ``special_dtypes`` maps module or tensor names to a dtype that wins for them).

    Example:
        >>> import torch.nn as nn
        >>> module_tree(nn.Linear(4, 2), dtype="float16").total("")
        20
    """
    return ModelInventory.of(model).tree(dtype, special_dtypes)


def compute_module_sizes(
    model: ModelOrInventory,
    dtype: torch.dtype | str | None = None,
    special_dtypes: Mapping[str, torch.dtype | str] | None = None,
) -> dict[str, int]:
    """Bytes of every module (``""`` = the whole model), parameters and buffers, ties once.

    Example:
        >>> import torch.nn as nn
        >>> compute_module_sizes(nn.Sequential(nn.Linear(2, 2), nn.ReLU()), dtype="float16")
        {'': 12, '0': 12, '1': 0}
    """
    return module_tree(model, dtype, special_dtypes).size_map()


def size_table(
    model: ModelOrInventory | SizeTree,
    dtype: torch.dtype | str | None = None,
    special_dtypes: Mapping[str, torch.dtype | str] | None = None,
    *,
    max_depth: int | None = None,
) -> pd.DataFrame:
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
        rows.append(
            {
                "module": name or "<model>",
                "class": node.class_name,
                "parameters": node.n_params,
                "bytes": node.total_bytes,
                "share": node.total_bytes / total,
                "tied_to": ", ".join(tied),
                "depth": node.depth,
            }
        )
    return pd.DataFrame(rows, columns=["module", "class", "parameters", "bytes", "share", "tied_to", "depth"])
