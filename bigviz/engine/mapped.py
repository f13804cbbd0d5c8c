"""The files a dispatched model's CPU weights are memory-mapped from, checked before each forward.

Weights loaded zero-copy on the CPU are views of memory-mapped checkpoint files: reading a page
of a file truncated since makes the kernel send SIGBUS, which kills the process (Python cannot
recover from a fault in a kernel's inner loop: a signal handler returns to the same faulting
instruction). Offloaded units are checked when they are fetched; these weights are never
fetched, so :class:`MappedFiles` holds each file open (one descriptor: its stamp is read even
after a rename) with its stamp (device, inode, size, modification time) and the dispatch's root
hook calls :meth:`MappedFiles.verify` before every forward: one ``fstat`` per file, a change is
a :class:`~bigviz.core.errors.FetchError` naming the file and the modules reading it.

What it cannot catch: a file truncated *during* a forward (after the check), and models that
are not dispatched (``load_checkpoint_in_model`` alone: no hook runs before their forward).

Example:
    >>> import os, tempfile, torch
    >>> from bigviz.checkpoint.lazy import map_file
    >>> path = os.path.join(tempfile.mkdtemp(), "w.bin")
    >>> _ = open(path, "wb").write(bytes(8192))
    >>> layer = torch.nn.Linear(32, 64, bias=False)
    >>> layer.weight.data = map_file(path).view(torch.float32).view(64, 32)
    >>> files = MappedFiles.of(layer)
    >>> len(files), files.verify()
    (1, None)
    >>> os.truncate(path, 4096)
    >>> files.verify()  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    bigviz.core.errors.FetchError: ...w.bin: changed since the model mapped it (size 8192 -> 4096 bytes)...
    >>> files.close()
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field

from torch import nn

from bigviz.checkpoint.safetensors_io import file_stamp
from bigviz.core.errors import FetchError
from bigviz.engine.fetchers.spans import FileMaps, file_span, span_identity
from bigviz.osio.procfs import open_identified

__all__ = ["MappedFiles"]


@dataclass
class _File:
    path: str
    fd: int
    stamp: tuple[int, ...]
    modules: list[str] = field(default_factory=list)


class MappedFiles:
    """Each file the model's CPU tensors are mapped from, held open with its stamp."""

    def __init__(self, files: list[_File]) -> None:
        self._files = files

    @classmethod
    def of(cls, model: nn.Module, stamps: Iterable[tuple[int, ...]] = (), *, skip: Collection[int] = ()) -> MappedFiles:
        """The files ``model``'s CPU parameters and buffers are memory-mapped from.

        Args:
            model: the model (after its load and dispatch).
            stamps: stamps known from when the files were opened (a checkpoint index's), used
                for the files they identify (by device and inode); the others are stamped now.
            skip: ``id()`` of tensors left out (a resident copy running replaces them).
        """
        known = {stamp[:2]: stamp for stamp in stamps}
        maps, found = FileMaps(), {}
        for name, module in model.named_modules():
            tensors = [*module._parameters.values(), *module._buffers.values()]
            for tensor in tensors:
                if tensor is None or tensor.device.type != "cpu" or tensor.is_meta or id(tensor) in skip:
                    continue
                span = file_span(tensor, maps)
                if span is None:
                    continue
                key = span_identity(span) or (0, 0)
                if key not in found:
                    found[key] = _open(span.path, span_identity(span), known)
                entry = found[key]
                if entry is not None and (not entry.modules or entry.modules[-1] != name):
                    entry.modules.append(name or "<model>")
        return cls([f for f in found.values() if f is not None])

    def __len__(self) -> int:
        return len(self._files)

    def stamps(self) -> list[tuple[int, ...]]:
        """The stamps held (to carry them to a new :class:`MappedFiles` of the same model)."""
        return [f.stamp for f in self._files]

    def verify(self) -> None:
        """Check every file is as it was: one ``fstat`` each.

        Raises:
            FetchError: naming each file truncated or rewritten in place, and the modules whose
                weights are read from it.
        """
        problems = []
        for f in self._files:
            try:
                now = file_stamp(os.fstat(f.fd))
            except OSError as err:
                problems.append(f"{f.path}: cannot be checked ({err.strerror or err})")
                continue
            if now != f.stamp:
                what = f"size {f.stamp[2]} -> {now[2]} bytes" if now[2] != f.stamp[2] else "rewritten in place"
                shown = ", ".join(map(repr, f.modules[:4])) + (", ..." if len(f.modules) > 4 else "")
                problems.append(
                    f"{f.path}: changed since the model mapped it ({what}); weights of {shown} are read from it"
                )
        if problems:
            raise FetchError(
                "checkpoint files under the model's CPU weights (memory-mapped, zero copy) changed: "
                + "; ".join(problems)
                + ". Running the forward could crash the process (SIGBUS) or compute with other weights: "
                "restore the files, or load the model again"
            )

    def close(self) -> None:
        """Close the descriptors."""
        files, self._files = self._files, []
        for f in files:
            with contextlib.suppress(OSError):
                os.close(f.fd)


def _open(path: str, identity: tuple[int, int] | None, known: dict) -> _File | None:
    try:
        fd = open_identified(path, identity, getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return None  # no path or descriptor leads to it any more: nothing to compare with
    stamp = file_stamp(os.fstat(fd))
    return _File(path, fd, known.get(stamp[:2], stamp))
