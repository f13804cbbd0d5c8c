"""What ``/proc`` says about this process: memory fields, file mappings, mounted devices.

One parser each, for everyone: the memory reports (``RssAnon``, ``VmRSS``: what the UI, the
benches and the tests measure with), the fetchers that find where a memory-mapped tensor lies
in its file (:class:`FileMaps`), the disk probe that names the device it measured
(:func:`mount_of`). Where there is no ``/proc`` (not Linux) each answers "unknown": ``None``,
an empty map, 0.

Example:
    >>> fields = status_fields("VmRSS", "RssAnon")
    >>> fields is None or fields["VmRSS"] >= fields["RssAnon"] > 0
    True
"""

from __future__ import annotations

import bisect
import contextlib
import errno
import os
import stat
from collections.abc import Sequence
from pathlib import Path

__all__ = [
    "status_fields",
    "FileMaps",
    "mapped_file_bytes",
    "mount_of",
    "fd_path",
    "identity",
    "held_descriptor",
    "open_identified",
    "disk_read_bytes",
    "io_accounting",
    "thread_times",
    "mount_holding",
]

MapRow = tuple[int, int, int, str, tuple[int, int]]  # (start, end, file offset, path, (device, inode))


def status_fields(*fields: str) -> dict[str, int] | None:
    """Fields of ``/proc/self/status`` in bytes (``VmRSS``, ``RssAnon``, ``RssFile``, ...);
    None where there is no such file or one of the fields is missing."""
    return _status(fields)


def _status(fields: Sequence[str]) -> dict[str, int] | None:
    try:
        with open("/proc/self/status") as f:
            values = {k: v for k, _, v in (line.partition(":") for line in f)}
        return {name: int(values[name].split()[0]) * 1024 for name in fields}
    except (OSError, KeyError, ValueError):
        return None


def _map_rows() -> list[MapRow]:
    """The file-backed mappings of this process (``/proc/self/maps`` rows naming a path)."""
    rows = []
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                parts = line.split(maxsplit=5)
                if len(parts) == 6 and parts[5].startswith("/"):
                    start, end = (int(x, 16) for x in parts[0].split("-"))
                    major, minor = (int(x, 16) for x in parts[3].split(":"))
                    file = (os.makedev(major, minor), int(parts[4]))
                    rows.append((start, end, int(parts[2], 16), parts[5].rstrip("\n"), file))
    except (OSError, ValueError):
        pass  # not Linux: nothing is file-backed as far as we can tell
    return rows


class FileMaps:
    """The file-backed mappings of this process, read from ``/proc/self/maps`` when made.

    A snapshot: mappings come and go (an address may be mapped to another file later), so
    take a new one for each batch of lookups.

    Example:
        >>> FileMaps().find(0) is None
        True
    """

    def __init__(self) -> None:
        rows = sorted(_map_rows())
        self._rows, self._starts = rows, [r[0] for r in rows]
        self._held: dict[tuple[int, int], str | None] = {}

    def held(self, want: tuple[int, int]) -> str | None:
        """:func:`held_descriptor` of ``want``, looked up once per snapshot."""
        if want not in self._held:
            self._held[want] = held_descriptor(want)
        return self._held[want]

    @property
    def rows(self) -> list[MapRow]:
        """``(start, end, file offset, path, (device, inode))`` of every file mapping, by address."""
        return list(self._rows)

    def find(self, address: int) -> MapRow | None:
        """``(start, end, file offset, path, (device, inode))`` of the mapping holding
        ``address``, or None (the path ends in `` (deleted)`` for a file replaced or removed
        since it was mapped)."""
        i = bisect.bisect_right(self._starts, address) - 1
        if i >= 0 and address < self._rows[i][1]:
            return self._rows[i]
        return None


def mapped_file_bytes() -> int:
    """Bytes of regular files mapped into this process (0 where ``/proc`` is missing)."""
    return sum(end - start for start, end, _, path, _file in _map_rows() if not path.startswith(("/dev", "/proc")))


def fd_path(fd: int) -> str | None:
    """A path that opens the very file descriptor ``fd`` holds (``/proc/self/fd/N``), even if
    its name was replaced since; None where there is no ``/proc`` (then open by name).

    Example:
        >>> import os
        >>> r, w = os.pipe()
        >>> fd_path(r) in (f"/proc/self/fd/{r}", None)
        True
        >>> os.close(r); os.close(w)
    """
    return f"/proc/self/fd/{fd}" if os.path.isdir("/proc/self/fd") else None


