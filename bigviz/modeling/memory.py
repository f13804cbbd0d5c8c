"""Measure what a run holds: the tensors a cache keeps per device, and the peak of the
tensors a step allocates (a tensor-allocation tracker), to check predictions against.

:class:`TensorTracker` is a ``TorchDispatchMode``: every tensor an operator returns is
counted once per storage, from the moment it is made until Python drops its last
reference. It works on any device (CPU included, where torch keeps no memory statistics)
and sees what the model's code allocates, not the allocator's caching. Buffers allocated
inside a single kernel (a matmul's workspace) are not seen.

Example:
    >>> import torch
    >>> with TensorTracker() as tracker:
    ...     a = torch.ones(1000)          # 4000 bytes live
    ...     b = a * 2                     # 8000 bytes live: the peak
    ...     del a
    ...     c = b + 1                     # 8000 again
    >>> tracker.peak, tracker.live
    (8000, 8000)
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
import weakref
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

__all__ = [
    "TensorTracker",
    "RunMeasurement",
    "measure_generate",
    "cache_tensors",
    "cache_bytes_by_device",
    "module_states",
    "output_cache",
    "storage_key",
]


def storage_key(tensor: torch.Tensor) -> tuple[str, int]:
    """Which memory a tensor lives in: its device and its storage's address."""
    return (str(tensor.device), tensor.untyped_storage().data_ptr())


class TensorTracker(TorchDispatchMode):
    """Counts the bytes of the storages made inside the block while they are alive.

    Attributes:
        peak: the most bytes alive at once, over the whole block.
        live: bytes alive now.
        events: ``(allocation id, +bytes or -bytes)`` in order, for :meth:`peak_without`.
    """

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self.events: list[tuple[int, int]] = []
        self._ids = itertools.count()
        self._storages: dict[tuple[str, int], list[int]] = {}  # key -> [alloc id, bytes, refs]
        self._seen: set[int] = set()  # ids of tensor objects already counted

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        # a view or an in-place result shares an input's storage: new memory only if the
        # input's storage was itself made in the block (a weight's transpose is not)
        inputs = {
            storage_key(t)
            for t in tree_leaves((args, kwargs))
            if isinstance(t, torch.Tensor) and t.device.type != "meta"
        }
        for tensor in tree_leaves(out):
            if isinstance(tensor, torch.Tensor):
                self._track(tensor, inputs)
        return out

    def _track(self, tensor: torch.Tensor, inputs: set[tuple[str, int]]) -> None:
        if id(tensor) in self._seen or tensor.device.type == "meta":
            return
        key = storage_key(tensor)
        entry = self._storages.get(key)
        if entry is None:
            if key in inputs:
                return
            nbytes = tensor.untyped_storage().nbytes()
            entry = self._storages[key] = [next(self._ids), nbytes, 0]
            self._add(entry[0], nbytes)
        entry[2] += 1
        self._seen.add(id(tensor))
        weakref.finalize(tensor, self._release, key, id(tensor))

    def _release(self, key: tuple[str, int], obj_id: int) -> None:
        self._seen.discard(obj_id)
        entry = self._storages.get(key)
        if entry is None:
            return
        entry[2] -= 1
        if entry[2] == 0:
            del self._storages[key]
            self._add(entry[0], -entry[1])

    def _add(self, alloc: int, nbytes: int) -> None:
        self.events.append((alloc, nbytes))
        self.live += nbytes
        self.peak = max(self.peak, self.live)

    def live_ids(self, tensors: Iterable[torch.Tensor]) -> set[int]:
        """Allocation ids of the (still alive) storages behind ``tensors``."""
        keys = {storage_key(t) for t in tensors}
        return {entry[0] for key, entry in self._storages.items() if key in keys}

    def peak_without(self, excluded: set[int]) -> int:
        """The peak had the allocations ``excluded`` never been made (e.g. the KV cache a
        step leaves behind, to see the step's transient memory alone)."""
        live = peak = 0
        for alloc, nbytes in self.events:
            if alloc not in excluded:
                live += nbytes
                peak = max(peak, live)
        return peak


