"""Checkpoint names that differ from the model's: the conversions, planned before any data is read.

transformers 5 stores some weights under other names than its models use, and converts them
while loading: renamed modules (GPT-NeoX ``embed_out`` -> ``lm_head``, ViT's attention names,
Llava's prefixes) and mixture-of-experts weights stored one expert at a time but fused in the
model (Mixtral's ``experts.*.w1/w3`` -> ``experts.gate_up_proj``). `checkpoint_view` applies
transformers' own rules (`bigviz.checkpoint.hf.conversion_rules`) to the checkpoint's *keys*
and returns what the model will see: every model-side name with its dtype and shape, and a
`Conversion` (source keys, target names, operation) for each name that is not a checkpoint key
as it is. Fused shapes come from running the operation on ``meta`` tensors, so the whole plan
exists before a byte is read; `run_conversion` then does it for real.

A plain rename reads the checkpoint in place (a disk-offloaded renamed weight stays in the
original shard); a fused tensor is computed once (and, if it is offloaded, written once).

Example:
    >>> from bigviz.checkpoint.index import TensorInfo
    >>> import pathlib
    >>> entries = {"w": TensorInfo("w", "float32", (2,), 8, pathlib.Path("f"))}
    >>> view = checkpoint_view(entries, None)
    >>> list(view.entries), view.conversions
    (['w'], ())
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from bigviz.checkpoint.errors import CheckpointError
from bigviz.checkpoint.index import TensorInfo
from bigviz.core.dtypes import tensor_nbytes

__all__ = ["Conversion", "CheckpointView", "checkpoint_view", "run_conversion", "ConvertedWeights"]


@dataclass(frozen=True)
class Conversion:
    """Checkpoint key(s) -> model tensor(s), and the operation between them.

    Attributes:
        sources: checkpoint keys, in the order the operation takes them.
        targets: model tensor names it produces (as the checkpoint prefix has them).
        operation: ``"rename"``, or transformers' operations, e.g.
            ``"MergeModulelist(dim=0), Concatenate(dim=1)"``.
        shapes: the shape of each target.
        dtype: the targets' dtype before any cast (the sources').
    """

    sources: tuple[str, ...]
    targets: tuple[str, ...]
    operation: str
    shapes: tuple[tuple[int, ...], ...] = ()
    dtype: str = "float32"
    patterns: tuple[str, ...] = ()  # the rule's source pattern each source matched
    rule: Any = field(default=None, compare=False, repr=False)  # transformers' WeightConverter

    @property
    def is_rename(self) -> bool:
        """True when the target is a source under another name (read in place)."""
        return self.operation == "rename"

    def describe(self) -> str:
        """One line: ``targets <- sources (operation)``.

        Example:
            >>> Conversion(("embed_out.weight",), ("lm_head.weight",), "rename").describe()
            'lm_head.weight <- embed_out.weight (rename)'
        """
        src = self.sources[0] if len(self.sources) == 1 else f"{len(self.sources)} keys ({self.sources[0]}, ...)"
        return f"{', '.join(self.targets)} <- {src} ({self.operation})"


@dataclass(frozen=True)
class CheckpointView:
    """A checkpoint as the model will see it once converted.

    Attributes:
        entries: model-side name -> `TensorInfo` (a renamed key keeps its checkpoint
            ``TensorInfo.name``; a fused target has ``data_offsets=None`` and its own shape).
        conversions: every `Conversion`, in checkpoint order.
        source_of: model-side name -> the `Conversion` that makes it (absent: a key as it is).
        problems: conversions that could not be planned (their keys stay as they are).
    """

    entries: dict[str, TensorInfo]
    conversions: tuple[Conversion, ...] = ()
    source_of: dict[str, Conversion] = field(default_factory=dict)
    problems: tuple[str, ...] = ()

    def checkpoint_keys(self, name: str) -> tuple[str, ...]:
        """The checkpoint keys model-side ``name`` is read from."""
        conversion = self.source_of.get(name)
        return conversion.sources if conversion is not None else (name,)


def checkpoint_view(
    entries: Mapping[str, TensorInfo],
    rules: Sequence[Any] | None,
    *,
    model_names: Sequence[str] = (),
    base_model_prefix: str = "",
    model: Any = None,
) -> CheckpointView:
    """Apply transformers' conversion ``rules`` to checkpoint keys, as ``from_pretrained`` does.

    Keys are taken in transformers' order (``dot_natural_key``: expert 2 before expert 10);
    every renaming applies, then at most one converter. A key whose new name is not a model
    tensor while the key itself is keeps its name (transformers' own fallback); names are
    compared with and without the ``base_model_prefix``. No tensor data is read.

    Args:
        entries: the checkpoint's key -> `TensorInfo`.
        rules: transformers ``WeightRenaming``/``WeightConverter`` list (None: no conversion).
        model_names: every tensor name of the model (for the fallback).
        base_model_prefix: the model's ``base_model_prefix``.
        model: the model, passed to operations that read its config.
    """
    if not rules:
        return CheckpointView(dict(entries))
    from transformers.core_model_loading import WeightConverter, WeightRenaming, dot_natural_key, rename_source_key

    renamings = [r for r in rules if isinstance(r, WeightRenaming)]
    converters = [c for c in rules if isinstance(c, WeightConverter)]
    by_pattern = {p: c for c in converters for p in c.source_patterns}
    known = _known(set(model_names), base_model_prefix)
    view: dict[str, TensorInfo] = {}
    renames: list[Conversion] = []
    groups: dict[str, tuple[Any, dict[str, list[str]]]] = {}
    for key in sorted(entries, key=dot_natural_key):
        new, pattern = rename_source_key(key, renamings, converters)
        if not known(new) and known(key):
            new, pattern = key, None  # transformers' fallback: the key was right as it was
        if pattern is None:
            view[new] = entries[key]
            if new != key:
                renames.append(Conversion((key,), (new,), "rename", (entries[key].shape,), entries[key].dtype))
            continue
        group = groups.setdefault(new, (by_pattern[pattern], {}))
        group[1].setdefault(pattern, []).append(key)
    fused, problems = _plan_groups(groups, entries, model)
    source_of = {t: c for c in [*renames, *fused] for t in c.targets}
    for conversion in fused:
        file = entries[conversion.sources[0]].file
        for target, shape in zip(conversion.targets, conversion.shapes):
            numel = _numel(shape)
            view[target] = TensorInfo(target, conversion.dtype, shape, tensor_nbytes(conversion.dtype, numel), file)
    return CheckpointView(view, tuple(renames + fused), source_of, tuple(problems))


def _known(names: set[str], prefix: str) -> Callable[[str], bool]:
    def known(name: str) -> bool:
        if name in names:
            return True
        if prefix and f"{prefix}.{name}" in names:
            return True
        return bool(prefix) and name.startswith(prefix + ".") and name[len(prefix) + 1 :] in names

    return known


def _plan_groups(
    groups: Mapping[str, tuple[Any, dict[str, list[str]]]], entries: Mapping[str, TensorInfo], model: Any
) -> tuple[list[Conversion], list[str]]:
    """One `Conversion` per fused group, its targets and shapes found by running it on meta."""
    out, problems = [], []
    for first, (rule, sources) in groups.items():
        pairs = [(k, pattern) for pattern in rule.source_patterns for k in sources.get(pattern, [])]
        keys = tuple(k for k, _ in pairs)
        dtypes = {entries[k].dtype for k in keys}
        operation = ", ".join(repr(op) for op in rule.operations)
        try:
            result = _convert(rule, first, sources, lambda k: _meta(entries[k]), model)
        except Exception as exc:  # an operation that cannot run on meta: say so, load nothing from it
            problems.append(
                f"cannot plan the conversion of {len(keys)} checkpoint keys ({keys[0]}, ...) "
                f"into {first} ({operation}): {type(exc).__name__}: {exc}"
            )
            continue
        targets = tuple(result)
        shapes = tuple(tuple(result[t].shape) for t in targets)
        out.append(Conversion(keys, targets, operation, shapes, sorted(dtypes)[0], tuple(p for _, p in pairs), rule))
    return out, problems


def _convert(
    rule: Any, first: str, sources: Mapping[str, list[str]], read: Callable[[str], Tensor], model: Any
) -> dict[str, Tensor]:
    """Run a fresh copy of transformers' converter on tensors given by ``read`` (lazily)."""
    converter = copy.deepcopy(rule)
    for pattern, keys in sources.items():
        for key in keys:
            converter.add_tensor(first, key, pattern, lambda key=key: read(key))
    config = getattr(model, "config", None)
    result = converter.convert(first, model=model, config=config)
    return {name: value[0] if isinstance(value, list) else value for name, value in result.items()}


def run_conversion(conversion: Conversion, read: Callable[[str], Tensor], *, model: Any = None) -> dict[str, Tensor]:
    """Compute ``conversion``'s targets from its sources, each source given by ``read(key)``.

    Raises:
        CheckpointError: (a ``ValueError``) the operation failed; the message names the keys and the operation.
    """
    if conversion.is_rename:
        return {conversion.targets[0]: read(conversion.sources[0])}
    sources: dict[str, list[str]] = {}
    for key, pattern in zip(conversion.sources, conversion.patterns):
        sources.setdefault(pattern, []).append(key)
    try:
        return _convert(conversion.rule, conversion.targets[0], sources, read, model)
    except Exception as exc:
        raise CheckpointError(f"converting {conversion.describe()} failed: {type(exc).__name__}: {exc}") from exc


class ConvertedWeights(Mapping[str, Tensor]):
    """Fused tensors computed when looked up, one conversion at a time (the latest is kept).

    Sources are cast to the dtype of the conversion's first target before the operation, as
    ``from_pretrained`` casts each checkpoint tensor before converting; each result is then
    cast to its own target dtype. Used to write fused tensors once into an offload folder.

    Args:
        conversions: the fused conversions to serve.
        read: checkpoint key -> tensor (e.g. a `LazyWeights` over the checkpoint).
        dtypes: target name -> dtype.
        model: passed to operations that read the model's config.
    """

    def __init__(
        self,
        conversions: Sequence[Conversion],
        read: Callable[[str], Tensor],
        *,
        dtypes: Mapping[str, torch.dtype],
        model: Any = None,
    ) -> None:
        self._of = {t: c for c in conversions for t in c.targets if t in dtypes}
        self._read = read
        self._dtypes = dict(dtypes)
        self._model = model
        self._last: tuple[Conversion | None, dict[str, Tensor]] = (None, {})

    def __getitem__(self, name: str) -> Tensor:
        conversion = self._of[name]
        if self._last[0] is not conversion:
            self._last = (conversion, self.compute(conversion))
        return self._last[1][name]

    def compute(self, conversion: Conversion) -> dict[str, Tensor]:
        """Every target of ``conversion`` that this mapping serves, in its dtype."""
        packed = getattr(conversion.rule, "run_packed", None)
        if packed is not None:  # quantized parts (bigviz.checkpoint.quantized): built as stored, never cast
            return packed(conversion, self._read, self._dtypes, self._model)  # type: ignore[no-any-return]
        first = self._dtypes[next(t for t in conversion.targets if t in self._dtypes)]

        def read(key: str) -> Tensor:
            tensor = self._read(key)
            return tensor.to(first) if tensor.is_floating_point() else tensor

        result = run_conversion(conversion, read, model=self._model)
        return {
            t: v.to(self._dtypes[t]) if v.is_floating_point() else v for t, v in result.items() if t in self._dtypes
        }

    def __iter__(self) -> Iterator[str]:
        return iter(self._of)

    def __len__(self) -> int:
        return len(self._of)


def _meta(info: TensorInfo) -> Tensor:
    return torch.empty(info.shape, dtype=getattr(torch, info.dtype), device="meta")


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
