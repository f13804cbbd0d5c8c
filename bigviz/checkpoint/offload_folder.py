"""Offload folders: weights bigviz writes once, as safetensors, and reads lazily at forward time.

Weights a device map sends to ``"disk"`` that are not already in safetensors files (a model in
memory, a torch pickle) are written once into ``offload_folder`` and read from there through
memory maps. Safetensors checkpoints never come here: they are read in place.

**Ownership.** bigviz only ever reuses or deletes files that its own record,
``bigviz-offload.json`` in the folder, says it wrote, each with its stamp (inode, size and
modification time in nanoseconds, as it was when written). A folder holding anything else (a
saved checkpoint, your files, one of bigviz's files changed since, even to the same size) is
refused with an `OffloadFolderError` naming the folder and the files, before anything is
written or moved: bigviz does not write into a subfolder behind your back, you choose another
folder. Each write uses new file names (``offload-<hex>-00001-of-00002.safetensors``) and
updates the record in steps, so a kill at any moment leaves only files the record claims; a
write that fails (a full disk) removes what it made and puts the record back as it was.

**Several processes.** A write holds an exclusive ``flock`` on the folder from its check to
the moment its weights are open (:func:`offload_weights`), and a read holds it while it opens
them: two processes sharing a folder take turns, each computes with the weights it wrote, and
no record write ever replaces another's. Files a later write deletes stay readable by a model
that opened them (open files outlive their names).

Example:
    >>> import tempfile, torch
    >>> folder = tempfile.mkdtemp()
    >>> index = write_offload_folder({"w": torch.ones(2)}, folder)
    >>> weights = open_offload_folder(folder)
    >>> weights["w"].tolist(), sorted(read_record(folder).files) == [index.name]
    ([1.0, 1.0], True)
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import secrets
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows: no advisory locks (one process per folder)
    fcntl = None  # type: ignore[assignment]

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
    "offload_weights",
    "write_offload",
    "read_record",
    "folder_lock",
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


Stamp = tuple[int, int, int]  # (inode, size, mtime_ns)


def stamp_of(st: os.stat_result) -> Stamp:
    """What a record keeps of a file it lists: ``(inode, size, mtime_ns)``. A file edited by
    hand (even to the same size), or replaced by another, no longer matches."""
    return (st.st_ino, st.st_size, st.st_mtime_ns)


@dataclass(frozen=True)
class OffloadRecord:
    """What ``bigviz-offload.json`` says: the live weights and the files bigviz may delete.

    Attributes:
        index: the live index (or single) file, None when nothing was written yet.
        files: live file name -> its stamp when written (``(inode, size, mtime_ns)``; a
            record of bigviz 0.2 kept sizes only: ``(None, size, None)``).
        pending: stems (``offload-<hex>``) of earlier or unfinished writes, all bigviz's.
        written_ns: when the record file was last written (its ``mtime_ns``, as read). A record
            of sizes alone was written after the files it lists, so a listed file modified
            later (by hand, to the same size) is not bigviz's any more.
    """

    index: str | None = None
    files: dict[str, tuple[int | None, int, int | None]] = field(default_factory=dict)
    pending: tuple[str, ...] = ()
    written_ns: int | None = None

    def owns(self, name: str, st: os.stat_result | None) -> bool | None:
        """True: bigviz's; False: not; None: bigviz's once, changed since (another stamp)."""
        if name in self.files:
            return True if st is not None and self._same(self.files[name], st) else None
        return any(_of_stem(name, stem) for stem in self.pending) or bool(_RECORD_TMP.fullmatch(name))

    def unchanged(self, name: str, st: os.stat_result) -> bool:
        """Whether ``name``'s content is as written: size and modification time (its inode may
        differ: a folder copied with its times, ``cp -a``, reads the same)."""
        inode, size, mtime = self.files[name]
        return st.st_size == size and (mtime == st.st_mtime_ns if mtime is not None else not self._newer(st))

    def _same(self, recorded: tuple[int | None, int, int | None], st: os.stat_result) -> bool:
        return _matches(recorded, stamp_of(st)) and (recorded[2] is not None or not self._newer(st))

    def _newer(self, st: os.stat_result) -> bool:
        """A file modified after a record of sizes alone was written (so not as bigviz wrote it)."""
        return self.written_ns is not None and st.st_mtime_ns > self.written_ns

    def to_json(self) -> dict:
        return {
            "written_by": "bigviz",
            "version": 2,
            "index": self.index,
            "files": {name: _stamp_json(stamp) for name, stamp in self.files.items()},
            "pending": list(self.pending),
        }


def _matches(recorded: tuple[int | None, int, int | None], now: Stamp) -> bool:
    return all(want is None or want == got for want, got in zip(recorded, now, strict=True))


def _stamp_json(stamp: tuple[int | None, int, int | None]) -> object:
    inode, size, mtime = stamp
    return size if inode is None else {"inode": inode, "size": size, "mtime_ns": mtime}


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
    with contextlib.suppress(OSError):
        record = replace(record, written_ns=path.stat().st_mtime_ns)
    return record


def _parse_record(doc: object) -> tuple[OffloadRecord | None, str]:
    if not isinstance(doc, dict):
        return None, "not a JSON object"
    files, pending, index = doc.get("files", {}), doc.get("pending", []), doc.get("index")
    stamps = {k: _parse_stamp(v) for k, v in files.items()} if isinstance(files, dict) else None
    if stamps is None or not all(_plain(k) and v is not None for k, v in stamps.items()):
        return None, "'files' must map plain file names to their stamps (inode, size, mtime_ns)"
    if not isinstance(pending, list) or not all(isinstance(s, str) and _STEM.fullmatch(s) for s in pending):
        return None, "'pending' must list offload-<hex> stems"
    if index is not None and index not in files:
        return None, "'index' must be one of 'files'"
    return OffloadRecord(index, stamps, tuple(pending)), ""  # type: ignore[arg-type]


def _parse_stamp(value: object) -> tuple[int | None, int, int | None] | None:
    """A recorded stamp: ``{"inode", "size", "mtime_ns"}``, or a size alone (bigviz 0.2)."""
    if _size(value):
        return None, value, None  # type: ignore[return-value]
    if isinstance(value, dict) and set(value) == {"inode", "size", "mtime_ns"} and all(map(_size, value.values())):
        return value["inode"], value["size"], value["mtime_ns"]
    return None


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
        st = entry.stat(follow_symlinks=False) if entry.is_file(follow_symlinks=False) else None
        owned = record.owns(entry.name, st)
        if owned is None:
            changed.append(f"{entry.name} ({_what_changed(record.files[entry.name], st)})")
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


def _what_changed(recorded: tuple[int | None, int, int | None], st: os.stat_result | None) -> str:
    inode, size, mtime = recorded
    if st is None:
        return "not a plain file any more"
    if st.st_size != size:
        return f"now {st.st_size} bytes, {size} when written"
    if inode is not None and st.st_ino != inode:
        return "another file by the same name"
    if mtime is None:
        return f"modified after {RECORD} was written, same size"
    return "modified since it was written, same size"


_LOCKS: dict[str, list] = {}  # real path -> [RLock, descriptor or None, depth]: this process's holds
_LOCKS_GUARD = threading.Lock()


@contextlib.contextmanager
def folder_lock(folder: str | Path) -> Iterator[None]:
    """Hold the offload folder for this process: an exclusive ``flock`` on the folder itself
    (other processes wait), re-entrant within this process (its threads take turns).

    Example:
        >>> import tempfile
        >>> with folder_lock(tempfile.mkdtemp()):
        ...     pass
    """
    key = os.path.realpath(folder)
    with _LOCKS_GUARD:
        entry = _LOCKS.setdefault(key, [threading.RLock(), None, 0])
    with entry[0]:
        if entry[2] == 0 and fcntl is not None:
            fd = os.open(key, os.O_RDONLY)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)  # released by the kernel if this process dies
            except OSError as err:
                os.close(fd)
                if err.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.EINVAL):
                    raise
                fd = None  # a filesystem without locks: this process's threads still take turns
            entry[1] = fd
        entry[2] += 1
        try:
            yield
        finally:
            entry[2] -= 1
            if entry[2] == 0 and entry[1] is not None:
                os.close(entry[1])
                entry[1] = None


def offload_weights(
    tensors: Mapping[str, torch.Tensor],
    folder: str | Path,
    names: Mapping[str, str] | None = None,
    *,
    dtypes: Mapping[str, torch.dtype] | None = None,
    max_shard_size: int = _SHARD,
) -> LazyWeights:
    """Write ``tensors`` into ``folder`` (:func:`write_offload_folder`) and open what this
    write made, the folder locked throughout: another process writing into the same folder
    meanwhile cannot make this one read its weights. ``names`` and ``dtypes`` go to the
    `LazyWeights` returned (model name -> key written; the dtype each is read in).

    Example:
        >>> import tempfile, torch
        >>> offload_weights({"w": torch.ones(2)}, tempfile.mkdtemp())["w"].tolist()
        [1.0, 1.0]
    """
    from bigviz.checkpoint.index import CheckpointIndex

    def open_it(index: Path) -> LazyWeights:
        return LazyWeights(CheckpointIndex.open(index), names, dtypes=dtypes)

    return _written(tensors, Path(folder), max_shard_size, open_it)


def write_offload_folder(
    tensors: Mapping[str, torch.Tensor], folder: str | Path, *, max_shard_size: int = _SHARD
) -> Path:
    """Write ``tensors`` into ``folder`` as safetensors shards (+ index) and record them.

    Files of an earlier offload that the record lists are replaced (by new names, then
    deleted: a dispatch still mapping them keeps reading them); nothing else is touched.
    Each tensor streams from its memory (or from a mapped file) to its shard: no copy of the
    weights is made in memory.

    Returns:
        The index file (or single shard) written. Open it while holding :func:`folder_lock`
        (or use :func:`offload_weights`): once the lock is let go, another write may replace it.

    Raises:
        OffloadFolderError: the folder holds files bigviz did not write (named), before
            anything is written.
        OSError: the write failed (a full disk, a read-only folder), naming the folder; what
            this write made is removed and the record is as it was.
    """
    return _written(tensors, Path(folder), max_shard_size, lambda index: index)


_T = TypeVar("_T")


def _written(tensors: Mapping[str, torch.Tensor], folder: Path, max_shard_size: int, then: Callable[[Path], _T]) -> _T:
    """Write under the folder's lock and hand the index written to ``then``, still locked."""
    created = _make_folder(folder)
    try:
        with folder_lock(folder):
            return then(_write_locked(tensors, folder, max_shard_size=max_shard_size))
    except BaseException as err:
        if created:
            with contextlib.suppress(OSError):
                folder.rmdir()  # made by this write and left empty: gone again
        if isinstance(err, OSError) and err.errno is not None:
            message = (
                f"cannot write offloaded weights into {folder}: {err.strerror or err}; what this write "
                "made was removed (the folder is as it was): free some space or choose another offload_folder"
            )
            raise type(err)(err.errno, message) from err
        raise


