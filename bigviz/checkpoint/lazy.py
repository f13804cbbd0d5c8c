"""`LazyWeights`: a read-only ``name -> CPU tensor`` mapping over checkpoint files, no copies.

Each safetensors file is memory-mapped once (``torch.UntypedStorage.from_file``, a private
mapping: writes to a tensor never reach the file) and every tensor is a view into that
mapping at its header offsets. Nothing is read until a tensor's bytes are used, and what is
read lives in the page cache (reclaimable, shared with other processes), not in anonymous
memory. Torch pickles are mapped once by ``torch.load(mmap=True)`` when the index opens.

The engine uses this for disk offload with no rewriting: a module's weights are looked up
here at forward time, and `LazyWeights.prefetch` asks the kernel to read the next ones ahead.

A mapped file truncated or rewritten in place would make reads of its pages crash the process
(SIGBUS) or give other bytes. So each file stays open while mapped, and its stamp (size,
mtime, inode: one ``fstat``) is compared with the stamp its header was read with before every
read and in `LazyWeights.verify` (which the engine calls before handing a module its weights):
a change is a `CheckpointError` naming the file. A file *replaced* by rename is harmless: the
mapping keeps the file that was opened.

Example:
    >>> import tempfile, torch, pathlib
    >>> from bigviz.checkpoint.save import save_sharded
    >>> folder = save_sharded({"h.0.w": torch.arange(4.0)}, pathlib.Path(tempfile.mkdtemp()) / "c",
    ...                       progress=False)
    >>> with LazyWeights(CheckpointIndex.open(folder), {"layer.w": "h.0.w"}) as weights:
    ...     weights.prefetch(["layer.w"])
    ...     print(weights["layer.w"], weights.nbytes("layer.w"))
    tensor([0., 1., 2., 3.]) 16
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Collection, Iterable, Iterator, Mapping
from pathlib import Path

import torch
from typing import Any

from bigviz.checkpoint.errors import raise_problems
from bigviz.checkpoint.index import CheckpointIndex, TensorInfo
from bigviz.checkpoint.load_plan import module_matches
from bigviz.checkpoint.safetensors_io import file_stamp
from bigviz.core.dtypes import load_dtype
from bigviz.osio.pages import willneed
from bigviz.osio.procfs import fd_path
from bigviz.core.errors import UsageError

__all__ = ["LazyWeights", "WeightStores", "map_file"]


def map_file(path: Path, fd: int | None = None) -> torch.Tensor:
    """A ``uint8`` CPU tensor over the whole file, memory-mapped privately (copy-on-write).

    With ``fd`` (a descriptor open on ``path``) the very file that descriptor holds is mapped,
    even if the path was replaced meanwhile (Linux: through ``/proc/self/fd``).

    Example:
        >>> import tempfile, pathlib
        >>> p = pathlib.Path(tempfile.mkdtemp()) / "x"; _ = p.write_bytes(b"abc")
        >>> map_file(p).tolist()
        [97, 98, 99]
    """
    size = os.fstat(fd).st_size if fd is not None else os.path.getsize(path)
    if size == 0:
        return torch.empty(0, dtype=torch.uint8)
    source = (fd_path(fd) if fd is not None else None) or str(path)
    storage = torch.UntypedStorage.from_file(source, shared=False, nbytes=size)
    return torch.empty(0, dtype=torch.uint8).set_(storage)


class LazyWeights(Mapping[str, torch.Tensor]):
    """Read-only view ``model tensor name -> CPU tensor`` over a checkpoint's files.

    Args:
        index: an open `CheckpointIndex` (or anything `CheckpointIndex.open` takes).
        names: model tensor name -> checkpoint key (e.g. to add or strip a prefix); default:
            every checkpoint key under its own name.
        dtype: convert floating tensors to this dtype when they are looked up (a copy).
        keep_dtype: modules whose floating tensors keep the checkpoint's dtype: dotted
            prefixes (``"model.norm"``) or, for a dotless entry, any name component (``"wo"``).
        dtypes: model tensor name -> the dtype its floating tensor is converted to (wins over
            ``dtype`` and ``keep_dtype``; a loader passes each tensor's planned dtype here).

    Safetensors tensors with no dtype change are zero-copy views of the mapped file. Every file
    is opened and mapped once, here in the constructor (mapping reads nothing), and stays
    mapped and open (one descriptor per file) until `close`; tensors already handed out keep
    their mapping alive by themselves. A file replaced by rename or removed (a replaced
    offload folder) does not change what this object reads; a file truncated or rewritten in
    place is refused at the next read or `verify`, naming it.
    """

    def __init__(
        self,
        index: CheckpointIndex | str | Path,
        names: Mapping[str, str] | None = None,
        *,
        dtype: torch.dtype | None = None,
        keep_dtype: Collection[str] = (),
        dtypes: Mapping[str, torch.dtype] | None = None,
    ) -> None:
        self.index = CheckpointIndex.open(index)
        self._names: dict[str, str] = dict(names) if names is not None else {k: k for k in self.index}
        unknown = [k for k in self._names.values() if k not in self.index.entries]
        if unknown:
            raise KeyError(f"names map to keys the checkpoint lacks: {unknown[:10]}")
        self.dtype = _checked_dtype(dtype)
        self._keep = tuple(keep_dtype)
        self._dtypes = dict(dtypes or {})
        self._closed = False
        self._fds: dict[Path, tuple[int, tuple[int, ...]]] = {}  # file -> (descriptor, stamp)
        self._maps: dict[Path, torch.Tensor] = {}
        infos = [self.index.entries[k] for k in self._names.values()]
        mapped = {info.file for info in infos if info.data_offsets is not None}  # safetensors
        try:
            for file in sorted({info.file for info in infos}):
                self._open(file, mapped=file in mapped)
        except BaseException:
            self.close()
            raise

    def _open(self, file: Path, *, mapped: bool) -> None:
        fd = os.open(file, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        self._fds[file] = (fd, self.index.stamps.get(file) or file_stamp(os.fstat(fd)))
        self._check(file)  # unchanged since its header was read: the offsets still hold
        if mapped:  # (torch pickles were mapped by torch when the index opened them)
            self._maps[file] = map_file(file, fd)

    # Mapping protocol -------------------------------------------------------------------
    def __getitem__(self, name: str) -> torch.Tensor:
        if self._closed:
            raise UsageError("LazyWeights is closed: open a new one to read more tensors")
        info = self.index.entries[self._names[name]]
        self._check(info.file)
        tensor = self._raw(info)
        if not tensor.is_floating_point():
            return tensor
        want = self._dtypes.get(name)
        if want is None and self.dtype is not None and not module_matches(name, self._keep):
            want = self.dtype
        return tensor if want is None or tensor.dtype == want else tensor.to(want)

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)

    def __contains__(self, name: object) -> bool:
        return name in self._names

    # extras -----------------------------------------------------------------------------
    def info(self, name: str) -> TensorInfo:
        """The checkpoint's `TensorInfo` for model tensor ``name``."""
        return self.index.entries[self._names[name]]

    def nbytes(self, name: str) -> int:
        """Bytes of ``name`` as stored in the checkpoint (no read)."""
        return self.info(name).nbytes

    def identity(self, name: str) -> tuple[int, int] | None:
        """``(device, inode)`` of the file ``name`` is read from, as this object holds it open
        (None once closed): a reader that opens the file by path checks it is still this one
        (a path given to a new file by rename names another)."""
        held = self._fds.get(self.info(name).file)
        return None if held is None else (held[1][0], held[1][1])

    def prefetch(self, names: Iterable[str]) -> None:
        """Ask the kernel to read these tensors into the page cache.

        A hint (``madvise(MADV_WILLNEED)`` over the mapped bytes): the kernel queues the reads
        and returns; it costs about 30 ms per 64 MiB to queue, so call it from a background
        thread for large modules (it is safe there). Unknown names are ignored, and so is a
        closed object.
        """
        for name in names:
            key = self._names.get(name)
            if key is None or self._closed:
                continue
            info = self.index.entries[key]
            if info.data_offsets is None:  # a pickle: the tensor is already a view of its mapping
                mapped = self._raw(info)
                address = mapped.data_ptr()
            else:  # holding `mapped` keeps the mapping alive during the call, even across close()
                mapped = self._maps.get(info.file)
                if mapped is None:
                    continue
                address = mapped.data_ptr() + info.data_offsets[0]
            willneed(address, info.nbytes)

    def verify(self, names: Iterable[str] | None = None) -> None:
        """Check the files behind ``names`` (default: all) are as they were when opened: one
        ``fstat`` per file. A closed object checks nothing.

        Raises:
            CheckpointError: naming each file truncated or rewritten in place since.

        Example:
            >>> import os, tempfile, torch, pathlib
            >>> from bigviz.checkpoint.save import save_sharded
            >>> folder = save_sharded({"w": torch.ones(4)}, pathlib.Path(tempfile.mkdtemp()) / "c",
            ...                       progress=False)
            >>> weights = LazyWeights(folder)
            >>> weights.verify()  # unchanged: nothing to say
            >>> os.truncate(folder / "model.safetensors", 8)
            >>> weights.verify(["w"])  # doctest: +ELLIPSIS
            Traceback (most recent call last):
            bigviz.checkpoint.errors.CheckpointError: checkpoint files changed under a model that reads them (1 problem):
              - ...model.safetensors: changed since it was opened (size ... -> 8 bytes); ...
        """
        if self._closed:
            return
        if names is None:
            files = set(self._fds)
        else:
            files = {self.index.entries[self._names[n]].file for n in names if n in self._names}
        problems = [p for p in (self._change(f) for f in sorted(files)) if p]
        raise_problems(
            problems,
            "checkpoint files changed under a model that reads them",
            fix="the model keeps its memory maps of them: load the checkpoint again",
        )

    def _check(self, file: Path) -> None:
        problem = self._change(file)
        if problem:
            raise_problems(
                [problem],
                "checkpoint files changed under a model that reads them",
                fix="the model keeps its memory maps of them: load the checkpoint again",
            )

    def _change(self, file: Path) -> str:
        held = self._fds.get(file)
        if held is None:
            return ""
        fd, stamp = held
        now = file_stamp(os.fstat(fd))
        if now == stamp:
            return ""
        what = f"size {stamp[2]} -> {now[2]} bytes" if now[2] != stamp[2] else "rewritten in place"
        return (
            f"{file}: changed since it was opened ({what}); reading it now could crash the "
            "process (SIGBUS) or give other weights"
        )

    def close(self) -> None:
        """Drop the mappings and descriptors (tensors already handed out stay valid)."""
        self._closed = True
        self._maps.clear()
        fds, self._fds = getattr(self, "_fds", {}), {}
        for fd, _ in fds.values():
            with contextlib.suppress(OSError):
                os.close(fd)

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()

    def __enter__(self) -> LazyWeights:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"LazyWeights({str(self.index.path)!r}, tensors={len(self)}, dtype={self.dtype})"

    # internals --------------------------------------------------------------------------
    def _raw(self, info: TensorInfo) -> torch.Tensor:
        if info.data_offsets is None:
            return self.index.torch_state(info.file)[info.name]
        begin, end = info.data_offsets
        dtype = getattr(torch, info.dtype)
        raw = self._maps[info.file][begin:end]
        if begin % dtype.itemsize:  # misaligned (files from other writers): a copy cannot be avoided
            raw = raw.clone()
        return raw.view(dtype).view(info.shape)


def _checked_dtype(dtype: object) -> torch.dtype | None:
    """``dtype`` as a torch dtype, floating only (:func:`~bigviz.core.dtypes.load_dtype`)."""
    name = load_dtype(dtype)
    return None if name is None else getattr(torch, name)


class WeightStores(Mapping[str, torch.Tensor]):
    """Several read-only stores seen as one ``name -> tensor`` mapping (the first holding a name wins).

    A load whose disk-offloaded tensors come from more than one place (the checkpoint read in
    place, converted tensors written once to an offload folder, tensors computed in memory)
    hands the engine one of these. ``prefetch`` and ``close`` go to every store that has them.

    Example:
        >>> stores = WeightStores([{"a": torch.zeros(1)}, {"a": torch.ones(1), "b": torch.ones(2)}])
        >>> sorted(stores), stores["a"].tolist(), len(stores)
        (['a', 'b'], [0.0], 2)
    """

    def __init__(self, stores: Iterable[Mapping[str, torch.Tensor]]) -> None:
        self.stores = list(stores)
        self._where: dict[str, Mapping[str, torch.Tensor]] = {}
        for store in reversed(self.stores):
            self._where.update(dict.fromkeys(store, store))

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._where[name][name]

    def __iter__(self) -> Iterator[str]:
        seen: set[str] = set()
        for store in self.stores:
            for name in store:
                if name not in seen:
                    seen.add(name)
                    yield name

    def __len__(self) -> int:
        return len(self._where)

    def __contains__(self, name: object) -> bool:
        return name in self._where

    def info(self, name: str) -> TensorInfo:
        """The `TensorInfo` of ``name`` in the file store holding it."""
        return self._where[name].info(name)  # type: ignore[attr-defined]

    def packed(self, name: str) -> Any:
        """A packed weight's parts, from the store holding it (None: plain, or not known there)."""
        store = self._where.get(name)
        packed = getattr(store, "packed", None)
        return packed(name) if packed is not None else None

    def stored_nbytes(self, name: str) -> int | None:
        """Bytes of a packed weight's parts, from the store holding it (None: a plain tensor)."""
        stored = getattr(self._where.get(name), "stored_nbytes", None)
        return stored(name) if stored is not None else None  # type: ignore[no-any-return]

    def verify(self, names: Iterable[str] | None = None) -> None:
        """Check each file store's files behind ``names`` are unchanged."""
        for store in self.stores:
            check = getattr(store, "verify", None)
            if check is not None:
                check(None if names is None else [n for n in names if self._where.get(n) is store])

    def identity(self, name: str) -> tuple[int, int] | None:
        """The file ``name`` is read from (see `LazyWeights.identity`); None for a store
        that holds no files."""
        held = getattr(self._where[name], "identity", None)
        return None if held is None else held(name)

    def prefetch(self, names: Iterable[str]) -> None:
        """Page-cache hints, passed to each file store for its names."""
        grouped: dict[int, tuple[Mapping[str, torch.Tensor], list[str]]] = {}
        for name in names:
            store = self._where.get(name)
            if store is not None:
                grouped.setdefault(id(store), (store, []))[1].append(name)
        for store, chosen in grouped.values():
            hint = getattr(store, "prefetch", None)
            if hint is not None:
                hint(chosen)

    def close(self) -> None:
        """Close every store that can be closed."""
        for store in self.stores:
            close = getattr(store, "close", None)
            if close is not None:
                close()

    def __enter__(self) -> WeightStores:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