def cache_tensors(cache: Any) -> Iterator[torch.Tensor]:
    """Every tensor a KV cache holds: a transformers ``Cache`` (attention layers' keys and
    values, linear-attention layers' conv and recurrent states, an ``EncoderDecoderCache``'s
    self- and cross-attention caches) or a bigviz ``KVCache``. Bookkeeping scalars (0-d
    tensors such as a sliding layer's window) are not cache."""
    seen: set[int] = set()
    for obj in _cache_parts(cache, 0):
        if id(obj) not in seen and obj.ndim and obj.numel():
            seen.add(id(obj))
            yield obj


def _cache_parts(obj: Any, depth: int) -> Iterator[torch.Tensor]:
    """The tensors inside a cache object: its public attributes, lists and dicts, recursively."""
    if isinstance(obj, torch.Tensor):
        yield obj
        return
    if depth > 6 or obj is None or isinstance(obj, (str, bytes, int, float, bool, torch.device, torch.dtype)):
        return
    if isinstance(obj, dict):
        values: list[Any] = list(obj.values())
    elif isinstance(obj, (list, tuple)):
        values = list(obj)
    elif hasattr(obj, "__dict__") and not isinstance(obj, torch.nn.Module) and not callable(obj):
        values = [v for k, v in vars(obj).items() if not k.startswith("_") and k != "config"]
    else:
        return
    for value in values:
        yield from _cache_parts(value, depth + 1)


def module_states(model: torch.nn.Module) -> dict[tuple[str, str], torch.Tensor]:
    """Plain tensor attributes of a model's modules (not parameters or buffers): where an
    architecture that keeps its recurrent state on its modules (RecurrentGemma) keeps it.
    Compare two snapshots to see what a run left there."""
    out = {}
    for name, module in model.named_modules():
        for attr, value in vars(module).items():
            if isinstance(value, torch.Tensor) and not attr.startswith("_") and value.ndim:
                out[(name, attr)] = value
    return out


def cache_bytes_by_device(cache: Any, extra: Iterable[torch.Tensor] = ()) -> dict[str, int]:
    """Bytes of memory a cache holds on each device, each storage counted once and whole
    (a view that keeps a larger tensor alive counts the larger tensor: that is the memory
    it holds).

    Example:
        >>> import torch
        >>> from bigviz.models import KVCache
        >>> cache = KVCache()
        >>> _ = cache.update(0, torch.zeros(1, 2, 3, 4), torch.zeros(1, 2, 3, 4))
        >>> cache_bytes_by_device(cache)
        {'cpu': 192}
    """
    out: dict[str, int] = {}
    seen: set[tuple[str, int]] = set()
    for tensor in [*cache_tensors(cache), *extra]:
        key = storage_key(tensor)
        if key not in seen:
            seen.add(key)
            out[str(tensor.device)] = out.get(str(tensor.device), 0) + tensor.untyped_storage().nbytes()
    return out


@dataclass(frozen=True)
class RunMeasurement:
    """What one ``generate`` held, measured.

    Attributes:
        cache_bytes: bytes the KV cache (or recurrent state) holds per device at the end,
            the states a model keeps on its modules included.
        cache_tokens: tokens the cache holds (``None`` for a cache without a length).
        prefill_peak: the most bytes the prefill step had alive at once (cache included).
        prefill_activations: the same peak without the cache's storages: the step's
            transient memory (what a plan's ``activations`` predicts).
        cache_peak: the most the cache held per device after any forward (a sliding
            layer holds the whole prompt from the prefill until its first decode step).
    """

    cache_bytes: dict[str, int]
    cache_tokens: int | None
    prefill_peak: int
    prefill_activations: int
    cache_peak: dict[str, int] = field(default_factory=dict)


