"""Prefetching offloaded units: recorded order, background reads, errors reaching the caller."""

from __future__ import annotations

import ctypes
import errno

import threading
from collections.abc import Iterator, Mapping

import pytest
import torch
from torch import nn

from bigviz.engine.dispatch import dispatch_model
from bigviz.core.errors import FetchError
from bigviz.engine.fetchers.cpu import CpuFetcher
from bigviz.engine.scheduler import Scheduler
from bigviz.engine.binding import bound_units


class RecordingWeights(Mapping[str, torch.Tensor]):
    """A LazyWeights-like store: logs which thread read each key; can fail a key once."""

    def __init__(self, tensors: Mapping[str, torch.Tensor], *, fail: str | None = None) -> None:
        self.tensors = dict(tensors)
        self.fail = fail
        self.reads: list[tuple[str, str]] = []
        self.hints: list[tuple[str, ...]] = []
        self.lock = threading.Lock()

    def __getitem__(self, key: str) -> torch.Tensor:
        with self.lock:
            self.reads.append((key, threading.current_thread().name))
        if key == self.fail:
            self.fail = None  # fails once, like a flaky disk
            raise OSError("disk on fire")
        return self.tensors[key]

    def __contains__(self, key: object) -> bool:
        return key in self.tensors  # a look-up, not a read

    def __iter__(self) -> Iterator[str]:
        return iter(self.tensors)

    def __len__(self) -> int:
        return len(self.tensors)

    def prefetch(self, keys: list[str]) -> None:
        with self.lock:
            self.hints.append(tuple(keys))


