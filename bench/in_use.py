"""The page cache of a machine in use, for ``bench/beyond_ram.py --memory in-use``.

The larger-than-RAM bench drops the page cache before each scenario so that the checkpoint is
read cold. On a virtual machine with free page reporting (``page_reporting.page_reporting_order``
on the kernel command line, a ``virtio_balloon`` driver: this project's VM) the drop has a second
effect: the ~20 GB it frees go back to the hypervisor within half a minute, and a process that
touches them again pays a trip to the host for every page, as CPU time of its own cores
(``bench/studies/fresh_memory.py``: 0.3-0.5 GiB/s, 1.9 CPU-seconds per GiB). A machine in use
does not look like that: its RAM holds the page cache of whatever ran before, and a process's
new memory is page cache the kernel reclaims, pages the host still backs (2.4 GiB/s and 0.42
CPU-seconds per GiB here, 2026-12-03, with 21 GiB of a file read through the page cache first).

``--memory in-use`` measures that machine: before each scenario the checkpoint's own pages are
evicted (the reads stay cold) and :func:`refill` reads a filler file, which the scenarios never
read, through the page cache until it holds about the RAM. Nothing in bigviz changes; the
bench's default (``--memory dropped``) stays the issue's protocol.

The filler is written once into the bench's work folder (:func:`ensure_filler`), starts with a
header that marks it as this bench's, and is reused while its size is right. A file of that
name without the header is never overwritten or removed.

Example:
    >>> import tempfile
    >>> from pathlib import Path
    >>> path = Path(tempfile.mkdtemp()) / FILLER_NAME
    >>> ensure_filler(path, 8 * CHUNK) > 0, path.stat().st_size == 8 * CHUNK
    (True, True)
    >>> ensure_filler(path, 8 * CHUNK)  # reused: nothing written
    0.0
    >>> refill(path, readers=2).nbytes == 8 * CHUNK
    True
"""

from __future__ import annotations

import errno
import os
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path

FILLER_NAME = "page-cache-filler"
CHUNK = 4 * 2**20  # bytes per read and per write
HEADER = b"bigviz bench page-cache filler (bench/in_use.py): safe to delete\n"
LEFT_FREE = 2 * 2**30  # RAM the filler leaves to the processes and the kernel


@dataclass(frozen=True)
class Refill:
    """One :func:`refill`: how many bytes were read and how long it took."""

    nbytes: int
    seconds: float


def filler_bytes(ram: int) -> int:
    """The filler's size for a machine of ``ram`` bytes: the RAM less :data:`LEFT_FREE`, in whole
    chunks (at least one)."""
    return max(CHUNK, (ram - LEFT_FREE) // CHUNK * CHUNK)


def is_ours(path: Path) -> bool:
    """Whether ``path`` is a filler this module wrote (it starts with :data:`HEADER`)."""
    try:
        with open(path, "rb") as f:
            return f.read(len(HEADER)) == HEADER
    except OSError:
        return False


def _refuse_foreign(path: Path) -> None:
    """Raise ``FileExistsError`` when ``path`` exists and is not a filler of this module's."""
    if path.exists() and not is_ours(path):
        raise FileExistsError(
            f"{path} exists and is not the bench's page-cache filler: move it away, or run with "
            "another --work folder (nothing was changed)"
        )


def ensure_filler(path: Path, nbytes: int) -> float:
    """Write the filler of ``nbytes`` at ``path`` unless one of that size is there; seconds spent
    writing (0.0 when reused). Written to a temporary name first and renamed, so a write that
    fails leaves no half filler.

    Raises:
        FileExistsError: ``path`` exists and is not a filler of this module's.
        OSError: the disk refused the write (no room): nothing is left behind.
    """
    _refuse_foreign(path)
    if path.exists() and path.stat().st_size == nbytes:
        return 0.0
    partial = path.with_name(path.name + ".partial")
    _refuse_foreign(partial)  # a partial of ours (a write killed midway) is written over, no other file
    block = (HEADER + b"\0" * CHUNK)[:CHUNK]
    zeros = bytes(CHUNK)
    start = time.perf_counter()
    try:
        with open(partial, "wb") as f:
            for at in range(0, nbytes, CHUNK):
                f.write((block if at == 0 else zeros)[: min(CHUNK, nbytes - at)])
            f.flush()
            os.fsync(f.fileno())
        os.replace(partial, path)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    return time.perf_counter() - start


def prepare(work: Path, ram: int) -> tuple[Path, float]:
    """The filler for a machine of ``ram`` bytes, in the folder ``work``: written there unless
    one of the right size is (:func:`ensure_filler`). Returns its path and the seconds spent
    writing it. The one place the bench and its studies get their filler from.

    Raises:
        OSError: ``ENOSPC`` when the disk lacks the room (checked first: nothing is written);
            what :func:`ensure_filler` raises.
        FileExistsError: a file of the filler's name there is not the bench's.
    """
    path, nbytes = work / FILLER_NAME, filler_bytes(ram)
    _refuse_foreign(path)  # named before the disk's room: that file is the thing to fix
    have = path.stat().st_size if path.is_file() else 0
    free = shutil.disk_usage(work).free
    if nbytes - have > free - LEFT_FREE:
        raise OSError(
            errno.ENOSPC,
            f"the page-cache filler needs {nbytes / 1e9:.1f} GB in {work} and the disk has "
            f"{(free + have) / 1e9:.1f} GB for it (keeping {LEFT_FREE // 2**30} GiB free): free some room, "
            "or measure without the filler",
        )
    return path, ensure_filler(path, nbytes)


def refill(path: Path, readers: int = 4) -> Refill:
    """Read the whole of ``path`` through the page cache, ``readers`` threads each on a
    contiguous part, into a buffer of their own reused for every read: what is already cached
    costs a copy, the rest a read from disk into page-cache pages.

    Raises:
        OSError: the file could not be read.
    """
    size = path.stat().st_size
    part = -(-size // readers // CHUNK) * CHUNK
    errors: list[BaseException] = []
    done = [0] * readers

    def read(i: int) -> None:
        buffer = bytearray(CHUNK)
        try:
            with open(path, "rb", buffering=0) as f:
                f.seek(i * part)
                left = max(0, min(part, size - i * part))
                while left > 0:
                    got = f.readinto(memoryview(buffer)[: min(CHUNK, left)])
                    if not got:
                        break
                    done[i] += got
                    left -= got
        except BaseException as err:
            errors.append(err)

    start = time.perf_counter()
    threads = [threading.Thread(target=read, args=(i,)) for i in range(readers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return Refill(sum(done), time.perf_counter() - start)