def measure_generate(
    model: torch.nn.Module, input_ids: torch.Tensor, max_new_tokens: int, **generate_kwargs: Any
) -> RunMeasurement:
    """Run ``model.generate`` and measure its cache and its prefill (first forward).

    Works for transformers models (the cache comes back with ``return_dict_in_generate``)
    and for bigviz's reference models (the cache is the ``cache`` their forward is given).
    States a model keeps on its modules (tensors a run set as plain attributes) count as
    cache. For an encoder-decoder the prefill starts with the encoder's forward.

    Example:
        >>> import torch
        >>> from bigviz.models import build
        >>> run = measure_generate(build("gpt-tiny").eval(), torch.zeros(1, 5, dtype=torch.long), 3)
        >>> run.cache_tokens, run.cache_bytes  # 2 layers x (k + v) x 7 tokens x 32 wide x 4 bytes
        (7, {'cpu': 3584})
    """
    seen: dict[str, Any] = {}
    peak: dict[str, int] = {}
    states_before = module_states(model)

    def held(cache: Any) -> dict[str, int]:
        states = [t for key, t in module_states(model).items() if states_before.get(key) is not t]
        return cache_bytes_by_device(cache, states)

    def before(module: torch.nn.Module, args: Any, kwargs: dict[str, Any]) -> None:
        if "tracker" not in seen:
            seen["tracker"] = TensorTracker().__enter__()
        seen.setdefault("cache", kwargs.get("cache"))

    def after(module: torch.nn.Module, args: Any, kwargs: dict[str, Any], out: Any) -> None:
        now = kwargs.get("cache") if _is_reference(model) else output_cache(out)
        for device, nbytes in held(now).items():
            peak[device] = max(peak.get(device, 0), nbytes)
        tracker = seen.get("tracker")
        if tracker is None or "peak" in seen:
            return
        tracker.__exit__(None, None, None)
        cache = seen["cache"] if seen["cache"] is not None else output_cache(out)
        seen["cache"] = cache
        seen["peak"] = tracker.peak
        seen["activations"] = tracker.peak_without(tracker.live_ids(list(cache_tensors(cache))))

    hooks = [
        model.register_forward_pre_hook(before, with_kwargs=True),
        model.register_forward_hook(after, with_kwargs=True),
    ]
    encoder = model.get_encoder() if getattr(getattr(model, "config", None), "is_encoder_decoder", False) else None
    if encoder is not None:  # generate runs the encoder before the first forward: the prefill starts there
        hooks.append(encoder.register_forward_pre_hook(before, with_kwargs=True))
    try:
        with torch.no_grad():
            out = (
                model.generate(input_ids, max_new_tokens, **generate_kwargs)
                if _is_reference(model)
                else model.generate(
                    input_ids, max_new_tokens=max_new_tokens, return_dict_in_generate=True, **generate_kwargs
                )
            )
    finally:
        for hook in hooks:
            hook.remove()
        if "tracker" in seen and "peak" not in seen:
            seen["tracker"].__exit__(None, None, None)
    cache = seen.get("cache") if _is_reference(model) else output_cache(out)
    final = held(cache)
    for device, nbytes in final.items():
        peak[device] = max(peak.get(device, 0), nbytes)
    return RunMeasurement(final, _cache_length(cache), seen["peak"], seen["activations"], peak)


def _is_reference(model: torch.nn.Module) -> bool:
    return type(model).__module__.startswith("bigviz.models")


def output_cache(out: Any) -> Any:
    """The cache a model's output (or ``generate``'s) carries, under any of its names."""
    for name in ("cache", "past_key_values", "cache_params"):
        cache = getattr(out, name, None)
        if cache is not None:
            return cache
    return None


def _cache_length(cache: Any) -> int | None:
    if hasattr(cache, "seq_len"):
        return int(cache.seq_len)
    try:
        return int(cache.get_seq_length())
    except (ValueError, AttributeError, StopIteration):  # a cache of recurrent states only
        return None
