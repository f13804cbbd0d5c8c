"""The operating system, at the bottom of the layers: pages, direct reads, ``/proc``.

Python's standard library reaches most of what bigviz asks of the kernel, but not all:
``madvise`` on an address a tensor owns, ``mincore``, a read straight into memory torch
allocated. This package is the one place that calls them (through one ``ctypes`` handle on
libc), so the loaders, fetchers, probe and memory reports above share one tested set of
helpers instead of a wrapper each. Standard library only: no torch, nothing of bigviz.

* :mod:`bigviz.osio.pages`: populate, prefault, discard and check pages of this process's
  memory (``madvise``, ``mincore``), and drop a file's pages from the page cache;
* :mod:`bigviz.osio.direct`: ``O_DIRECT`` opens and reads into a given address
  (:data:`~bigviz.osio.direct.ALIGN`: the alignment those reads need);
* :mod:`bigviz.osio.procfs`: ``/proc/self/status`` fields, ``/proc/self/maps`` mappings and
  ``/proc/self/mountinfo`` devices.

Everything degrades where the kernel cannot (not Linux, a kernel before 5.14): a hint is not
given, a check answers "unknown", nothing raises for it.

Example:
    >>> from bigviz.osio import ALIGN, FileMaps, status_fields
    >>> ALIGN, FileMaps().find(0) is None, sorted(status_fields("VmRSS") or {"VmRSS": 0})
    (4096, True, ['VmRSS'])
"""

from __future__ import annotations

from bigviz.osio.direct import ALIGN, Piece, block_room, open_file, pieces_of, read_piece
from bigviz.osio.pages import (
    PAGE,
    cached_pages,
    discard,
    drop_file_pages,
    page_residency,
    populate,
    prefault,
    willneed,
)
from bigviz.osio.procfs import FileMaps, fd_path, mapped_file_bytes, mount_of, status_fields

__all__ = [
    "ALIGN",
    "PAGE",
    "Piece",
    "block_room",
    "pieces_of",
    "read_piece",
    "open_file",
    "populate",
    "prefault",
    "willneed",
    "discard",
    "page_residency",
    "cached_pages",
    "drop_file_pages",
    "FileMaps",
    "status_fields",
    "mapped_file_bytes",
    "mount_of",
    "fd_path",
]
