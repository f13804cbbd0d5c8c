"""The resident copy, made while the model runs its first forward.

A model larger than RAM keeps its "cpu" weights in anonymous memory (:mod:`bigviz.engine.resident`
says why) and streams the rest from disk. Reading the resident part before the first forward
and the streamed part during it reads the whole checkpoint once, but in two passes that do not
overlap: on this project's 2-core VM the dispatch of a 32.1 GB GPT at 2/3 of the RAM copied
15.8 GB in 26.6 s and the first forward then took 17.3 s, where the disk reads the whole 32.1 GB
in about 24 s. :class:`ResidentCopy` starts the copy and returns: its readers fill the resident
buffers in the order the forward needs them while the forward runs, the ring reads the streamed
units at the same time, and a forward pre-hook on each resident module waits until that
module's own bytes are in (and only those). The disk stays busy from the dispatch to the end of
the first forward.

What the forward sees is always correct: until its copy is done a tensor is still the
memory-mapped view of its file (the same bytes); the hooks only keep it from reading them twice
through page faults. A read that fails (a file truncated meanwhile) is raised at the next wait
(the next forward of a module still waiting, or :meth:`ResidentCopy.wait`), never lost. The copy
thread is not a daemon: a process that exits first waits for it (a daemon thread freeing tensors
during interpreter shutdown can abort the process).

Example:
    >>> import os, tempfile, torch
    >>> from bigviz.checkpoint.lazy import map_file
    >>> path = os.path.join(tempfile.mkdtemp(), "w.bin")
    >>> _ = open(path, "wb").write(torch.arange(2048.0).numpy().tobytes())
    >>> model = torch.nn.Sequential(torch.nn.Linear(32, 64, bias=False))
    >>> model[0].weight.data = map_file(path).view(torch.float32).view(64, 32)  # zero-copy, mapped
    >>> copy = ResidentCopy(model, ["0"], readers=2, progress=False)
    >>> _ = model(torch.ones(1, 32))  # waits for layer 0's bytes, then runs on the copy
    >>> report = copy.wait()
    >>> report.tensors, report.nbytes, model[0].weight[1, 0].item()
    (1, 8192, 32.0)
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from torch import Tensor, nn

from bigviz.checkpoint.progress import byte_bar
from bigviz.core.dispatch_plan import DispatchPlan
from bigviz.core.errors import StateError
from bigviz.core.stream_plan import StreamPlan
from bigviz.engine.fetchers.spans import FileMaps, FileSpan, can_open, file_span
from bigviz.engine.resident import (
    ResidentReport,
    _copy_mapped,
    make_resident,
    _copy_packed,
    _plain_tensors,
    _spans_pieces,
    _take_copies,
)
from bigviz.osio.direct import Piece, read_piece

__all__ = ["ResidentCopy", "start_resident_copy"]

Key = tuple[int, int]  # (address, length) of a mapped span


class ResidentCopy:
    """Copy ``model``'s memory-mapped CPU tensors into anonymous memory in a thread, the spans
    of ``modules`` (names, in the order the forward runs them) first; each of those modules
    waits, before its forward, for its own tensors only.

    Args:
        model: the dispatched model.
        modules: the resident modules whose forward waits for their bytes, in execution order.
        readers: threads reading (``O_DIRECT`` where the filesystem allows it).
        progress: show a progress bar.
        direct: try ``O_DIRECT`` first (else buffered reads dropped from the page cache).
        stream_follows: :meth:`show_stream` will be called (the dispatch, once its fetcher is
            made): the bar stays open for it even if the copy is done first.
    """

    def __init__(
        self,
        model: nn.Module,
        modules: Sequence[str],
        *,
        readers: int = 4,
        progress: bool = True,
        direct: bool = True,
        stream_follows: bool = False,
    ) -> None:
        maps = FileMaps()
        entries = [(m, a, k, t, p, file_span(t, maps, deleted=True)) for m, a, k, t, p in _plain_tensors(model)]
        self._entries = [e for e in entries if e[5] is not None]
        tops = {name: _module_or_none(model, name) for name in modules}
        owners = {id(m): i for i, name in enumerate(modules) if tops[name] is not None for m in tops[name].modules()}
        slots = {_slot(model, name): i for i, name in enumerate(modules) if tops[name] is None}  # a tensor's own key
        rank: dict[Key, int] = {}
        self._needs: dict[int, set[Key]] = {}
        for module, attr, *_, span in self._entries:
            key = (span.address, span.length)
            where = min(owners.get(id(module), len(modules)), slots.get((id(module), attr), len(modules)))
            rank[key] = min(rank.get(key, where), where)
        modules = [name for name in modules if tops[name] is not None]  # a tensor is read in its turn, not waited on
        for name in modules:
            top = model.get_submodule(name)
            mine = {id(m) for m in top.modules()}
            self._needs[id(top)] = {(s.address, s.length) for m, *_, s in self._entries if id(m) in mine}
        self._plain: dict[Key, list[tuple[nn.Module, str, str, Tensor, FileSpan]]] = {}
        self._packed: dict[int, tuple[set[Key], list[tuple[Any, ...]]]] = {}  # id(packed): its parts' spans, entries
        self._packed_of: dict[Key, set[int]] = {}
        for module, attr, kind, tensor, packed, span in self._entries:
            key = (span.address, span.length)
            if packed is None:
                self._plain.setdefault(key, []).append((module, attr, kind, tensor, span))
                continue
            keys, mine = self._packed.setdefault(id(packed), (set(), []))
            keys.add(key)
            mine.append((module, attr, kind, tensor, packed, span))
            self._packed_of.setdefault(key, set()).add(id(packed))
        unique = {(s.address, s.length): s for *_, s in self._entries}
        self._spans = sorted(unique.values(), key=lambda s: (rank[(s.address, s.length)], s.path, s.offset))
        self._total = sum(s.length for s in self._spans)
        self._done: set[Key] = set()
        self._error: BaseException | None = None
        self._report: ResidentReport | None = None
        self._stop = False
        self._cond = threading.Condition()
        self._bar = byte_bar(self._total, "resident copy", enabled=progress)
        self._bar_lock = threading.Lock()
        self._streamed = self._streamed_done = 0  # the first forward's streamed bytes, shown on the same bar
        self._first_done = self._copied = False
        self._known = not stream_follows  # whether the streamed reads are shown on the bar (the dispatch says)
        self._detach: Callable[[], object] | None = None
        self._first_hook = model.register_forward_hook(self._after_first)
        self._hooks = [
            model.get_submodule(name).register_forward_pre_hook(self._before)
            for name in modules
            if self._needs[id(model.get_submodule(name))]
        ]
        self._start = time.perf_counter()
        self._thread = threading.Thread(target=self._run, args=(readers, direct), name="bigviz-resident-copy")
        self._thread.start()

    @property
    def tensor_ids(self) -> set[int]:
        """``id()`` of each tensor the copy replaces (memory-mapped until its span is read)."""
        return {id(tensor) for _, _, _, tensor, _, _ in self._entries} | {
            id(packed) for *_, packed, _ in self._entries if packed is not None
        }

    # ---- the thread ---------------------------------------------------------------------
    def _run(self, readers: int, direct: bool) -> None:
        try:
            report = self._copy(readers, direct)
        except BaseException as err:  # raised to the caller at its next wait
            with self._cond:
                self._error = err
                self._cond.notify_all()
            self._close_bar(copied=True, streamed=True, known=True)
            return
        with self._cond:
            self._report = report
            self._cond.notify_all()
        self._close_bar(copied=True)

    # ---- the progress bar: the copy and the first forward's streamed reads ------------------
    def show_stream(self, streamed: int, fetcher: Any) -> None:
        """Show the bytes the first forward streams on the copy's bar (``streamed`` of them;
        ``fetcher`` tells each piece it reads through ``watch``): the bar then covers the
        whole checkpoint's one pass over the disk, and closes when both are done."""
        if streamed <= 0 or not hasattr(fetcher, "watch"):
            self._close_bar(known=True)  # nothing streamed to show: the bar is the copy's alone
            return
        with self._bar_lock:
            self._known = True
            self._streamed = streamed
            self._bar.total = self._total + streamed
            # no refresh: a forced display would show a bar the delay has not yet let tqdm show,
            # and tqdm's close skips the last display of a bar it never showed: it would stay
            # at the copy's share. The next update shows the new total and name.
            self._bar.set_description("resident copy + streamed", refresh=False)
            self._detach = lambda: fetcher.watch(None)
        self._streamed_read(fetcher.watch(self._streamed_read))  # what it read before the bar knew

    def _streamed_read(self, nbytes: int) -> None:
        with self._bar_lock:
            take = min(nbytes, self._streamed - self._streamed_done)
            if take > 0:
                self._bar.update(take)  # a closed bar ignores it
            self._streamed_done += max(0, take)
        if self._streamed_done >= self._streamed:
            self._close_bar(streamed=True)

    def _after_first(self, *_: Any) -> None:
        self._close_bar(streamed=True)  # the first forward is over: what it read is counted

    def _close_bar(self, *, copied: bool = False, streamed: bool = False, known: bool = False) -> None:
        """The bar closes once the copy is done and the first forward has streamed its part;
        the fetcher stops reporting then, and the first forward's hook goes."""
        with self._bar_lock:
            self._first_done |= streamed
            self._copied |= copied
            self._known |= known
            if not (self._copied and self._known and (self._first_done or not self._streamed)):
                return
            if self._detach is not None:
                self._detach()
                self._detach = None
            self._first_hook.remove()
            self._bar.close()

    def _copy(self, readers: int, direct: bool) -> ResidentReport:
        buffers: dict[Key, Tensor] = {}
        work: list[tuple[Key, Piece | None]] = []
        left: dict[Key, int] = {}
        for span in self._spans:
            key = (span.address, span.length)
            if not can_open(span):  # renamed away with no descriptor left: only the mapping has it
                buffers[key] = _copy_mapped(span)
                work.append((key, None))
                left[key] = 1
                continue
            buffer, pieces = _spans_pieces(span, direct)
            buffers[key] = buffer
            work += [(key, p) for p in pieces]
            left[key] = len(pieces)
        copies: dict[tuple[Any, ...], Tensor] = {}
        built: set[int] = set()
        direct_bytes = 0
        with ThreadPoolExecutor(max(1, readers), thread_name_prefix="bigviz-resident") as pool:
            results = pool.map(lambda item: self._read(item[1], direct), work)
            for (key, _), (need, was_direct) in zip(work, results):
                direct_bytes += need if was_direct else 0
                with self._bar_lock:
                    self._bar.update(need)
                left[key] -= 1
                if left[key] == 0:
                    self._settle(key, buffers, copies, built)
        return ResidentReport(len(self._spans), self._total, time.perf_counter() - self._start, direct_bytes)

    def _read(self, piece: Piece | None, direct: bool) -> tuple[int, bool]:
        if piece is None:
            return 0, False
        if self._stop:
            raise StateError("the resident copy was stopped (the model's hooks were removed)")
        return read_piece(piece, direct)

    def _settle(self, key: Key, buffers: dict[Key, Tensor], copies: dict, built: set[int]) -> None:
        """Span ``key`` is read: its plain tensors take the copy; a packed weight whose parts are
        all read is built again over them. Then the modules waiting on it may run."""
        with self._cond:
            self._done.add(key)
        _take_copies(self._plain.get(key, []), buffers, copies)
        for packed in sorted(self._packed_of.get(key, set()) - built):
            keys, entries = self._packed[packed]
            if keys <= self._done:
                _copy_packed(entries, buffers, copies)
                built.add(packed)
        with self._cond:
            self._cond.notify_all()

    # ---- the waits ----------------------------------------------------------------------
    def _before(self, module: nn.Module, args: Any) -> None:
        self._wait_for(self._needs.get(id(module), set()))

    def _wait_for(self, keys: set[Key]) -> None:
        with self._cond:
            while not keys <= self._done and self._error is None and self._report is None:
                self._cond.wait()
            if self._error is not None:
                raise self._error

    @property
    def done(self) -> bool:
        """True once every span is copied (or the copy failed)."""
        with self._cond:
            return self._report is not None or self._error is not None

    def wait(self) -> ResidentReport:
        """Wait for the whole copy; its report. The forward hooks are gone after it.

        Raises:
            OSError: a read failed (a file truncated since it was mapped, ...).
        """
        self._thread.join()
        self._close_bar(copied=True, streamed=True, known=True)
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        if self._error is not None:
            raise self._error
        assert self._report is not None
        return self._report

    def close(self) -> None:
        """Stop reading (the pieces not started are skipped) and wait for the thread; the
        tensors not copied stay memory-mapped (the same bytes)."""
        self._stop = True
        self._thread.join()
        self._close_bar(copied=True, streamed=True, known=True)
        for hook in self._hooks:
            hook.remove()
        self._hooks = []


