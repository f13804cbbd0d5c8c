"""Read and write the safetensors format directly: headers only, and streaming writes.

A safetensors file is an 8-byte little-endian header length ``N``, ``N`` bytes of JSON
(``{name: {"dtype": "F32", "shape": [...], "data_offsets": [begin, end]}, "__metadata__":
{...}}``, offsets relative to the end of the header), then the tensor bytes back to back.
Reading a header costs two small reads, so a whole sharded checkpoint can be listed and
checked without touching tensor data. Writing streams each tensor's bytes straight from its
memory to the file (no serialised copy of the shard in RAM), in the layout the
``safetensors`` library itself writes (header padded to 8 bytes, widest dtypes first so every
tensor is aligned, no gaps), so files read back with ``safetensors``, transformers and mmap.

Example:
    >>> import tempfile, torch, pathlib
    >>> path = pathlib.Path(tempfile.mkdtemp()) / "w.safetensors"
    >>> write_safetensors(path, {"w": torch.ones(2, 3)}, metadata={"format": "pt"})
    >>> header = read_header(path)
    >>> header.tensors["w"].shape, header.metadata
    ((2, 3), {'format': 'pt'})
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from bigviz.checkpoint.errors import raise_problems
from bigviz.core.dtypes import SAFETENSORS_CODES, tensor_nbytes, to_safetensors
from bigviz.core.serialize import parse_json
from bigviz.core.errors import ArgumentTypeError

if TYPE_CHECKING:
    import torch

__all__ = ["HeaderEntry", "Header", "read_header", "check_header", "write_safetensors", "file_stamp"]

_MAX_HEADER = 100_000_000  # the safetensors library refuses larger headers too
_FIX = "the file is truncated or corrupt: re-download it or save it again"


@dataclass(frozen=True)
class HeaderEntry:
    """One tensor of a safetensors header; ``begin``/``end`` are absolute file offsets."""

    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


@dataclass(frozen=True)
class Header:
    """A parsed, validated safetensors header."""

    tensors: dict[str, HeaderEntry]
    metadata: dict[str, str]
    size: int  # file size in bytes
    stamp: tuple[int, ...] | None = None  # the file as it was read (see `file_stamp`)


def file_stamp(st: os.stat_result) -> tuple[int, ...]:
    """What identifies a file's content cheaply: device, inode, size, modification time.

    A file truncated or rewritten in place keeps its inode but changes size or mtime: reading
    a memory map of it then could give wrong bytes or a SIGBUS, so readers compare stamps first.

    Example:
        >>> len(file_stamp(os.stat(__file__)))
        4
    """
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def read_header(path: Path) -> Header:
    """Read and validate the header of one safetensors file; raise on any problem.

    Raises:
        CheckpointError: listing every problem found in the file.

    Example:
        >>> read_header(Path("missing.safetensors"))  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        bigviz.checkpoint.errors.CheckpointError: cannot read 'missing.safetensors' (1 problem):...
    """
    header, problems = check_header(path)
    raise_problems(problems, f"cannot read '{path}'", fix=_FIX if problems else "")
    assert header is not None
    return header


def check_header(path: Path) -> tuple[Header | None, list[str]]:
    """Parse ``path``'s header and return it with every problem found (header None if fatal)."""
    try:
        with open(path, "rb") as f:
            stamp = file_stamp(os.fstat(f.fileno()))
            size = f.seek(0, 2)
            f.seek(0)
            prefix = f.read(8)
            if len(prefix) < 8:
                return None, [f"{path}: {size} bytes is too small for a safetensors file"]
            (length,) = struct.unpack("<Q", prefix)
            if length > _MAX_HEADER or 8 + length > size:
                return None, [f"{path}: header length {length} is beyond the file end ({size} bytes)"]
            raw = f.read(length)
    except OSError as err:
        return None, [f"{path}: cannot open ({err.strerror or err})"]
    try:
        doc = parse_json(raw, f"{path}: header", "safetensors")  # deep nesting too: no RecursionError
    except ValueError as err:
        return None, [str(err)]
    if not isinstance(doc, dict):
        return None, [f"{path}: header is JSON but not an object"]
    header, problems = _parse_doc(path, doc, data_start=8 + length, size=size)
    return replace(header, stamp=stamp), problems


def _parse_doc(path: Path, doc: dict, *, data_start: int, size: int) -> tuple[Header, list[str]]:
    problems: list[str] = []
    metadata = doc.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        problems.append(f"{path}: __metadata__ must map strings to strings")
        metadata = {}
    tensors: dict[str, HeaderEntry] = {}
    for name, raw in doc.items():
        entry = _parse_entry(raw, data_start)
        if isinstance(entry, str):
            problems.append(f"{path}: tensor {name!r} {entry}")
        elif entry.end > size:
            problems.append(
                f"{path}: tensor {name!r} data ends at byte {entry.end}, beyond the file end ({size} bytes)"
            )
        else:
            tensors[name] = entry
    problems += _overlaps(path, tensors)
    return Header(tensors, dict(metadata), size), problems


