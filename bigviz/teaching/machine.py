"""Linux facts a timing demonstration needs, each answering "unknown" elsewhere.

* :func:`disk_read_bytes`: bytes this process (or one thread) had the kernel read from a
  block device (``/proc/self/io``'s ``read_bytes``; page-cache hits do not count).
* :func:`thread_times`: seconds a thread spent on a core and waiting for one
  (``/proc/self/task/ID/schedstat``): the rest of its wall-clock time it was *blocked*, on a
  disk read or a lock, which other programs keeping the cores busy do not lengthen.
* :func:`mount_of`, :func:`read_ahead_kib`: the device and filesystem holding a path, and how
  far the kernel reads ahead of page faults on that device (``/sys/class/block``).
* :func:`drop_pages`: evict a checkpoint's tensors from the page cache
  (``posix_fadvise(DONTNEED)`` on their byte ranges: no privileges, and only those pages,
  where ``echo 3 > /proc/sys/vm/drop_caches`` would drop every program's files as root).

Example:
    >>> import threading
    >>> on_core, waiting = thread_times(threading.get_native_id())
    >>> on_core >= 0 and waiting >= 0 and disk_read_bytes() >= 0
    True
"""

from __future__ import annotations

import gc
import os
from collections.abc import Iterable
from pathlib import Path

from bigviz.checkpoint.index import CheckpointIndex
from bigviz.osio.pages import drop_file_pages
from bigviz.osio.procfs import disk_read_bytes, io_accounting, thread_times
from bigviz.osio.procfs import mount_holding as mount_of

__all__ = ["disk_read_bytes", "thread_times", "mount_of", "read_ahead_kib", "can_drop_pages", "drop_pages"]


def read_ahead_kib(device: str) -> int | None:
    """The kernel's read-ahead for a block device (``/dev/vda``, ``/dev/nvme0n1p1``: a disk or
    a partition, whose disk's queue holds the setting), in KiB; None if unknown."""
    if not device:
        return None
    node = Path("/sys/class/block") / os.path.basename(device)
    for queue in (node / "queue", node.resolve().parent / "queue"):
        try:
            return int((queue / "read_ahead_kb").read_text())
        except (OSError, ValueError):
            continue
    return None


def can_drop_pages(path: str | os.PathLike[str]) -> bool:
    """Whether :func:`drop_pages` can make the files under ``path`` cold: Linux's
    ``posix_fadvise`` and ``/proc/self/io`` (to check it worked), and a filesystem backed by a
    disk (tmpfs keeps its pages: there is no disk to read them back from)."""
    fstype = mount_of(path)[1]
    return hasattr(os, "posix_fadvise") and io_accounting() and fstype not in ("tmpfs", "ramfs", "")


def drop_pages(index: CheckpointIndex, names: Iterable[str] | None = None) -> int:
    """Evict the byte ranges of ``names`` (default: every tensor of ``index``) from the page
    cache, writing dirty pages first; returns the bytes of the ranges. Pages a process still
    has mapped stay (drop the model that maps them first: this collects garbage to help)."""
    gc.collect()
    total = 0
    for name in index.keys() if names is None else names:
        info = index.entries[name]
        begin, end = info.data_offsets or (0, 0)  # a torch pickle: the whole file
        drop_file_pages(info.file, begin, end - begin)
        total += info.nbytes
    return total
