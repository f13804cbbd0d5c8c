"""Direct reads: file bytes straight into memory bigviz owns, past the page cache.

``O_DIRECT`` makes the disk write into the reader's buffer: the page cache neither holds a
second copy nor evicts anything for it (what a model larger than RAM needs: its resident part
copied once, its streamed units read per forward). Its one rule: the file offset, the length
and the buffer's address are multiples of the logical block size, :data:`ALIGN`. A range that
does not start or end on a block is read as the whole blocks around it, into a buffer with
room for them (:func:`block_room`), in :data:`CHUNK`-byte :class:`Piece` s (:func:`pieces_of`)
that several threads read at once (:func:`read_piece`). Where the filesystem refuses
``O_DIRECT`` (tmpfs; ``EINVAL``), a buffered read whose pages are dropped behind it.

Example:
    >>> import mmap, os, tempfile, ctypes
    >>> path = os.path.join(tempfile.mkdtemp(), "w.bin")
    >>> _ = open(path, "wb").write(bytes(range(256)) * 64)
    >>> head, size = block_room(100, 50, direct=True)
    >>> buffer = mmap.mmap(-1, size)  # page aligned: O_DIRECT accepts it
    >>> address = ctypes.addressof(ctypes.c_char.from_buffer(buffer))
    >>> [read_piece(p, True)[0] for p in pieces_of(path, 100, 50, address, direct=True)]
    [50]
    >>> buffer[head:head + 3]
    b'def'
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass

from bigviz.osio.pages import drop_file_pages, prefault
from bigviz.osio.procfs import open_identified

__all__ = ["ALIGN", "CHUNK", "Piece", "block_room", "pieces_of", "read_piece", "open_file"]

ALIGN = 4096  # O_DIRECT: offsets, lengths and addresses, multiples of the logical block size
CHUNK = 16 * 2**20  # bytes per read request (a multiple of ALIGN)


@dataclass(frozen=True)
class Piece:
    """One read: file bytes ``[offset, offset + upto)`` into ``address`` (``need`` of them
    belong to the range asked for); with ``O_DIRECT``, ``offset``, ``length`` (the room at
    ``address``) and ``address`` are multiples of ``ALIGN``. ``identity``: the file
    (``(device, inode)``) the bytes must come from, which ``path`` may no longer name (a file
    replaced by rename: then a descriptor this process holds on it is read); ``name``: the
    file in messages."""

    path: str
    offset: int
    length: int
    upto: int
    need: int
    address: int
    identity: tuple[int, int] | None = None
    name: str = ""


def block_room(offset: int, length: int, *, direct: bool) -> tuple[int, int]:
    """``(head, size)``: where file bytes ``[offset, offset + length)`` start in the buffer
    that receives them, and that buffer's size. With ``direct`` the buffer covers the whole
    ``ALIGN`` blocks around them (``O_DIRECT`` reads whole blocks).

    Example:
        >>> block_room(100, 50, direct=True), block_room(100, 50, direct=False)
        ((100, 4096), (0, 50))
    """
    head = offset % ALIGN if direct else 0
    return head, (-(-(head + length) // ALIGN) * ALIGN if direct else length)


def pieces_of(
    path: str,
    offset: int,
    length: int,
    address: int,
    *,
    direct: bool,
    chunk: int = CHUNK,
    identity: tuple[int, int] | None = None,
) -> list[Piece]:
    """The reads that put file bytes ``[offset, offset + length)`` at ``address + head``
    (:func:`block_room`), ``chunk`` bytes each; ``address`` is a multiple of ``ALIGN``;
    ``identity``: the file they must come from (see :class:`Piece`)."""
    head, size = block_room(offset, length, direct=direct)
    out = []
    for i in range(0, size, chunk):
        upto, room = min(chunk, head + length - i), min(chunk, size - i)
        need = upto - (head if i == 0 else 0)
        out.append(Piece(path, offset - head + i, room, upto, need, address + i, identity, path))
    return out


def read_piece(piece: Piece, direct: bool) -> tuple[int, bool]:
    """Read one piece, its memory prefaulted first: ``(its bytes of the range, read with
    O_DIRECT)``. ``direct``: try ``O_DIRECT`` first (a filesystem refusing it gets a buffered
    read, dropped from the page cache behind it).

    Raises:
        OSError: the file ended before the piece (changed or truncated since it was mapped).
    """
    prefault(piece.address, piece.length)
    if direct and hasattr(os, "O_DIRECT"):
        with contextlib.suppress(OSError):  # EINVAL: no O_DIRECT on this filesystem; buffered below
            read_into(piece, os.O_DIRECT)
            return piece.need, True
    read_into(piece, 0)
    return piece.need, False


def read_into(piece: Piece, flags: int) -> None:
    """``piece.upto`` bytes read; an ``O_DIRECT`` read (``flags``) asks for whole blocks
    (``length``): the last one may end past the file, and is then short. A buffered read tells
    the kernel not to read ahead past the piece and drops its pages after (the bytes are ours
    now: the page cache need not keep a second copy)."""
    view = memoryview((ctypes.c_char * piece.length).from_address(piece.address)).cast("B")
    ask = piece.length if flags else piece.upto
    fd = open_identified(piece.path, piece.identity, flags, name=piece.name)  # the file mapped, even if renamed
    try:
        if not flags and hasattr(os, "posix_fadvise"):  # no kernel read-ahead past the piece: it would stay cached
            with contextlib.suppress(OSError):
                os.posix_fadvise(fd, piece.offset, piece.length, os.POSIX_FADV_RANDOM)
        got = 0
        while got < piece.upto:
            n = os.preadv(fd, [view[got:ask]], piece.offset + got)
            if n <= 0:
                raise OSError(
                    f"{piece.name or piece.path}: short read at byte {piece.offset + got}: the file is shorter than when "
                    "the model was loaded (changed or truncated since); restore it, or load the model again"
                )
            got += n
        if not flags:
            drop_file_pages(fd, piece.offset, piece.length, flush=False)  # whole pages
    finally:
        os.close(fd)


@contextlib.contextmanager
def open_file(path: str | os.PathLike[str], *, direct: bool) -> Iterator[int]:
    """A read-only descriptor of ``path``, ``O_DIRECT`` when ``direct``, closed on exit.

    Raises:
        OSError: ``EINVAL`` where ``O_DIRECT`` does not exist (macOS, Windows) or the
            filesystem refuses it; the usual errors of ``open``.
    """
    if direct and not hasattr(os, "O_DIRECT"):
        raise OSError(errno.EINVAL, f"O_DIRECT is not available on this platform ({sys.platform})", str(path))
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECT if direct else 0))
    try:
        yield fd
    finally:
        os.close(fd)
