"""The pieces every stored quantized format shares: a :class:`PackedRule` (one weight built
from its parts by the format's own library), a format's groups and the sentences that name a
part missing or of the wrong size, with where it is and the fix.

:mod:`bigviz.checkpoint.stored_formats` holds the formats (and bitsandbytes' in
:mod:`bigviz.checkpoint.stored_bnb`); each uses these, so a damaged checkpoint reads the same
whatever its format.

Example:
    >>> ceil_div(10, 4), numel((2, 3, 4))
    (3, 24)
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from bigviz.checkpoint.convert import Conversion
from bigviz.checkpoint.index import TensorInfo

__all__ = [
    "Builder",
    "PackedRule",
    "Group",
    "Layout",
    "DAMAGED",
    "at",
    "part_problem",
    "missing_part",
    "ceil_div",
    "numel",
]


Builder = Callable[[Mapping[str, Tensor], "torch.dtype | None"], Tensor]


@dataclass(frozen=True)
class PackedRule:
    """The operation of a conversion whose sources are one weight's parts (a stored format)
    or one float weight (quantized while loading); what
    :class:`~bigviz.checkpoint.convert.ConvertedWeights` runs instead of transformers' ops.

    Attributes:
        roles: the part each source key is, in the conversion's order.
        build: parts (by role) and the dtype the model computes in -> the weight.
        kind: the format, for people.
        in_place: on ``"disk"``, read from the checkpoint's files at each fetch (a stored
            format), else written once, packed, to the offload folder (quantized while loading).
        stores_packed: the weight lives packed in memory (False: dequantized, FP8).
    """

    roles: tuple[str, ...]
    build: Builder
    kind: str
    in_place: bool = True
    stores_packed: bool = True

    @property
    def source_patterns(self) -> tuple[str, ...]:
        return self.roles

    @property
    def operations(self) -> tuple[str, ...]:
        return (self.kind,)

    def run_packed(
        self, conversion: Conversion, read: Callable[[str], Tensor], dtypes: Mapping[str, torch.dtype], model: Any
    ) -> dict[str, Tensor]:
        """The conversion's one target from its sources read by ``read`` (no cast on the way:
        scales stay float32, packed bytes stay bytes)."""
        target = conversion.targets[0]
        parts = {role: read(key) for role, key in zip(self.roles, conversion.sources)}
        return {target: self.build(parts, dtypes.get(target))}


Group = tuple[dict[str, str], PackedRule, tuple[int, ...], str]
Layout = tuple[dict[str, Group], list[str]]
"""The groups, and every part that is missing or disagrees with its weight (one sentence each)."""


DAMAGED = (
    "the checkpoint is damaged or was not written for this format: copy its files again, or save it "
    "again from the original model with transformers' save_pretrained"
)


def at(info: TensorInfo) -> str:
    return f"{info.name} (in {info.file.name})"


def part_problem(info: TensorInfo, expected: str) -> str:
    """A part of the wrong shape or dtype: where it is, what was expected and found, the fix."""
    return f"{at(info)}: expected {expected}, found {list(info.shape)} {info.dtype}; {DAMAGED}"


def missing_part(weight: TensorInfo, fmt: str, key: str, expected: str) -> str:
    return (
        f"{at(weight)} is stored as {fmt} but {key} is missing (expected {expected}, found none): the "
        f"weight cannot be read without it; {DAMAGED}"
    )


def ceil_div(n: int, d: int) -> int:
    return -(-n // d)


def numel(shape: Collection[int]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n