def _make_folder(folder: Path) -> bool:
    """Create ``folder`` (and its parents); True when this call made ``folder`` itself."""
    if folder.is_dir():
        return False
    try:
        folder.mkdir(parents=True)
    except FileExistsError:
        return False
    return True


def _write_locked(tensors: Mapping[str, torch.Tensor], folder: Path, *, max_shard_size: int) -> Path:
    had_record = (folder / RECORD).exists()
    old = read_record(folder) or OffloadRecord()
    OffloadFolderError.check(_ownership_problems(folder, old), f"cannot write into offload folder {folder}")
    stem = f"offload-{secrets.token_hex(6)}"
    _save_record(folder, OffloadRecord(old.index, old.files, (*old.pending, stem)))
    stale = tuple(dict.fromkeys([*old.pending, *_stems(old)]))
    try:
        written = write_checkpoint_files(tensors, folder, max_shard_size=max_shard_size, stem=stem)
        files = {p.name: stamp_of(p.stat()) for p in written}
        _save_record(folder, OffloadRecord(written[-1].name, files, stale))  # type: ignore[arg-type]  # the switch
    except BaseException:
        _undo(folder, stem, old if had_record else None)
        raise
    for entry in os.scandir(folder):
        earlier = entry.name not in files and any(_of_stem(entry.name, s) for s in stale)
        if earlier or _RECORD_TMP.fullmatch(entry.name):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(entry.path)  # bigviz's own earlier files only
    _save_record(folder, OffloadRecord(written[-1].name, files, ()))  # type: ignore[arg-type]
    return written[-1]


