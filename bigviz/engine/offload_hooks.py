"""The hooks a dispatch attaches: move arguments, stream offloaded units in, offload whole models.

* :class:`AlignDevicesHook` moves a module's inputs to its execution device; on the root
  (``io_same_device``) it also brings the outputs back to the device of the first input and
  tells the prefetch scheduler where a forward starts and ends.
* :class:`OffloadHook` sits on one offload unit: before ``forward`` it puts the unit's
  fetched tensors in its slots, after it points them back at ``meta`` placeholders (no copy
  back: the store still has them). It runs the unit under ``no_grad``: offloaded weights are
  for inference. When autograd would be needed (grad mode on, and an input or one of the
  unit's weights requires grad), the outputs carry a guard whose backward raises, so
  training through offloaded weights fails loudly instead of silently missing gradients.
* :class:`CpuOffload` / :class:`UserCpuOffloadHook` keep a whole model on the CPU until it is
  called (accelerate's ``cpu_offload_with_hook`` pipeline chaining).

Example:
    >>> import torch
    >>> from bigviz.engine.hooks import add_hook_to_module
    >>> layer = add_hook_to_module(torch.nn.Linear(2, 2), AlignDevicesHook("cpu", io_same_device=True))
    >>> layer(torch.ones(1, 2)).device
    device(type='cpu')
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor, nn

from bigviz.engine.devices import DeviceLike, any_tensor, find_device, map_tensors, send_to_device, torch_device
from bigviz.engine.hooks import ModelHook
from bigviz.modeling.budgets import default_execution_device
from bigviz.engine.scheduler import Scheduler
from bigviz.engine.binding import BoundUnit
from bigviz.engine.weights import as_slot_value, get_slot, meta_like, set_slot
from bigviz.modeling.packed import clone

__all__ = [
    "AlignDevicesHook",
    "OffloadHook",
    "CpuOffload",
    "UserCpuOffloadHook",
    "OffloadedTrainingError",
    "ForwardLock",
]

_requires_grad = torch._C.TensorBase.requires_grad.__get__  # C-level read, past a subclass's Python hooks


class OffloadedTrainingError(RuntimeError):
    """Backward reached a module whose weights are offloaded (inference only)."""


class ForwardLock:
    """One dispatched model's lock: a hooked forward holds it from ``pre_forward`` to
    ``post_forward`` (or its error), so two threads calling the model take turns.

    Offload hooks swap weights into shared modules and back to ``meta``; two forwards at once
    would see each other's half-set modules. The lock is re-entrant (a forward calls nested
    hooked modules), and each hook releases only what it acquired in its own thread (an
    earlier hook failing before this one's ``pre_forward`` ran releases nothing).

    Example:
        >>> lock, hook = ForwardLock(), object()
        >>> lock.acquire(hook); lock.release(hook); lock.release(hook)  # the 2nd: nothing held
    """

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._held = threading.local()

    def acquire(self, hook: object) -> None:
        self._lock.acquire()
        counts = self._counts()
        counts[id(hook)] = counts.get(id(hook), 0) + 1

    def release(self, hook: object) -> None:
        counts = self._counts()
        if counts.get(id(hook), 0):
            counts[id(hook)] -= 1
            self._lock.release()

    def _counts(self) -> dict[int, int]:
        counts = getattr(self._held, "counts", None)
        if counts is None:
            counts = self._held.counts = {}
        return counts


class AlignDevicesHook(ModelHook):
    """Move inputs to ``execution_device``; at the root, outputs back to the caller's device.

    Args:
        execution_device: Where the module runs (None: leave the inputs where they are).
        io_same_device: Return outputs on the device of the first input tensor.
        skip_keys: Keyword arguments never moved (a KV cache object, ``past_key_values``).
        scheduler: The prefetch scheduler to tell where a whole forward starts and ends.

    Example:
        >>> hook = AlignDevicesHook("cpu", skip_keys=["cache"])
        >>> hook.pre_forward(None, 1, cache="kept")
        ((1,), {'cache': 'kept'})
    """

    def __init__(
        self,
        execution_device: DeviceLike | None = None,
        *,
        io_same_device: bool = False,
        skip_keys: Iterable[str] | str | None = None,
        scheduler: Scheduler | None = None,
    ) -> None:
        self.execution_device = None if execution_device is None else torch_device(execution_device)
        self.io_same_device = io_same_device
        self.skip_keys = frozenset([skip_keys] if isinstance(skip_keys, str) else skip_keys or ())
        self.scheduler = scheduler
        self._input_devices: list[torch.device | None] = []

    def __repr__(self) -> str:
        return f"AlignDevicesHook(execution_device={self.execution_device}, io_same_device={self.io_same_device})"

    def pre_forward(self, module: nn.Module, *args: Any, **kwargs: Any) -> tuple[tuple, dict]:
        if self.io_same_device:
            self._input_devices.append(find_device((args, kwargs), skip_keys=self.skip_keys))
        if self.scheduler is not None:
            self.scheduler.begin_pass()
        if self.execution_device is not None:
            args = send_to_device(args, self.execution_device)
            kwargs = send_to_device(kwargs, self.execution_device, skip_keys=self.skip_keys)
        return args, kwargs

    def post_forward(self, module: nn.Module, output: Any) -> Any:
        self._end(completed=True)
        device = self._input_devices.pop() if self.io_same_device else None
        if device is not None:
            output = send_to_device(output, device, skip_keys=self.skip_keys)
        return output

    def on_forward_error(self, module: nn.Module) -> None:
        self._end(completed=False)
        if self.io_same_device and self._input_devices:
            self._input_devices.pop()

    def _end(self, *, completed: bool) -> None:
        if self.scheduler is not None:
            self.scheduler.end_pass(completed=completed)


class _NoBackward(torch.autograd.Function):
    """Identity on the way forward; raises on the way back (names the offloaded module)."""

    @staticmethod
    def forward(ctx: Any, anchor: Tensor, output: Tensor, name: str) -> Tensor:  # type: ignore[override]
        ctx.module_name = name
        return output.clone()  # a fresh tensor: later in-place ops on it stay legal

    @staticmethod
    def backward(ctx: Any, *grads: Tensor) -> Any:  # type: ignore[override]
        raise OffloadedTrainingError(
            f"backward reached {ctx.module_name!r}, whose weights are offloaded: offloaded modules "
            "run without autograd (inference only), so gradients cannot flow through or into them. "
            "Fix: run inference under torch.no_grad() / torch.inference_mode(), or keep every "
            "module you train on a GPU or the CPU in the device map."
        )


_ANCHOR = torch.ones((), requires_grad=True)  # makes guarded outputs part of the graph


def _guard(output: Any, name: str) -> Any:
    def wrap(t: Tensor) -> Tensor:
        return _NoBackward.apply(_ANCHOR, t, name) if t.is_floating_point() else t

    return map_tensors(output, wrap)


class OffloadHook(ModelHook):
    """Materialise one offload unit for its forward, then point it back at ``meta``.

    Args:
        unit: The unit (its slots, placeholders and stores).
        scheduler: Hands out the unit's tensors (prefetched when it can).
        skip_keys: Keyword arguments not inspected for ``requires_grad``.

    Example:
        >>> import torch
        >>> from bigviz.engine.binding import bound_units
        >>> from bigviz.engine.fetchers.cpu import CpuFetcher
        >>> layer = torch.nn.Linear(2, 2)
        >>> unit = bound_units(layer, {"": "disk"}, main_device="cpu")[0]
        >>> unit.sources = {k: {"weight": torch.eye(2), "bias": torch.zeros(2)} for k in unit.slots}
        >>> hook = OffloadHook(unit, Scheduler([unit], CpuFetcher(), prefetch=False))
        >>> _ = hook.init_hook(layer)
        >>> layer.weight.is_meta, layer.weight.device  # no data; used on the CPU
        (True, device(type='cpu'))
    """

    no_grad = True

    def __init__(
        self,
        unit: BoundUnit,
        scheduler: Scheduler,
        *,
        skip_keys: Iterable[str] = (),
        restored: dict[tuple[int, str], Tensor] | None = None,
        lock: ForwardLock | None = None,
    ) -> None:
        self.unit = unit
        self.scheduler = scheduler
        self.skip_keys = frozenset(skip_keys)
        self.lock = lock if lock is not None else ForwardLock()  # the dispatch's: one forward at a time
        # shared by the hooks of one dispatch: a tensor two units use is restored as one object
        self.restored = restored if restored is not None else {}
        self._guards: list[bool] = []

    def __repr__(self) -> str:
        return f"OffloadHook({self.unit!r})"

    def init_hook(self, module: nn.Module) -> nn.Module:
        self.unit.reset()  # from now on the unit's weights live in its store only
        return module

    def pre_forward(self, module: nn.Module, *args: Any, **kwargs: Any) -> tuple[tuple, dict]:
        self.lock.acquire(self)
        self._guards.append(self._needs_guard(args, kwargs))
        tensors = self.scheduler.acquire(self.unit)
        grads = self.unit.grads
        for key, slots in self.unit.slots.items():
            # the flags the model declares now (some kernels choose their path by requires_grad,
            # nn.MultiheadAttention even under no_grad; model.requires_grad_(False) changes them):
            # the same numbers as in memory. Read through torch's C getter, not the placeholder's
            # Python attribute lookup (a forward reads it once per key).
            wants = key in grads and _requires_grad(grads[key])
            value = as_slot_value(tensors[key], slots[0][2], requires_grad=wants)
            for slot in slots:
                set_slot(slot, value)
        return args, kwargs

    def _needs_guard(self, args: tuple, kwargs: dict) -> bool:
        if not torch.is_grad_enabled():
            return False
        if any(_requires_grad(p) for p in self.unit.grads.values()):
            return True
        return any_tensor((args, kwargs), lambda t: t.requires_grad, skip_keys=self.skip_keys)

    def post_forward(self, module: nn.Module, output: Any) -> Any:
        try:
            self.unit.reset()
            self.scheduler.release(self.unit)  # issue 12: a streaming fetcher drops the unit's pages
            if self._guards.pop():
                output = _guard(output, self.unit.name)
            return output
        finally:
            self.lock.release(self)

    def on_forward_error(self, module: nn.Module) -> None:
        try:
            self.unit.reset()
            if self._guards:
                self._guards.pop()
        finally:
            self.lock.release(self)

    def detach_hook(self, module: nn.Module) -> nn.Module:
        """Put back in memory (on the CPU) the weights that were in memory before dispatch;
        the others go back to plain ``meta`` (no longer reporting an execution device)."""
        for slot, placeholder in self.unit.placeholders.values():
            if get_slot(slot) is placeholder:
                plain = self.restored.get((id(placeholder), "meta"))
                if plain is None:
                    plain = self.restored[(id(placeholder), "meta")] = meta_like(placeholder, slot[2])
                set_slot(slot, plain)
        for key in self.unit.materialised:
            store = self.unit.sources[key]
            for slot in self.unit.slots[key]:
                placeholder = self.unit.placeholders[(id(slot[0]), slot[1])][1]
                value = self.restored.get((id(store), key))
                if value is None:
                    data = store[key] if self.unit.storage == "cpu" else clone(store[key])  # files close next
                    value = as_slot_value(data, slot[2], requires_grad=placeholder.requires_grad)
                    self.restored[(id(store), key)] = value
                set_slot(slot, value)
        return module


class UserCpuOffloadHook:
    """What :func:`~bigviz.engine.big_modeling.cpu_offload_with_hook` returns.

    Example:
        >>> import torch
        >>> model = torch.nn.Linear(2, 2)
        >>> hook = UserCpuOffloadHook(model, CpuOffload("cpu"))
        >>> hook.offload()  # moves the model back to the CPU
    """

    def __init__(self, model: nn.Module, hook: CpuOffload) -> None:
        self.model = model
        self.hook = hook

    def offload(self) -> None:
        """Move the model back to the CPU (until its next forward)."""
        self.hook.init_hook(self.model)

    def remove(self) -> None:
        """Remove the hook; the model stays where it is."""
        from bigviz.engine.hooks import remove_hook_from_module

        remove_hook_from_module(self.model)


class CpuOffload(ModelHook):
    """Keep a model on the CPU; move it to ``execution_device`` when called, and leave it there.

    Args:
        execution_device: Where the model runs.
        prev_module_hook: The previous model's hook in a pipeline: offloaded just before
            this model runs.

    Example:
        >>> import torch
        >>> from bigviz.engine.hooks import add_hook_to_module
        >>> model = add_hook_to_module(torch.nn.Linear(2, 2), CpuOffload("cpu"))
        >>> model(torch.ones(1, 2)).shape
        torch.Size([1, 2])
    """

    def __init__(
        self, execution_device: DeviceLike | None = None, prev_module_hook: UserCpuOffloadHook | None = None
    ) -> None:
        self.execution_device = torch_device(
            execution_device if execution_device is not None else default_execution_device()
        )
        self.prev_module_hook = prev_module_hook
        self.on_device = False
        self.calls = 0

    def init_hook(self, module: nn.Module) -> nn.Module:
        self.on_device = False
        return module.to("cpu")

    def pre_forward(self, module: nn.Module, *args: Any, **kwargs: Any) -> tuple[tuple, dict]:
        self.calls += 1
        previous = self.prev_module_hook
        if previous is not None and previous.hook.on_device:
            previous.offload()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        if not self.on_device:
            module.to(self.execution_device)
            self.on_device = True
        return send_to_device(args, self.execution_device), send_to_device(kwargs, self.execution_device)
