"""No-split rules: which modules are placed whole, and which no-split entries match nothing.

A no-split entry is a class name (``"GPT2Block"``, from ``_no_split_modules``) or a glob of
module names (``"transformer.h.*"``, what a checkpoint's repeated blocks give); a module
holding a parametrized weight (weight norm's ``g`` and ``v``) is no-split too, as its weight
is computed from its parts. The planner, the unit rule and the pipeline cutter all ask
:func:`is_no_split`.

Example:
    >>> from bigviz.core.tree import SizeTree, TensorSpec
    >>> tree = SizeTree.build([TensorSpec("h.0.w", 4, "float32")], {"": "Net", "h": "ModuleList", "h.0": "Block"})
    >>> is_no_split(tree, "h.0", frozenset({"Block"})), is_no_split(tree, "h.0", frozenset({"h.*"}))
    (True, True)
"""

from __future__ import annotations

import difflib
import fnmatch
from collections.abc import Collection

from bigviz.core.errors import PlanError
from bigviz.core.names import join
from bigviz.core.tree import SizeTree

__all__ = ["is_no_split", "is_glob", "no_split_problems", "check_no_split"]


def is_no_split(tree: SizeTree, name: str, patterns: frozenset[str]) -> bool:
    """True if module ``name`` is placed whole: its class or name matches a no-split pattern,
    or it holds a parametrized weight.

    Example:
        >>> from bigviz.core.tree import TensorSpec
        >>> t = SizeTree.build([TensorSpec("conv.parametrizations.weight.original0", 4, "float32")])
        >>> is_no_split(t, "conv", frozenset()), is_no_split(t, "", frozenset({"[0-9]*"}))
        (True, False)
    """
    node = tree.nodes[name]
    if join(name, "parametrizations") in node.children:
        return True  # torch's parametrize: the weight is computed from its parts (weight norm's g, v)
    for pattern in patterns:
        if is_glob(pattern):
            if fnmatch.fnmatchcase(name, pattern):
                return True
        elif node.class_name == pattern:
            return True
    return False


def is_glob(pattern: str) -> bool:
    """A no-split entry is a module-name glob if it has glob or dot characters, else a class."""
    return any(c in pattern for c in "*?[.")


def no_split_problems(tree: SizeTree, patterns: Collection[str]) -> list[str]:
    """Every no-split entry that matches nothing in ``tree`` (a typo would otherwise split
    every block silently), with the model's class names or an example pattern.

    Example:
        >>> from bigviz.core.tree import SizeTree, TensorSpec
        >>> tree = SizeTree.build([TensorSpec("h.0.w", 4, "float32")],
        ...                       {"": "Net", "h": "ModuleList", "h.0": "Block"})
        >>> no_split_problems(tree, ["Block", "h.*"]), no_split_problems(tree, ["Blok"])
        ([], ["no-split class 'Blok' is not a class of this model (did you mean 'Block'?); its classes: Block, ModuleList, Net"])
    """
    classes = sorted({n.class_name for n in tree.nodes.values() if n.class_name})
    problems = []
    for pattern in patterns:
        if not isinstance(pattern, str):
            problems.append(f"no-split entry {pattern!r} is not a string: give class names or module-name globs")
        elif is_glob(pattern):
            if not any(fnmatch.fnmatchcase(name, pattern) for name in tree.nodes):
                problems.append(f"no-split pattern {pattern!r} matches no module name{_example_glob(tree)}")
        elif pattern not in classes:
            problems.append(_unknown_class(tree, pattern, classes))
    return problems


def _unknown_class(tree: SizeTree, pattern: str, classes: list[str]) -> str:
    if not classes:
        return (
            f"no-split class {pattern!r}: this model has no class names (a tree read from "
            f"checkpoint headers carries none); give module-name patterns{_example_glob(tree)}"
        )
    close = difflib.get_close_matches(pattern, classes, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    shown = ", ".join(classes[:40]) + (f", ... ({len(classes)} in all)" if len(classes) > 40 else "")
    return f"no-split class {pattern!r} is not a class of this model{hint}; its classes: {shown}"


def _example_glob(tree: SizeTree) -> str:
    """`` (e.g. 'transformer.h.*')`` from the first numbered module, or nothing."""
    for name in tree.nodes:
        head, _, last = name.rpartition(".")
        if last.isdigit():
            return f" (e.g. {(head + '.*') if head else '[0-9]*'!r})"
    return ""


def check_no_split(tree: SizeTree, patterns: Collection[str]) -> None:
    """Raise `PlanError` listing every no-split entry that matches nothing (see
    `no_split_problems`).

    Example:
        >>> from bigviz.core.tree import SizeTree, TensorSpec
        >>> check_no_split(SizeTree.build([TensorSpec("h.0.w", 4, "float32")]), ["h.*"])  # matches
    """
    PlanError.check(no_split_problems(tree, patterns), "cannot plan")