def _undo(folder: Path, stem: str, old: OffloadRecord | None) -> None:
    """A failed write: remove the files of its ``stem`` (its own, and only those), then put
    the record back as it was (or remove it, when the folder had none). Best effort: what
    cannot be undone now is listed as pending, so the next write removes it."""
    for entry in os.scandir(folder):
        if _of_stem(entry.name, stem) or _RECORD_TMP.fullmatch(entry.name):
            with contextlib.suppress(OSError):
                os.unlink(entry.path)
    with contextlib.suppress(OSError):
        if old is None:
            os.unlink(folder / RECORD)
        else:
            _save_record(folder, old)


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
    if not folder.is_dir():
        return LazyWeights(CheckpointIndex.open(folder))  # the index's error: no such folder
    with folder_lock(folder):  # no write replaces the files between the record and their opening
        record = read_record(folder)
        if record is None:
            return LazyWeights(CheckpointIndex.open(folder))
        if record.index is None:
            raise OffloadFolderError(
                f"offload folder {folder}: bigviz's write into it never finished (its "
                f"{RECORD} lists no weights); offload the model again"
            )
        changed = [name for name in record.files if not _unchanged(folder / name, record, name)]
        if changed:
            raise OffloadFolderError(
                f"offload folder {folder}: {', '.join(changed[:8])} missing or changed "
                "since bigviz wrote them; offload the model again"
            )
        return LazyWeights(CheckpointIndex.open(folder / record.index))


def _unchanged(path: Path, record: OffloadRecord, name: str) -> bool:
    try:
        st = path.stat()
    except OSError:
        return False
    return path.is_file() and record.unchanged(name, st)


def write_offload(index: CheckpointIndex, loads: Sequence[TensorLoad], folder: Path) -> Path:
    """Write the checkpoint tensors of ``loads`` into ``folder`` under their model names.

    Tensors keep the checkpoint's dtype (a `LazyWeights` over the result converts on access,
    exactly as for a safetensors checkpoint read in place). Returns the index written.
    """
    with LazyWeights(index, {load.name: load.key for load in loads}) as source:
        return write_offload_folder(source, folder)