def mount_of(major: int, minor: int) -> str:
    """``"fstype source mountpoint"`` of the device ``major:minor`` (from
    ``/proc/self/mountinfo``; ``""`` where unknown).

    Example:
        >>> isinstance(mount_of(0, 0), str)
        True
    """
    device = f"{major}:{minor}"
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return ""
    for line in lines:
        left, _, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if len(fields) >= 5 and fields[2] == device and len(tail) >= 2:
            return f"{tail[0]} {tail[1]} {fields[4]}"
    return ""


def identity(st: os.stat_result) -> tuple[int, int]:
    """``(device, inode)``: which file a descriptor or path is, whatever it is called now."""
    return st.st_dev, st.st_ino


def held_descriptor(want: tuple[int, int]) -> str | None:
    """``/proc/self/fd/N`` for a descriptor of this process open on the file ``want``
    (``(device, inode)``), or None. Opening that path opens the same file, whatever its name
    now (renamed, moved away or unlinked)."""
    try:
        numbers = os.listdir("/proc/self/fd")
    except OSError:
        return None
    for number in numbers:
        path = f"/proc/self/fd/{number}"
        with contextlib.suppress(OSError):
            st = os.stat(path)
            if stat.S_ISREG(st.st_mode) and identity(st) == want:
                return path
    return None


def open_identified(path: str, want: tuple[int, int] | None, flags: int = 0, *, name: str | None = None) -> int:
    """A descriptor open on the file ``want`` (``(device, inode)``; None: whatever ``path``
    names), read-only with ``flags``: ``path`` itself while it names that file, else a
    descriptor this process already holds on it (:func:`held_descriptor`).

    Raises:
        OSError: ``path`` names another file now and no descriptor holds the one wanted,
            naming ``name`` (default: ``path``).
    """
    fd = os.open(path, os.O_RDONLY | flags)
    if want is None or os.fstat(fd).st_ino == want[1]:  # the inode alone: /proc/self/maps and stat may
        return fd  # name a file's device differently (overlayfs); a replacement cannot share the inode
    os.close(fd)
    held = held_descriptor(want)
    if held is not None:
        with contextlib.suppress(OSError):
            fd = os.open(held, os.O_RDONLY | flags)
            if identity(os.fstat(fd)) == want:
                return fd
            os.close(fd)
    raise OSError(
        errno.ESTALE,
        f"{name or path}: replaced since the model mapped it, and nothing holds the file it mapped any "
        "more; load the model again",
    )


# ---- what a timing demonstration reads (bigviz.teaching) ------------------------------
def _proc_field(path: str, field: str) -> int:
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return 0


def disk_read_bytes(thread: int | None = None) -> int:
    """Bytes read from a disk by this process, or by one of its threads (a native thread id);
    0 where ``/proc`` does not say."""
    return _proc_field(f"/proc/self/task/{thread}/io" if thread else "/proc/self/io", "read_bytes")


def thread_times(thread: int) -> tuple[float, float]:
    """``(seconds on a core, seconds waiting for a core)`` of a thread of this process (a
    native thread id, ``threading.get_native_id()``); ``(0.0, 0.0)`` where unknown."""
    try:
        with open(f"/proc/self/task/{thread}/schedstat") as f:
            on_core, waiting, _ = map(int, f.read().split())
    except (OSError, ValueError):
        return 0.0, 0.0
    return on_core / 1e9, waiting / 1e9


def mount_holding(path: str | os.PathLike[str]) -> tuple[str, str]:
    """``(device, filesystem type)`` of the mount holding ``path`` (``("", "")`` if unknown).

    Example:
        >>> mount_holding("/")[1] != "" or not os.path.exists("/proc/self/mounts")
        True
    """
    try:
        with open("/proc/self/mounts") as f:
            mounts = [line.split()[:3] for line in f]
    except OSError:
        return "", ""
    real = os.path.realpath(path)
    inside = [m for m in mounts if len(m) == 3 and (real == m[1] or real.startswith(m[1].rstrip("/") + "/"))]
    device, _, fstype = max(inside, key=lambda m: len(m[1]), default=("", "", ""))
    return device, fstype


def io_accounting() -> bool:
    """Whether this kernel counts a process's disk reads (``/proc/self/io``)."""
    return os.path.exists("/proc/self/io")
