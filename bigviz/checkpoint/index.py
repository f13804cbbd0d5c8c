"""`CheckpointIndex`: every tensor of a checkpoint (name, dtype, shape, bytes, file), from headers.

Opening an index reads only what describes the tensors: safetensors headers (a few KB per
shard), or, for torch pickles, the pickle itself with the data memory-mapped, not read. Every
problem (missing shards, truncated or corrupt files, index entries a shard does not hold) is
collected and raised once, so a bad checkpoint is refused before any tensor data is touched.

Example:
    >>> import tempfile, torch, pathlib
    >>> from bigviz.checkpoint.save import save_sharded
    >>> folder = save_sharded({"a": torch.ones(4), "b": torch.ones(4)},
    ...                       pathlib.Path(tempfile.mkdtemp()) / "ckpt",
    ...                       max_shard_size=16, progress=False)
    >>> index = CheckpointIndex.open(folder)
    >>> index.format, len(index), index.total_bytes, [f.name for f in index.files]
    ('safetensors', 2, 32, ['model-00001-of-00002.safetensors', 'model-00002-of-00002.safetensors'])
"""

from __future__ import annotations

import contextlib
import copy
import os
from collections.abc import Iterable, Iterator, KeysView
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from bigviz.checkpoint.errors import CheckpointError, raise_problems
from bigviz.checkpoint.files import MISSING_FIX, CheckpointFiles, find_files, missing_problems
from bigviz.checkpoint.safetensors_io import check_header, file_stamp

if TYPE_CHECKING:
    import torch

__all__ = ["TensorInfo", "CheckpointIndex", "CheckpointError"]


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of a checkpoint, as its file describes it.

    Attributes:
        name: the key in the checkpoint.
        dtype: torch dtype name without ``torch.``, e.g. ``"float32"``.
        shape: the tensor's shape.
        nbytes: its size in bytes.
        file: the file holding it.
        data_offsets: absolute ``(begin, end)`` byte range in ``file`` (safetensors only).
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    file: Path
    data_offsets: tuple[int, int] | None = None

    @property
    def numel(self) -> int:
        """Number of elements."""
        n = 1
        for d in self.shape:
            n *= d
        return n


class CheckpointIndex:
    """The tensors of a checkpoint, read from headers only. Build it with `CheckpointIndex.open`.

    Attributes:
        path: the index file or single weights file that was opened.
        format: ``"safetensors"`` or ``"torch"``.
        entries: checkpoint key -> `TensorInfo`, in file order.
        files: the weights files, sorted by name.
        metadata: the index's ``metadata`` (or a single safetensors file's ``__metadata__``).
    """

    def __init__(
        self,
        files: CheckpointFiles,
        entries: dict[str, TensorInfo],
        metadata: dict,
        torch_states: dict[Path, dict[str, torch.Tensor]],
        stamps: dict[Path, tuple[int, ...]] | None = None,
    ) -> None:
        self.path: Path = files.path
        self.format: str = files.format
        self.files: list[Path] = list(files.files)
        self.entries: dict[str, TensorInfo] = entries
        self.metadata: dict = metadata
        self.stamps: dict[Path, tuple[int, ...]] = dict(stamps or {})  # each file as it was read
        self._torch_states = torch_states

    @classmethod
    def open(cls, path: str | Path | CheckpointIndex, *, prefer_safe: bool = True) -> CheckpointIndex:
        """Open a checkpoint file, index file or folder (see `bigviz.checkpoint.files`).

        Args:
            path: a ``.safetensors``/``.bin``/``.pt``/``.pth`` file, an index ``.json``, a
                folder holding either, or an already open index (returned as is).
            prefer_safe: in a folder holding both formats, use the safetensors files.

        Raises:
            CheckpointError: listing every missing shard, corrupt file and bad index entry.

        Example:
            >>> CheckpointIndex.open("no/such/folder")  # doctest: +ELLIPSIS
            Traceback (most recent call last):
            bigviz.checkpoint.errors.CheckpointError: checkpoint 'no/such/folder' does not exist...
        """
        if isinstance(path, CheckpointIndex):
            return path
        # missing shards are reported with the other shards' problems, in one error
        files = find_files(path, prefer_safe=prefer_safe, check_files=False)
        stamps: dict[Path, tuple[int, ...]] = {}
        if files.format == "safetensors":
            per_file, file_metadata = _read_safetensors(files, stamps)
            metadata, states = dict(files.metadata), {}
            if files.weight_map is None:  # a single file: its header's __metadata__
                metadata = file_metadata[files.files[0]]
        else:
            per_file, states = _read_torch(files, stamps)
            metadata = dict(files.metadata)
        return cls(files, _select(files, per_file), metadata, states, stamps)

    @property
    def total_bytes(self) -> int:
        """Bytes of all tensors."""
        return sum(info.nbytes for info in self.entries.values())

    def keys(self) -> KeysView[str]:
        """Checkpoint keys, in file order."""
        return self.entries.keys()

    def __len__(self) -> int:
        return len(self.entries)

    def __contains__(self, name: object) -> bool:
        return name in self.entries

    def __iter__(self) -> Iterator[str]:
        return iter(self.entries)

    def __getitem__(self, name: str) -> TensorInfo:
        return self.entries[name]

    def subset(self, keys: Iterable[str]) -> CheckpointIndex:
        """The same checkpoint restricted to ``keys``: a loader given it reads only those
        (one pipeline stage's tensors). No file is read again.

        Raises:
            KeyError: naming the keys the checkpoint does not hold.

        Example:
            >>> import tempfile, torch, pathlib
            >>> from bigviz.checkpoint.save import save_sharded
            >>> folder = save_sharded({"a": torch.ones(2), "b": torch.ones(2)},
            ...                       pathlib.Path(tempfile.mkdtemp()) / "c", progress=False)
            >>> list(CheckpointIndex.open(folder).subset(["b"]).keys())
            ['b']
        """
        wanted = set(keys)
        unknown = sorted(wanted - self.entries.keys())
        if unknown:
            raise KeyError(f"{self.path}: no such keys in the checkpoint: {unknown[:10]}")
        part = copy.copy(self)
        part.entries = {k: v for k, v in self.entries.items() if k in wanted}
        return part

    def torch_state(self, file: Path) -> dict[str, torch.Tensor]:
        """The memory-mapped state dict of a torch-format file (mapped once, when opened)."""
        return self._torch_states[file]

    def __repr__(self) -> str:
        return (
            f"CheckpointIndex({str(self.path)!r}, format={self.format!r}, "
            f"tensors={len(self)}, files={len(self.files)}, bytes={self.total_bytes})"
        )


