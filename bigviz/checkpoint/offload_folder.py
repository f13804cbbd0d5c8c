"""Offload folders: weights bigviz writes once, as safetensors, and reads lazily at forward time.

Weights a device map sends to ``"disk"`` that are not already in safetensors files (a model in
memory, a torch pickle) are written once into ``offload_folder`` and read from there through
memory maps. Safetensors checkpoints never come here: they are read in place.

**Ownership.** bigviz only ever reuses or deletes files that its own record,
``bigviz-offload.json`` in the folder, says it wrote (with their sizes). A folder holding
anything else (a saved checkpoint, your files, one of bigviz's files changed since) is refused
with an `OffloadFolderError` naming the folder and the files, before anything is written or
moved: bigviz does not write into a subfolder behind your back, you choose another folder.
Each write uses new file names (``offload-<hex>-00001-of-00002.safetensors``) and updates the
record in steps, so a kill at any moment leaves only files the record claims.

Example:
    >>> import tempfile, torch
    >>> folder = tempfile.mkdtemp()
    >>> index = write_offload_folder({"w": torch.ones(2)}, folder)
    >>> weights = open_offload_folder(folder)
    >>> weights["w"].tolist(), sorted(read_record(folder).files) == [index.name]
    ([1.0, 1.0], True)
"""

from __future__ import annotations

import os
import re
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from bigviz.checkpoint.errors import CheckpointError
from bigviz.checkpoint.lazy import LazyWeights
from bigviz.checkpoint.save import write_checkpoint_files
from bigviz.core.serialize import parse_json, write_json_atomic

if TYPE_CHECKING:
    import torch

    from bigviz.checkpoint.index import CheckpointIndex
    from bigviz.checkpoint.load_plan import TensorLoad

__all__ = [
    "RECORD",
    "OffloadFolderError",
    "OffloadRecord",
    "offload_problems",
    "write_offload_folder",
    "open_offload_folder",
    "write_offload",
    "read_record",
]

RECORD = "bigviz-offload.json"
_SHARD = 2 * 10**9
_STEM = re.compile(r"offload-[0-9a-f]{12}")
_RECORD_TMP = re.compile(rf"\.{re.escape(RECORD)}\.tmp-[0-9a-f]+")  # a killed record write
_FIX = (
    "bigviz never replaces or deletes files it did not write: give an empty or new folder as "
    "offload_folder, or move those files out yourself"
)


class OffloadFolderError(CheckpointError):
    """An offload folder bigviz will not write into or read (files bigviz did not write, or a
    record it cannot trust); a `CheckpointError`, so a ``ValueError``, listing ``problems``."""


@dataclass(frozen=True)
class OffloadRecord:
    """What ``bigviz-offload.json`` says: the live weights and the files bigviz may delete.

    Attributes:
        index: the live index (or single) file, None when nothing was written yet.
        files: live file name -> its size when written.
        pending: stems (``offload-<hex>``) of earlier or unfinished writes, all bigviz's.
    """

    index: str | None = None
    files: dict[str, int] = field(default_factory=dict)
    pending: tuple[str, ...] = ()

    def owns(self, name: str, size: int | None) -> bool | None:
        """True: bigviz's; False: not; None: bigviz's once, changed since (size differs)."""
        if name in self.files:
            return True if size == self.files[name] else None
        return any(_of_stem(name, stem) for stem in self.pending) or bool(_RECORD_TMP.fullmatch(name))

    def to_json(self) -> dict:
        return {
            "written_by": "bigviz",
            "version": 1,
            "index": self.index,
            "files": dict(self.files),
            "pending": list(self.pending),
        }


def _of_stem(name: str, stem: str) -> bool:
    return (
        name.startswith(stem)
        and re.fullmatch(rf"{re.escape(stem)}((-\d{{5}}-of-\d{{5}})?\.safetensors|\.safetensors\.index\.json)", name)
        is not None
    )


def read_record(folder: str | Path) -> OffloadRecord | None:
    """The folder's ``bigviz-offload.json``, checked; None when there is none.

    Raises:
        OffloadFolderError: the record is not valid JSON or not what bigviz writes.
    """
    path = Path(folder) / RECORD
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return None
    try:
        doc = parse_json(raw, path, "bigviz offload record")
    except ValueError as err:
        raise OffloadFolderError(f"{err}; {_FIX}") from None
    record, problem = _parse_record(doc)
    if record is None:
        raise OffloadFolderError(f"{path}: not a bigviz offload record ({problem}); {_FIX}")
    return record


def _parse_record(doc: object) -> tuple[OffloadRecord | None, str]:
    if not isinstance(doc, dict):
        return None, "not a JSON object"
    files, pending, index = doc.get("files", {}), doc.get("pending", []), doc.get("index")
    if not isinstance(files, dict) or not all(_plain(k) and _size(v) for k, v in files.items()):
        return None, "'files' must map plain file names to sizes"
    if not isinstance(pending, list) or not all(isinstance(s, str) and _STEM.fullmatch(s) for s in pending):
        return None, "'pending' must list offload-<hex> stems"
    if index is not None and index not in files:
        return None, "'index' must be one of 'files'"
    return OffloadRecord(index, dict(files), tuple(pending)), ""


def _plain(name: object) -> bool:
    """A file name in the folder itself: no path, not the record, not a dot name."""
    return (
        isinstance(name, str)
        and bool(name)
        and "/" not in name
        and "\\" not in name
        and name not in (".", "..", RECORD)
    )