def _parse_entry(raw: object, data_start: int) -> HeaderEntry | str:
    """A header entry, or a string saying what is wrong with it."""
    if not isinstance(raw, dict):
        return "has no dtype/shape/data_offsets record"
    code, shape, offsets = raw.get("dtype"), raw.get("shape"), raw.get("data_offsets")
    if not isinstance(code, str) or code not in SAFETENSORS_CODES:
        return f"has unknown dtype {_short(code)}"
    if not isinstance(shape, list) or not all(_is_count(d) for d in shape):
        return f"has invalid shape {_short(shape)}"
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(_is_count(o) for o in offsets)
        or not offsets[0] <= offsets[1]
    ):
        return f"has invalid data_offsets {_short(offsets)}"
    numel = 1
    for d in shape:
        numel *= d
    needed = tensor_nbytes(code, numel)  # sub-byte dtypes (F4, I4) are packed
    if offsets[1] - offsets[0] != needed:
        return f"holds {offsets[1] - offsets[0]} bytes but {code}{shape} needs {needed}"
    return HeaderEntry(SAFETENSORS_CODES[code].name, tuple(shape), data_start + offsets[0], data_start + offsets[1])


def _is_count(value: object) -> bool:
    """A JSON integer >= 0; ``true`` is not one, though Python's ``bool`` is an ``int``."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _short(value: object) -> str:
    try:
        text = repr(value)
    except RecursionError:  # JSON nested just below the parser's limit
        return "(a deeply nested value)"
    return text if len(text) <= 80 else text[:77] + "..."


def _overlaps(path: Path, tensors: Mapping[str, HeaderEntry]) -> list[str]:
    spans = sorted((e.begin, e.end, n) for n, e in tensors.items() if e.end > e.begin)
    problems = []
    for (_, end_a, a), (begin_b, _, b) in zip(spans, spans[1:]):
        if begin_b < end_a:
            problems.append(f"{path}: tensors {a!r} and {b!r} overlap (bytes {begin_b}..{end_a})")
    return problems


def write_safetensors(
    path: Path,
    tensors: Mapping[str, torch.Tensor],
    *,
    metadata: Mapping[str, str] | None = None,
    on_bytes: Callable[[int], object] | None = None,
    align: int = 8,
) -> None:
    """Write ``tensors`` to ``path`` as safetensors, streaming each tensor's bytes.

    Tensors may live on any device and be non-contiguous; each is copied to a contiguous CPU
    tensor only when it is not one already, one at a time.

    Args:
        path: the file to write (overwritten).
        tensors: name -> tensor; names keep their order within a dtype width.
        metadata: string -> string pairs stored as ``__metadata__``.
        on_bytes: called with the byte count after each tensor is written (progress bars).
        align: the data starts at a multiple of this (a power of two >= 8) in the file, and
            tensors whose size is a multiple of it come first, so each starts aligned too
            (a memory-mapped file is page aligned). Some CPU kernels give other low bits on
            memory that is not 16-byte aligned (``grouped_mm`` for mixture-of-experts).
    """
    order = sorted(tensors, key=lambda n: (_nbytes(tensors[n]) % align != 0, -tensors[n].element_size()))
    doc: dict[str, object] = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    for name in order:
        t = tensors[name]
        nbytes = t.numel() * t.element_size()
        code = _code(t.dtype)
        if code is None:
            raise ArgumentTypeError(f"tensor {name!r}: dtype {t.dtype} has no safetensors code")
        doc[name] = {"dtype": code, "shape": list(t.shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(doc, separators=(",", ":")).encode()
    raw += b" " * (-(len(raw) + 8) % align)  # pad so the data (after the 8-byte length) is aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for name in order:
            f.write(_tensor_bytes(tensors[name]))
            if on_bytes is not None:
                on_bytes(tensors[name].numel() * tensors[name].element_size())


def _code(dtype: torch.dtype) -> str | None:
    try:
        return to_safetensors(dtype)
    except ValueError:  # a torch dtype bigviz's table does not know (e.g. quantized)
        return None


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _tensor_bytes(t: torch.Tensor) -> memoryview:
    """A zero-copy byte view of ``t`` (a copy only when it is not contiguous on the CPU)."""
    import torch

    flat = t.detach().to("cpu").contiguous().reshape(-1)
    if flat.numel() == 0:
        return memoryview(b"")
    return memoryview(flat.view(torch.uint8).numpy()).cast("B")