def _module_or_none(model: nn.Module, name: str) -> nn.Module | None:
    """The submodule ``name`` names, or None where it names a parameter or buffer (a device map
    may place a tensor on its own: ``"final_logits_bias": "cpu"``, ``"model.norm.weight": "cpu"``)."""
    try:
        return model.get_submodule(name)
    except AttributeError:
        return None


def _slot(model: nn.Module, name: str) -> tuple[int, str]:
    """``(id(the module holding it), attribute)`` of the tensor ``name`` names."""
    parent, _, attr = name.rpartition(".")
    return id(model.get_submodule(parent)), attr


def start_resident_copy(
    model: nn.Module, plan: DispatchPlan, stream: StreamPlan, progress: bool
) -> tuple[ResidentCopy | ResidentReport | None, set[int]]:
    """The resident copy the stream plan asks for, and the ids of the tensors it replaces.

    With units streamed from disk (a model larger than RAM), the copy runs while the first
    forward does (:class:`~bigviz.engine.resident_copy.ResidentCopy`: one pass over the disk,
    each resident module waiting for its own bytes); with nothing streamed it is made here."""
    if stream.mode != "copy":
        return None, set()
    if not stream.streamed_bytes:
        return make_resident(model, readers=stream.readers, progress=progress), set()
    resident = [n for n, d in plan.device_map.items() if n and str(d) == "cpu"]
    copy = ResidentCopy(model, resident, readers=stream.readers, progress=progress, stream_follows=True)
    return copy, copy.tensor_ids