class Shuffled(nn.Module):
    """Blocks defined a, b, c but run c, a, b: definition order is not execution order."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(torch.relu(self.c(x)))))


def dispatched(*, prefetch: bool = True, fail: str | None = None) -> tuple[nn.Module, RecordingWeights, nn.Module]:
    torch.manual_seed(0)
    reference = Shuffled().eval()
    weights = RecordingWeights(reference.state_dict(), fail=fail)
    with torch.device("meta"):
        model = Shuffled()
    dispatch_model(model, {"a": "disk", "b": "disk", "c": "disk"}, weights=weights, prefetch=prefetch)
    return model, weights, reference


def read_threads(weights: RecordingWeights) -> dict[str, set[str]]:
    threads: dict[str, set[str]] = {}
    for key, thread in weights.reads:
        threads.setdefault(key.split(".")[0], set()).add(thread)
    return threads


def test_execution_order_is_recorded_and_next_units_are_read_in_the_background():
    model, weights, reference = dispatched()
    x = torch.randn(2, 8)
    with torch.no_grad():
        assert torch.equal(model(x), reference(x))
        assert model._bigviz_dispatch.scheduler.order == ["c", "a", "b"]
        weights.reads.clear()
        assert torch.equal(model(x), reference(x))
    for handle in list(model._bigviz_dispatch.scheduler._pending.values()):
        handle.wait()  # the read-ahead for the next forward may still run when the machine is busy
    threads = read_threads(weights)
    assert sorted(threads) == ["a", "b", "c"]
    assert all(t.startswith("bigviz-prefetch") for ts in threads.values() for t in ts)  # all fetched ahead
    assert weights.hints == []  # everything is in memory already: no page-in work at all


def test_cold_tensors_are_hinted_and_paged_in(monkeypatch: pytest.MonkeyPatch):
    from bigviz.engine.fetchers import cpu

    weights = RecordingWeights({"w": torch.ones(3), "b": torch.zeros(3)})
    populated: list[int] = []
    monkeypatch.setattr(cpu, "paged_in", lambda t: bool(t.sum() == 0))  # "w" is cold
    monkeypatch.setattr(cpu, "populate", lambda address, length: populated.append(length))
    cpu.page_in(weights, {"w": weights.tensors["w"], "b": weights.tensors["b"]})
    assert weights.hints == [("w",)] and populated == [3 * 4]


def test_prefetch_off_reads_on_the_calling_thread_only():
    model, weights, reference = dispatched(prefetch=False)
    x = torch.randn(2, 8)
    with torch.no_grad():
        for _ in range(2):
            assert torch.equal(model(x), reference(x))
    assert {t for _, t in weights.reads} == {threading.current_thread().name}
    assert not weights.hints


def test_a_background_read_error_reaches_the_caller_and_the_model_recovers():
    model, weights, reference = dispatched(fail="a.weight")  # "a" is fetched ahead, while "c" runs
    x = torch.randn(2, 8)
    with torch.no_grad(), pytest.raises(FetchError) as info:
        model(x)
    message = str(info.value)
    assert "'a'" in message and "'a.weight'" in message and "disk on fire" in message
    assert isinstance(info.value.__cause__.__cause__, OSError)
    failed_in = [t for k, t in weights.reads if k == "a.weight"][0]
    assert failed_in.startswith("bigviz-prefetch")
    assert all(p.is_meta for p in model.parameters())  # nothing left half-set
    with torch.no_grad():
        assert torch.equal(model(x), reference(x))  # the read fails once; the next forward works
    assert model._bigviz_dispatch.scheduler.order == ["c", "a", "b"]


def test_a_synchronous_read_error_names_the_unit_too():
    model, _, _ = dispatched(prefetch=False, fail="c.bias")
    with torch.no_grad(), pytest.raises(FetchError, match=r"'c'.*'c\.bias'.*disk on fire"):
        model(torch.randn(1, 8))


def test_scheduler_keeps_at_most_two_fetches_ahead_and_closes():
    model = nn.Sequential(*[nn.Linear(2, 2) for _ in range(4)])
    units = bound_units(model, {str(i): "disk" for i in range(4)}, main_device="cpu")
    store = {k: v for k, v in model.state_dict().items()}
    for unit in units:
        unit.sources = dict.fromkeys(unit.slots, store)
    scheduler = Scheduler(units, CpuFetcher(), prefetch=True)
    for unit in units:  # no pass boundaries: the definition-order guess is used
        assert set(scheduler.acquire(unit)) == set(unit.slots)
        assert len(scheduler._pending) <= 2
    scheduler.close()
    assert not scheduler._pending


def test_a_failed_pass_does_not_fix_the_order():
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    units = bound_units(model, {"0": "disk", "1": "disk"}, main_device="cpu")
    for unit in units:
        unit.sources = dict.fromkeys(unit.slots, model.state_dict())
    with Scheduler(units, CpuFetcher(), prefetch=False) as scheduler:
        scheduler.begin_pass()
        scheduler.acquire(units[1])
        scheduler.end_pass(completed=False)
        assert scheduler.order == []
        scheduler.begin_pass()
        scheduler.acquire(units[1])
        scheduler.acquire(units[0])
        scheduler.end_pass()
        assert scheduler.order == ["1", "0"]


def test_page_residency_on_a_real_memory_mapped_file(tmp_path):
    from bigviz.checkpoint.index import CheckpointIndex
    from bigviz.checkpoint.lazy import LazyWeights
    from bigviz.checkpoint.save import save_sharded
    from bigviz.engine.fetchers import cpu

    folder = save_sharded({"w": torch.arange(50_000.0)}, tmp_path / "c", progress=False)
    with LazyWeights(CheckpointIndex.open(folder)) as weights:
        tensor = weights["w"]
        cpu.page_in(weights, {"w": tensor})
        assert cpu.paged_in(tensor)
        assert float(tensor[-1]) == 49_999.0


class _RecordingFetcher(CpuFetcher):
    """Records which units were started, in order; ``reads_on_release`` as asked."""

    def __init__(self, reads_on_release: bool) -> None:
        super().__init__()
        self.reads_on_release = reads_on_release
        self.started: list[str] = []

    def start(self, unit, *, background):  # type: ignore[no-untyped-def]
        self.started.append(unit.name)
        return super().start(unit, background=background)


@pytest.mark.parametrize("on_release", [True, False])
def test_a_release_starts_the_next_read_when_the_fetcher_frees_memory_there(on_release: bool) -> None:
    # resident units compute between the last streamed unit of one forward and the first of the
    # next: reads must not wait for the next streamed unit to start (issue 12)
    model = nn.Sequential(*[nn.Linear(2, 2) for _ in range(6)])
    units = bound_units(model, {str(i): "disk" for i in range(6)}, main_device="cpu")
    for unit in units:
        unit.sources = dict.fromkeys(unit.slots, model.state_dict())
    fetcher = _RecordingFetcher(on_release)
    with Scheduler(units, fetcher, prefetch=True, depth=2) as scheduler:
        for _ in range(2):
            scheduler.begin_pass()
            for unit in units:
                scheduler.acquire(unit)
                assert len(scheduler._pending) <= scheduler.depth + 1  # never more than depth + 1 ahead
                scheduler.release(unit)
                assert len(scheduler._pending) <= scheduler.depth + 1
            scheduler.end_pass()
        ahead = [h.unit.name for h in scheduler._pending.values()]
        # after the last unit: the next forward's first units are on their way before it starts
        assert ahead == (["0", "1", "2"] if on_release else ["0", "1"])
        assert fetcher.started.count("3") == 2  # each unit read once per forward, never twice


@pytest.mark.parametrize(("error", "stops"), [(errno.EINVAL, True), (errno.EAGAIN, False)])
def test_populate_gives_up_only_where_the_kernel_lacks_it(
    monkeypatch: pytest.MonkeyPatch, error: int, stops: bool
) -> None:
    import types

    from bigviz.osio import pages

    libc = pages._Libc()
    if libc.libc is None:
        pytest.skip("no libc madvise here")

    def refuse(address: int, length: int, advice: int) -> int:
        ctypes.set_errno(error)
        return -1

    monkeypatch.setattr(libc, "libc", types.SimpleNamespace(madvise=refuse))
    monkeypatch.setattr(pages, "_LIBC", libc)
    assert pages.populate(4096, 4096) is False and pages.prefault(4096, 4096) is False
    assert libc.works[pages.MADV_POPULATE_READ] is (not stops)
    assert libc.works[pages.MADV_POPULATE_WRITE] is (not stops)
