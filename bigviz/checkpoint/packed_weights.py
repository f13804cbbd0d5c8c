"""Packed (quantized) weights in files: read lazily as the packed weights they are, and written
once as the plain tensors they are made of.

A store (``Mapping[str, Tensor]``, what the engine streams offloaded weights from) over files
holding quantized weights hands out each weight *packed*: a torchao ``Int8Tensor`` or a
bitsandbytes ``Params4bit`` whose parts are zero-copy views of the memory-mapped files, or,
for a format no CPU kernel runs (FP8 with block scales), the weight dequantized when it is
fetched. :class:`PackedWeights` does that over any store of plain tensors, from one
:class:`Recipe` per weight (which keys hold its parts, and how the parts make the weight).
Its :meth:`PackedWeights.packed` gives the parts without building the weight, so whatever
moves bytes (the resident copy, the ring of streamed bytes, a copy to a GPU) moves the packed
bytes and builds the weight where it will run.

:func:`flatten` turns packed weights in memory into plain parts to write (an offload folder is
written once, packed), with the recipes to read them back.

Example:
    >>> import torch
    >>> base = {"w:a": torch.ones(2), "w:b": torch.full((2,), 2.0)}
    >>> recipe = Recipe({"a": "w:a", "b": "w:b"}, lambda p: p["a"] + p["b"], "sum", 16)
    >>> store = PackedWeights(base, {"w": recipe})
    >>> store["w"].tolist(), store.stored_nbytes("w"), sorted(store.packed("w").parts)
    ([3.0, 3.0], 16, ['a', 'b'])
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass

from torch import Tensor

from bigviz.core.names import natural_order
from bigviz.modeling.packed import Packed, split

__all__ = ["Recipe", "PackedWeights", "flatten", "PART_SEP"]

PART_SEP = ":"
"""Between a weight's name and a part's in files bigviz writes (``h.0.attn.weight:qdata``)."""


@dataclass(frozen=True)
class Recipe:
    """How one packed weight is read: its parts' keys in the store below, and the build.

    Attributes:
        keys: part name -> key of the store it is read from.
        build: parts (by part name) -> the weight.
        kind: the format, for people (``"torchao Int8Tensor"``, ``"fp8 blocks, dequantized"``).
        nbytes: bytes of the parts (what is stored, read and streamed).
    """

    keys: dict[str, str]
    build: Callable[[Mapping[str, Tensor]], Tensor]
    kind: str
    nbytes: int


class PackedWeights(Mapping[str, Tensor]):
    """A store of packed weights over a store of their plain parts.

    Args:
        base: the plain parts (a `LazyWeights` over files, or any mapping).
        recipes: weight name -> its :class:`Recipe`. Names without one are the base's own.

    ``prefetch``, ``verify`` and ``close`` go to the base, with each weight's part keys.
    """

    def __init__(self, base: Mapping[str, Tensor], recipes: Mapping[str, Recipe]) -> None:
        self.base = base
        self.recipes = dict(recipes)
        parts = {key for r in self.recipes.values() for key in r.keys.values()}
        self._plain = [k for k in base if k not in parts and k not in self.recipes]

    def __getitem__(self, name: str) -> Tensor:
        recipe = self.recipes.get(name)
        if recipe is None:
            if name not in self._plain_set:
                raise KeyError(name)
            return self.base[name]
        return recipe.build({part: self.base[key] for part, key in recipe.keys.items()})

    @property
    def _plain_set(self) -> set[str]:
        found: set[str] | None = self.__dict__.get("_plain_names")
        if found is None:
            found = self.__dict__["_plain_names"] = set(self._plain)
        return found

    def __iter__(self) -> Iterator[str]:
        yield from self.recipes
        yield from self._plain

    def __len__(self) -> int:
        return len(self.recipes) + len(self._plain)

    def __contains__(self, name: object) -> bool:
        return name in self.recipes or name in self._plain_set

    def packed(self, name: str) -> Packed | None:
        """``name``'s parts as the base holds them (views of mapped files: nothing read) and
        its build; None for a plain tensor."""
        recipe = self.recipes.get(name)
        if recipe is None:
            return None
        return Packed({part: self.base[key] for part, key in recipe.keys.items()}, recipe.build, recipe.kind)

    def stored_nbytes(self, name: str) -> int | None:
        """Bytes of a packed weight's parts (None: a plain tensor, sized as the model has it)."""
        recipe = self.recipes.get(name)
        return recipe.nbytes if recipe is not None else None

    def _keys(self, names: Iterable[str]) -> list[str]:
        out: list[str] = []
        for name in names:
            recipe = self.recipes.get(name)
            out += list(recipe.keys.values()) if recipe is not None else [name]
        return out

    def prefetch(self, names: Iterable[str]) -> None:
        """Page-cache hints for the parts of ``names`` (when the base takes them)."""
        hint = getattr(self.base, "prefetch", None)
        if hint is not None:
            hint(self._keys(names))

    def verify(self, names: Iterable[str] | None = None) -> None:
        """Check the files behind ``names`` are unchanged (when the base can)."""
        check = getattr(self.base, "verify", None)
        if check is not None:
            check(None if names is None else self._keys(names))

    def close(self) -> None:
        """Close the base (tensors handed out stay valid)."""
        close = getattr(self.base, "close", None)
        if close is not None:
            close()

    def __enter__(self) -> PackedWeights:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"PackedWeights({len(self.recipes)} packed, {len(self._plain)} plain, over {type(self.base).__name__})"


def flatten(tensors: Mapping[str, Tensor]) -> tuple[dict[str, Tensor], dict[str, Recipe]]:
    """Packed weights of ``tensors`` as their plain parts (``name:part``), to be written, and
    the recipes that read them back (the same format, its context kept from the weights in
    memory); plain tensors pass as they are.

    Each value is looked up once (a mapping that quantizes on lookup quantizes once).

    Example:
        >>> import torch
        >>> flat, recipes = flatten({"b": torch.zeros(1)})
        >>> list(flat), recipes
        (['b'], {})
    """
    flat: dict[str, Tensor] = {}
    recipes: dict[str, Recipe] = {}
    for name in natural_order(tensors):  # a module's tensors side by side in the files: one read each
        value = tensors[name]
        packed = split(value)
        if packed is None:
            flat[name] = value
            continue
        keys = {part: f"{name}{PART_SEP}{part}" for part in packed.parts}
        flat.update({keys[part]: t.contiguous() for part, t in packed.parts.items()})
        recipes[name] = Recipe(keys, packed.build, packed.kind, packed.nbytes)
    return flat, recipes