def _read_safetensors(
    files: CheckpointFiles, stamps: dict[Path, tuple[int, ...]]
) -> tuple[dict[Path, dict[str, TensorInfo]], dict[Path, dict]]:
    problems: list[str] = []
    per_file: dict[Path, dict[str, TensorInfo]] = {}
    metadata: dict[Path, dict] = {}
    for file in files.files:
        header, found = check_header(file)
        problems += found
        if header is not None:
            if header.stamp is not None:
                stamps[file] = header.stamp
            metadata[file] = dict(header.metadata)
            per_file[file] = {
                name: TensorInfo(name, e.dtype, e.shape, e.end - e.begin, file, (e.begin, e.end))
                for name, e in header.tensors.items()
            }
    _raise_file_problems(files, problems, fix=_CORRUPT_FIX)
    return per_file, metadata


_CORRUPT_FIX = "the listed files are truncated or corrupt: re-download them or save the model again"


def _raise_file_problems(files: CheckpointFiles, problems: list[str], *, fix: str = "") -> None:
    """One error for every missing, truncated and corrupt file of the checkpoint."""
    if not problems:
        raise_problems(missing_problems(files.missing), f"incomplete checkpoint '{files.path.parent}'", fix=MISSING_FIX)
        return
    fixes = [f for f in ((MISSING_FIX if files.missing else ""), fix) if f]
    raise_problems(
        missing_problems(files.missing) + problems, f"cannot read checkpoint '{files.path}'", fix="; ".join(fixes)
    )


def _read_torch(
    files: CheckpointFiles, stamps: dict[Path, tuple[int, ...]]
) -> tuple[dict[Path, dict[str, TensorInfo]], dict]:
    from bigviz.checkpoint.torch_io import load_torch_file

    problems: list[str] = []
    per_file: dict[Path, dict[str, TensorInfo]] = {}
    states: dict[Path, dict[str, torch.Tensor]] = {}
    for file in files.files:
        with contextlib.suppress(OSError):  # a missing file is reported by the load below
            stamps[file] = file_stamp(os.stat(file))  # before torch maps it
        try:
            states[file] = load_torch_file(file)
        except CheckpointError as err:
            problems += err.problems
            continue
        per_file[file] = {
            name: TensorInfo(
                name, str(t.dtype).removeprefix("torch."), tuple(t.shape), t.numel() * t.element_size(), file
            )
            for name, t in states[file].items()
        }
    _raise_file_problems(files, problems)
    return per_file, states


def _select(files: CheckpointFiles, per_file: dict[Path, dict[str, TensorInfo]]) -> dict[str, TensorInfo]:
    """The entries the index names (all of them for a single file), checking each is there."""
    if files.weight_map is None:
        return dict(per_file[files.files[0]])
    problems: list[str] = []
    entries: dict[str, TensorInfo] = {}
    for file, infos in per_file.items():  # file order, then the file's own order
        for name, info in infos.items():
            if files.weight_map.get(name) == file:
                entries[name] = info
    for name, file in files.weight_map.items():
        if name not in entries:
            problems.append(f"{files.path}: says {name!r} is in {file.name}, which does not hold it")
    raise_problems(
        problems,
        f"inconsistent checkpoint '{files.path.parent}'",
        fix="the index does not match its shards: re-download the checkpoint or save it again",
    )
    return entries
