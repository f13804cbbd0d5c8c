"""One helper per tree rule: how dotted module and tensor names relate.

Every layer of bigviz asks the same questions of names ("is ``h.1`` a prefix of
``h.10.attn``?", "which device-map key owns ``transformer.h.3.mlp.weight``?"), so the
answers live here, once, and are used everywhere.

Example:
    >>> is_prefix("h.1", "h.10.attn")
    False
    >>> owner("transformer.h.3.mlp.weight", {"transformer.h": 0, "": "cpu"})
    'transformer.h'
"""

from __future__ import annotations

from collections.abc import Container, Iterable, Iterator, Mapping
from typing import TypeVar

V = TypeVar("V")

__all__ = [
    "is_prefix",
    "parent",
    "ancestors",
    "join",
    "owner",
    "under_any",
    "leaf",
    "natural_order",
    "is_embedding_name",
    "execution_order",
]


def is_prefix(prefix: str, name: str) -> bool:
    """True if module ``prefix`` is ``name`` or contains it, on dot boundaries.

    ``""`` (the whole model) is a prefix of every name.

    Example:
        >>> is_prefix("h.1", "h.1.attn"), is_prefix("h.1", "h.10"), is_prefix("", "x")
        (True, False, True)
    """
    if prefix == "":
        return True
    return name == prefix or name.startswith(prefix + ".")


def parent(name: str) -> str:
    """The enclosing module's name (``""`` for top-level names).

    Example:
        >>> parent("transformer.h.0"), parent("lm_head"), parent("")
        ('transformer.h', '', '')
    """
    return name.rpartition(".")[0]


def leaf(name: str) -> str:
    """The last component of a dotted name.

    Example:
        >>> leaf("transformer.h.0.attn")
        'attn'
    """
    return name.rpartition(".")[2]


def ancestors(name: str) -> Iterator[str]:
    """``name`` and every enclosing module, innermost first, ending with ``""``.

    Example:
        >>> list(ancestors("a.b.c"))
        ['a.b.c', 'a.b', 'a', '']
    """
    while name:
        yield name
        name = parent(name)
    yield ""


def join(prefix: str, name: str) -> str:
    """Join two dotted names, either of which may be empty.

    Example:
        >>> join("", "wte"), join("transformer", "wte")
        ('wte', 'transformer.wte')
    """
    if not prefix:
        return name
    if not name:
        return prefix
    return f"{prefix}.{name}"


def owner(name: str, mapping: Mapping[str, V] | Iterable[str]) -> str | None:
    """The longest key of ``mapping`` that is a dot-boundary prefix of ``name``.

    Runs in O(depth of ``name``) dictionary look-ups, not O(len(mapping)).

    Example:
        >>> owner("h.10.attn.w", {"h.1": 0, "h.10": 1})
        'h.10'
        >>> owner("x.y", {"a": 0}) is None
        True
    """
    keys = mapping if isinstance(mapping, (Mapping, set, frozenset)) else set(mapping)
    for candidate in ancestors(name):
        if candidate in keys:
            return candidate
    return None


def under_any(name: str, keys: Container[str]) -> bool:
    """True if a module strictly containing ``name`` is one of ``keys`` (a loop over its
    ancestors, for the hot paths that ask it of every key of a map).

    Example:
        >>> under_any("h.10.attn", {"h.1"}), under_any("h.1.attn", {"h.1"}), under_any("", {""})
        (False, True, False)
    """
    while name:
        name = parent(name)
        if name in keys:
            return True
    return False


def natural_order(names: Iterable[str]) -> list[str]:
    """``names`` in first-appearance order, numbered siblings sorted by number.

    Example:
        >>> natural_order(["h.10.w", "h.2.w", "wte", "h.2.b"])
        ['h.2.w', 'h.2.b', 'h.10.w', 'wte']
    """
    names = list(names)
    rank: dict[tuple[str, str], int] = {}
    for name in names:
        parts = name.split(".")
        for i, part in enumerate(parts):
            where = ".".join(parts[:i])
            rank.setdefault((where, "#" if part.isdigit() else part), len(rank))

    def key(name: str) -> tuple[tuple[int, int], ...]:
        parts = name.split(".")
        out = []
        for i, part in enumerate(parts):
            where = ".".join(parts[:i])
            number = part.isdigit()
            out.append((rank[(where, "#" if number else part)], int(part) if number else 0))
        return tuple(out)

    return sorted(names, key=key)


def is_embedding_name(module: str) -> bool:
    """True if a module's last name reads as an embedding (``embed_tokens``, ``wte``, ``wpe``,
    ``embeddings``, ``layernorm_embedding``): the only sign of one a checkpoint's keys carry.

    Example:
        >>> is_embedding_name("model.embed_tokens"), is_embedding_name("transformer.wpe"), is_embedding_name("lm_head")
        (True, True, False)
    """
    name = leaf(module).lower()
    return "emb" in name or name in ("wte", "wpe")


def execution_order(names: Iterable[str], blocks: str) -> list[str]:
    """``names`` in the order transformers models run them around one list of blocks
    (``blocks``, e.g. ``"model.layers"``): on the path down to the blocks, a sibling named
    as an embedding comes before (``model.embed_tokens``), any other after (``model.norm``,
    ``lm_head``); the rest keep their order (the blocks' own, by number).

    A checkpoint's keys hold no definition order, and sorted keys put ``lm_head`` before
    ``model.*`` and ``transformer.h.*`` before ``transformer.wte``; every transformers model
    with one stack of layers embeds before it and normalises and projects after it.

    Example:
        >>> execution_order(["lm_head.w", "model.embed_tokens.w", "model.layers.0.w", "model.norm.w"], "model.layers")
        ['model.embed_tokens.w', 'model.layers.0.w', 'model.norm.w', 'lm_head.w']
        >>> execution_order(["transformer.h.0.w", "transformer.ln_f.w", "transformer.wte.w"], "transformer.h")
        ['transformer.wte.w', 'transformer.h.0.w', 'transformer.ln_f.w']
    """
    path = blocks.split(".") if blocks else []

    def key(name: str) -> tuple[int, ...]:
        parts = name.split(".")
        out = []
        for depth, step in enumerate(path):
            if depth < len(parts) - 1 and parts[depth] == step:
                out.append(1)  # on the way to the blocks
                continue
            out.append(0 if is_embedding_name(".".join(parts[: depth + 1])) else 2)
            break
        return tuple(out)

    return sorted(names, key=key)  # stable: the blocks and each side keep their order