def _size(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def offload_problems(folder: str | Path | None) -> list[str]:
    """Why ``folder`` cannot receive offloaded weights (an empty list when it can).

    Example:
        >>> offload_problems(None)[0][:38]
        'disk offload of a non-safetensors chec'
    """
    if folder is None:
        return [
            "disk offload of a non-safetensors checkpoint needs offload_folder= (its weights "
            "are written there once, as safetensors)"
        ]
    path = Path(folder)
    if path.exists() and not path.is_dir():
        return [f"offload_folder {path} is a file: pass a folder"]
    if not path.is_dir():
        return []
    try:
        record = read_record(path) or OffloadRecord()
    except OffloadFolderError as err:
        return [str(err)]
    return _ownership_problems(path, record)


def _ownership_problems(folder: Path, record: OffloadRecord) -> list[str]:
    foreign, changed = [], []
    for entry in sorted(os.scandir(folder), key=lambda e: e.name):
        if entry.name == RECORD:
            continue
        size = entry.stat(follow_symlinks=False).st_size if entry.is_file(follow_symlinks=False) else None
        owned = record.owns(entry.name, size)
        if owned is None:
            changed.append(f"{entry.name} (now {size} bytes, {record.files[entry.name]} when written)")
        elif not owned:
            foreign.append(entry.name + ("/" if entry.is_dir() else ""))
    problems = []
    if foreign:
        shown = ", ".join(foreign[:8]) + (f", ... ({len(foreign)} in all)" if len(foreign) > 8 else "")
        problems.append(
            f"offload folder {folder} holds files bigviz did not write (its record {RECORD} "
            f"does not list them): {shown}; {_FIX}"
        )
    if changed:
        problems.append(
            f"offload folder {folder}: files bigviz wrote were changed since, so they are not "
            f"bigviz's to replace any more: {', '.join(changed[:8])}; {_FIX}"
        )
    return problems


def write_offload_folder(
    tensors: Mapping[str, torch.Tensor], folder: str | Path, *, max_shard_size: int = _SHARD
) -> Path:
    """Write ``tensors`` into ``folder`` as safetensors shards (+ index) and record them.

    Files of an earlier offload that the record lists are replaced (by new names, then
    deleted: a dispatch still mapping them keeps reading them); nothing else is touched.
    Each tensor streams from its memory (or from a mapped file) to its shard: no copy of the
    weights is made in memory.

    Returns:
        The index file (or single shard) written.

    Raises:
        OffloadFolderError: the folder holds files bigviz did not write (named), before
            anything is written.
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    old = read_record(folder) or OffloadRecord()
    OffloadFolderError.check(_ownership_problems(folder, old), f"cannot write into offload folder {folder}")
    stem = f"offload-{secrets.token_hex(6)}"
    _save_record(folder, OffloadRecord(old.index, old.files, (*old.pending, stem)))
    written = write_checkpoint_files(tensors, folder, max_shard_size=max_shard_size, stem=stem)
    stale = tuple(dict.fromkeys([*old.pending, *_stems(old)]))
    files = {p.name: p.stat().st_size for p in written}
    _save_record(folder, OffloadRecord(written[-1].name, files, stale))  # the switch
    for entry in os.scandir(folder):
        earlier = entry.name not in files and any(_of_stem(entry.name, s) for s in stale)
        if earlier or _RECORD_TMP.fullmatch(entry.name):
            os.unlink(entry.path)  # bigviz's own earlier files only
    _save_record(folder, OffloadRecord(written[-1].name, files, ()))
    return written[-1]


def _stems(record: OffloadRecord) -> list[str]:
    return sorted({m.group(0) for name in record.files if (m := _STEM.match(name))})


def _save_record(folder: Path, record: OffloadRecord) -> None:
    write_json_atomic(record.to_json(), folder / RECORD)


def open_offload_folder(folder: str | Path) -> LazyWeights:
    """`LazyWeights` over what bigviz wrote in ``folder`` (its record's index), or over the
    checkpoint the folder holds when it has no record (read only: nothing is written).

    Raises:
        OffloadFolderError: a recorded file is missing or changed since it was written.
    """
    from bigviz.checkpoint.index import CheckpointIndex

    folder = Path(folder)
    record = read_record(folder)
    if record is None:
        return LazyWeights(CheckpointIndex.open(folder))
    if record.index is None:
        raise OffloadFolderError(
            f"offload folder {folder}: bigviz's write into it never finished (its "
            f"{RECORD} lists no weights); offload the model again"
        )
    changed = [
        name
        for name, size in record.files.items()
        if not (folder / name).is_file() or (folder / name).stat().st_size != size
    ]
    if changed:
        raise OffloadFolderError(
            f"offload folder {folder}: {', '.join(changed[:8])} missing or changed "
            "since bigviz wrote them; offload the model again"
        )
    return LazyWeights(CheckpointIndex.open(folder / record.index))


def write_offload(index: CheckpointIndex, loads: Sequence[TensorLoad], folder: Path) -> Path:
    """Write the checkpoint tensors of ``loads`` into ``folder`` under their model names.

    Tensors keep the checkpoint's dtype (a `LazyWeights` over the result converts on access,
    exactly as for a safetensors checkpoint read in place). Returns the index written.
    """
    with LazyWeights(index, {load.name: load.key for load in loads}) as source:
        return write_offload_folder(source, folder)
