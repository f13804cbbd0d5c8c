"""Pages of this process's memory and of the page cache: read in, fault in, drop, check.

What the engine's fetchers, the loader's hints and the disk probe ask of the kernel, in one
place, through one ``ctypes`` handle on libc (Python's ``mmap.madvise`` only reaches a
mapping Python made; these addresses belong to tensors):

* :func:`populate` (``MADV_POPULATE_READ``): read a mapped range in now, at disk speed, and
  map it. A hint alone (``WILLNEED``) is served when the kernel likes: measured here, 1.5 s
  after hinting a cold 1.4 GB range reading it still took 0.1 to 0.8 s; faulting it in page
  by page took 1.6 s; populating took 0.85 s;
* :func:`prefault` (``MADV_POPULATE_WRITE``): fault fresh anonymous memory in with one call.
  A read into fresh memory otherwise takes one fault per 4 KiB page, which on a virtual
  machine costs more than the read: 7.2 GB read into fresh memory by 4 threads ran at
  0.45-0.55 GB/s, and at 1.05-1.31 GB/s with each piece prefaulted first;
* :func:`hugepages` (``MADV_HUGEPAGE``): back a buffer made for ``O_DIRECT`` reads with
  transparent huge pages. A 2 MiB page is one physical run, so a read request covers up to the
  device's largest request, where 4 KiB pages cap it at ``max_segments`` pages (254 here:
  1 MiB) unless the pages happen to lie side by side. Measured here
  (``bench/studies/huge_pages.py``, alternated, page cache dropped), 16 MiB ``O_DIRECT`` reads
  by 4 threads into a buffer made once: 1.96-2.49 GB/s and 0.006-0.011 system CPU-seconds per
  GB with huge pages, 0.97-2.05 GB/s and 0.042-0.064 with 4 KiB pages. First touch costs more
  (a 2 MiB page zeroed at once: reads into fresh memory, each piece faulted in first, ran at
  0.67-0.88 GB/s against 0.90-1.29), so it pays for memory read into many times (the ring),
  not for memory read into once (the resident copy). :func:`huge_anonymous` makes such a
  buffer;
* :func:`willneed`: the hint, 128 KiB at a time (one call reads at most the device's
  read-ahead window and silently drops the rest);
* :func:`discard` (``MADV_DONTNEED``): unmap the pages of a private, clean mapping (a later
  access reads the file again: never a wrong value);
* :func:`page_residency` / :func:`cached_pages` (``mincore``): which pages of a range, or of
  a file, are in memory, reading nothing;
* :func:`drop_file_pages` (``posix_fadvise(DONTNEED)``): evict a file's pages from the page
  cache;
* :func:`release_free_heap` (glibc's ``malloc_trim``): give the C heap's free pages back.

Where the kernel cannot (not Linux; ``POPULATE_*`` before 5.14) the calls return ``False``,
``None`` or 0 and are not tried again; nothing raises for it.

Example:
    >>> import mmap, ctypes
    >>> block = mmap.mmap(-1, 4 * PAGE)
    >>> address = ctypes.addressof(ctypes.c_char.from_buffer(block))
    >>> prefault(address, 4 * PAGE) in (True, False), len(page_residency(address, 4 * PAGE) or b"....")
    (True, 4)
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import mmap
import os
import sys
from typing import Any

__all__ = [
    "PAGE",
    "populate",
    "prefault",
    "hugepages",
    "huge_anonymous",
    "HUGE_PAGE",
    "willneed",
    "discard",
    "page_residency",
    "cached_pages",
    "drop_file_pages",
    "available",
    "release_free_heap",
]

PAGE = mmap.PAGESIZE
MADV_WILLNEED = 3
MADV_DONTNEED = 4
MADV_POPULATE_READ = 22  # Linux 5.14+
MADV_POPULATE_WRITE = 23  # Linux 5.14+
MADV_HUGEPAGE = 14
HUGE_PAGE = 2 * 2**20  # a transparent huge page on x86-64 and most arm64 kernels
WILLNEED_CHUNK = 128 * 1024
_LOW_BIT = bytes(b & 1 for b in range(256))  # mincore: other bits are reserved, keep "resident" only


class _Libc:
    """``madvise``, ``mincore``, ``mmap`` and ``munmap`` of libc (Linux); ``None`` elsewhere."""

    def __init__(self) -> None:
        self.libc: Any = None
        self.works = {MADV_POPULATE_READ: False, MADV_POPULATE_WRITE: False}
        if not sys.platform.startswith("linux"):
            return
        try:
            libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        except OSError:
            return
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        libc.madvise.restype = ctypes.c_int
        libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
        libc.mmap.restype = ctypes.c_void_p
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        self.libc = libc
        self.works = {MADV_POPULATE_READ: True, MADV_POPULATE_WRITE: True}

    def madvise(self, address: int, length: int, advice: int) -> bool:
        return self.libc is not None and self.libc.madvise(address, length, advice) == 0

    def populate(self, address: int, length: int, advice: int) -> bool:
        """``madvise(advice)`` over the pages of ``[address, address + length)``; False when it
        fails, and never tried again where the kernel does not know it (EINVAL: before 5.14)."""
        if not self.works[advice] or length <= 0:
            return False
        begin = address - address % PAGE
        if self.madvise(begin, address + length - begin, advice):
            return True
        if ctypes.get_errno() == errno.EINVAL:  # an older kernel; other errors may pass (EINTR, EAGAIN)
            self.works[advice] = False
        return False


_LIBC = _Libc()


def populate(address: int, length: int) -> bool:
    """Read ``[address, address + length)`` of a file mapping in now (at disk speed, mapped).
    False where the kernel cannot: the compute thread then faults the pages in itself."""
    return _LIBC.populate(address, length, MADV_POPULATE_READ)


def prefault(address: int, length: int) -> bool:
    """Fault ``[address, address + length)`` of this process's anonymous memory in now, in one
    call (see the module docstring for why). False where the kernel cannot: the read that
    follows then faults the pages in itself."""
    return _LIBC.populate(address, length, MADV_POPULATE_WRITE)


def hugepages(address: int, length: int) -> bool:
    """Ask for transparent huge pages over the whole :data:`HUGE_PAGE` s inside ``[address,
    address + length)`` of this process's anonymous memory, before it is first touched (see
    the module docstring for why). False where the kernel cannot or the range holds no whole
    huge page; with THP set to ``never`` the kernel accepts and keeps 4 KiB pages. A hint: the
    bytes are the same either way."""
    begin = -(-address // HUGE_PAGE) * HUGE_PAGE
    end = (address + length) // HUGE_PAGE * HUGE_PAGE
    return end > begin and _LIBC.madvise(begin, end - begin, MADV_HUGEPAGE)


def huge_anonymous(nbytes: int) -> tuple[mmap.mmap, int]:
    """A private anonymous mapping with room for ``nbytes`` from a :data:`HUGE_PAGE` boundary,
    huge pages asked for (:func:`hugepages`), not yet touched: ``(the mapping, the offset of
    that boundary in it)``. Close the mapping when done (no view of it may be left).

    Example:
        >>> block, skip = huge_anonymous(3 * 2**20)
        >>> (ctypes.addressof(ctypes.c_char.from_buffer(block)) + skip) % HUGE_PAGE, len(block) - skip >= 3 * 2**20
        (0, True)
        >>> block.close()
    """
    private = {"flags": mmap.MAP_PRIVATE} if hasattr(mmap, "MAP_PRIVATE") else {}  # shared memory: no THP
    block = mmap.mmap(-1, nbytes + HUGE_PAGE, **private)
    start = ctypes.addressof(ctypes.c_char.from_buffer(block))  # the view goes at once: close() may run
    skip = -start % HUGE_PAGE
    hugepages(start + skip, nbytes)
    return block, skip


def willneed(address: int, length: int) -> None:
    """Ask the kernel to read ``[address, address + length)`` of a mapping (a hint, queued and
    returned from at once), ``WILLNEED_CHUNK`` bytes per call so the whole range is read on any
    device. Errors are ignored: it is a hint."""
    if _LIBC.libc is None or length <= 0:
        return
    start = address - address % PAGE
    end = address + length
    for chunk in range(start, end, WILLNEED_CHUNK):
        _LIBC.madvise(chunk, min(WILLNEED_CHUNK, end - chunk), MADV_WILLNEED)


def _whole_pages(address: int, length: int) -> tuple[int, int]:
    """``(first page, bytes)`` of every page ``[address, address + length)`` touches."""
    first = address - address % PAGE
    last = -(-(address + length) // PAGE) * PAGE
    return first, last - first


def discard(address: int, length: int) -> int:
    """Unmap every page ``[address, address + length)`` touches (``MADV_DONTNEED``); returns
    the bytes dropped (0 when it failed). For a private, clean file mapping (checkpoint weights
    are never written): a later access reads the file again."""
    first, size = _whole_pages(address, length)
    return size if size and _LIBC.madvise(first, size, MADV_DONTNEED) else 0


def page_residency(address: int, length: int) -> bytes | None:
    """One byte per page ``[address, address + length)`` touches: 1 in memory, else 0 (None
    where unknown: not Linux, an empty range, an address not mapped).

    Example:
        >>> page_residency(0, 0) is None
        True
    """
    if _LIBC.libc is None or length <= 0:
        return None
    first, size = _whole_pages(address, length)
    status = ctypes.create_string_buffer(size // PAGE)
    if _LIBC.libc.mincore(first, size, status) != 0:
        return None
    return status.raw.translate(_LOW_BIT)


def cached_pages(path: str | os.PathLike[str], offset: int = 0, length: int | None = None) -> bytes | None:
    """One byte per page of ``path[offset:offset + length]``: 1 if in the page cache, else 0.

    Asks ``mincore`` on a fresh read-only mapping of the file, which reads nothing. None where
    that is not possible (not Linux, an empty range).

    Example:
        >>> import tempfile, pathlib
        >>> p = pathlib.Path(tempfile.mkdtemp()) / "x"; _ = p.write_bytes(b"a" * 10000)
        >>> len(cached_pages(p))
        3
    """
    size = os.stat(path).st_size
    begin = offset - offset % PAGE
    end = size if length is None else min(size, offset + length)
    if _LIBC.libc is None or end <= begin:
        return None
    fd = os.open(path, os.O_RDONLY)
    try:
        libc = _LIBC.libc
        address = libc.mmap(None, end - begin, mmap.PROT_READ, mmap.MAP_SHARED, fd, begin)
        if address in (None, ctypes.c_void_p(-1).value):
            return None
        try:
            return page_residency(address, end - begin)
        finally:
            libc.munmap(address, end - begin)
    finally:
        os.close(fd)


def drop_file_pages(
    file: str | os.PathLike[str] | int, offset: int = 0, length: int = 0, *, flush: bool = True
) -> bool:
    """Evict ``file[offset:offset + length]`` (``length`` 0: to the end) from the page cache:
    the next read of those bytes comes from the disk. ``file`` is a path or an open descriptor.
    ``flush``: write its dirty pages first (only clean pages can be dropped; the fetchers pass
    ``False`` for checkpoint files read in place, which are never dirty). Returns False where it could not (no ``posix_fadvise``,
    an error): dropping is a courtesy to the page cache, never needed for correctness.

    Example:
        >>> import tempfile, pathlib
        >>> p = pathlib.Path(tempfile.mkdtemp()) / "x"; _ = p.write_bytes(b"a" * 10000)
        >>> drop_file_pages(p) in (True, False)
        True
    """
    if not hasattr(os, "posix_fadvise"):
        return False
    if isinstance(file, int):
        return _advise_dontneed(file, offset, length, flush)
    try:
        fd = os.open(file, os.O_RDONLY)
    except OSError:
        return False
    try:
        return _advise_dontneed(fd, offset, length, flush)
    finally:
        os.close(fd)


def _advise_dontneed(fd: int, offset: int, length: int, flush: bool) -> bool:
    if flush:
        with contextlib.suppress(OSError):
            os.fsync(fd)  # dirty pages cannot be dropped: write them first (a no-op when clean)
    try:
        os.posix_fadvise(fd, offset, length, os.POSIX_FADV_DONTNEED)
    except OSError:
        return False
    return True


def available() -> bool:
    """True where ``madvise`` and ``mincore`` can be called (Linux)."""
    return _LIBC.libc is not None


def release_free_heap() -> None:
    """Give the C heap's free pages back to the system (glibc's ``malloc_trim``; elsewhere a
    no-op).

    Why: glibc serves large allocations from its heap once a large block has been freed (its
    mmap threshold rises to 32 MiB), so a loop that makes a big temporary and keeps a smaller
    result (quantizing weights one by one: float temporaries, int8 results) leaves the freed
    temporaries as holes between the results, counted in the process's memory: quantizing
    gpt2-large to int8 peaked at 2.9x the int8 bytes without this, at their size with it.

    Example:
        >>> release_free_heap()
    """
    trim = getattr(_LIBC.libc, "malloc_trim", None) if _LIBC.libc is not None else None  # musl has none
    if trim is not None:
        trim(0)
