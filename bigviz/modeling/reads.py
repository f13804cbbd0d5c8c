"""Weights a module's code reads without calling the module that holds them.

DeBERTa's encoder reads ``self.rel_embeddings.weight``; ``nn.MultiheadAttention`` hands
``self.out_proj.weight`` to a functional kernel. A hook on the module holding the weight never
runs for such a read, so whatever streams offloaded weights in must fetch them with their
reader, and a device map meant for hooks that work per module (accelerate's, behind
``from_pretrained``) must not offload them. `direct_reads` finds them from bytecode, with no
forward run: ``forward`` and the methods it calls on ``self``.

Example:
    >>> import torch
    >>> direct_reads(torch.nn.Sequential(torch.nn.MultiheadAttention(4, 2)))
    {'0.out_proj': '0'}
"""

from __future__ import annotations

import dis
import functools
import inspect
import types
from collections.abc import Iterable

from torch import nn

from bigviz.core.names import join

__all__ = ["direct_reads", "reads_of"]


def direct_reads(model: nn.Module) -> dict[str, str]:
    """Modules whose tensors are read by an ancestor's code without calling them.

    DeBERTa's encoder reads ``self.rel_embeddings.weight``; ``nn.MultiheadAttention`` reads
    ``self.out_proj.weight``. Their offloaded weights must be fetched when that ancestor runs.
    Found from the bytecode of ``forward`` and the methods it calls, for each module's class:
    ``self.a.b.weight`` where ``a.b`` is a submodule and ``weight`` one of its tensors (reading
    only ``.dtype`` or ``.shape`` does not count). Returns module name -> reader.

    Example:
        >>> import torch
        >>> mha = torch.nn.Sequential(torch.nn.MultiheadAttention(4, 2))
        >>> direct_reads(mha)
        {'0.out_proj': '0'}
    """
    return reads_of(model.named_modules())


def reads_of(modules: Iterable[tuple[str, nn.Module]]) -> dict[str, str]:
    """`direct_reads` over ``(name, module)`` pairs already walked (a model inventory's).

    Example:
        >>> import torch
        >>> mha = torch.nn.Sequential(torch.nn.MultiheadAttention(4, 2))
        >>> reads_of(mha.named_modules())
        {'0.out_proj': '0'}
    """
    out: dict[str, str] = {}
    seen: set[int] = set()
    for name, module in modules:
        if id(module) in seen:  # a shared module: its first name, as named_modules() gives it
            continue
        seen.add(id(module))
        for chain in _self_chains(type(module)):
            target, path = module, []
            for part in chain:  # down the submodules, then the first tensor name
                child = target._modules.get(part)
                if child is None:
                    if path and (part in target._parameters or part in target._buffers):
                        out.setdefault(join(name, ".".join(path)), name)
                    break
                target, path = child, [*path, part]
    return out


# reading these of a tensor needs no data: ``self.lm_head.weight.dtype`` is not a read
_METADATA = frozenset(
    {
        "dtype",
        "device",
        "shape",
        "ndim",
        "is_meta",
        "requires_grad",
        "is_cuda",
        "dim",
        "size",
        "numel",
        "element_size",
        "is_floating_point",
    }
)


@functools.cache
def _self_chains(cls: type) -> frozenset[tuple[str, ...]]:
    """Attribute chains loaded from ``self`` at forward time, from bytecode: in ``forward`` and
    the methods it calls on ``self``, transitively (``self.a.b.weight.t()`` gives ``("a", "b",
    "weight", "t")``). ``__init__`` or a tie (``self.head.weight = self.emb.weight``) is not
    forward time; a chain ending in metadata (``.dtype``, ``.shape``) reads no data."""
    chains: set[tuple[str, ...]] = set()
    seen: set[str] = set()
    todo = ["forward"]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        for code in _codes(inspect.getattr_static(cls, name, None)):
            for chain in _code_chains(code):
                chains.add(chain)
                if _is_method(inspect.getattr_static(cls, chain[0], None)):
                    todo.append(chain[0])  # a method of this class, called (or read) from forward
    return frozenset(c for c in chains if len(c) >= 2 and not (len(c) >= 3 and c[-1] in _METADATA))


def _is_method(value: object) -> bool:
    return isinstance(value, (types.FunctionType, staticmethod, classmethod, property)) or (
        callable(value) and hasattr(value, "__wrapped__")
    )


def _codes(value: object) -> list[types.CodeType]:
    """The code objects of a class attribute (methods, properties, static/class methods,
    through decorators that keep ``__wrapped__``) and of the functions nested in them."""
    if value is None:
        return []
    funcs = [getattr(value, "__func__", value)]
    if isinstance(value, property):
        funcs = [f for f in (value.fget, value.fset) if f is not None]
    out: list[types.CodeType] = []
    for func in funcs:
        code = getattr(inspect.unwrap(func), "__code__", None) if callable(func) else None
        stack = [code] if isinstance(code, types.CodeType) else []
        while stack:
            code = stack.pop()
            out.append(code)
            stack.extend(c for c in code.co_consts if isinstance(c, types.CodeType))
    return out


@functools.cache
def _code_chains(code: types.CodeType) -> tuple[tuple[str, ...], ...]:
    chains, current = [], None
    for ins in dis.get_instructions(code):
        if ins.opname in ("LOAD_ATTR", "LOAD_METHOD") and current is not None:
            current.append(ins.argval)
            continue
        if current:
            chains.append(tuple(current))
        last = ins.argval[-1] if isinstance(ins.argval, tuple) and ins.argval else ins.argval
        current = [] if ins.opname.startswith("LOAD_FAST") and last == "self" else None
    if current:
        chains.append(tuple(current))
    return tuple(chains)
