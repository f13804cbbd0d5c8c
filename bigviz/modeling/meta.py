"""Build models without allocating their weights: the ``meta`` device.

Example:
    >>> import torch.nn as nn
    >>> with init_empty_weights():
    ...     model = nn.Sequential(*[nn.Linear(10000, 10000) for _ in range(1000)])  # 100B params
    >>> model[0].weight.device.type
    'meta'
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn as nn

__all__ = ["init_empty_weights", "init_on_device"]


@contextmanager
def init_empty_weights(include_buffers: bool = False) -> Iterator[None]:
    """Create every parameter built inside the block on the ``meta`` device (no memory).

    Buffers stay on the CPU with real values unless ``include_buffers=True`` (a rotary
    embedding's ``inv_freq``, computed in ``__init__``, is then still usable). Ties made in
    ``__init__`` (``self.head.weight = self.emb.weight``) survive, unlike accelerate's.

    Example:
        >>> import torch.nn as nn
        >>> class M(nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.emb, self.head = nn.Embedding(10, 4), nn.Linear(4, 10, bias=False)
        ...         self.head.weight = self.emb.weight
        >>> with init_empty_weights():
        ...     m = M()
        >>> m.head.weight is m.emb.weight
        True
    """
    with init_on_device(torch.device("meta"), include_buffers=include_buffers):
        yield


@contextmanager
def init_on_device(device: torch.device | str, include_buffers: bool = False) -> Iterator[None]:
    """Create every parameter (and buffer, if ``include_buffers``) built inside the block on
    ``device``.

    With ``include_buffers=True`` this is torch's own device context (``with device:``): every
    tensor made in the block is made there, and nothing of ``nn.Module`` is patched. Without
    it, parameters only are moved, by wrapping ``nn.Module.register_parameter`` for the block
    (as accelerate does; put back on exit, even after an error).

    Example:
        >>> import torch.nn as nn
        >>> with init_on_device("meta", include_buffers=True):
        ...     bn = nn.BatchNorm1d(4)
        >>> bn.running_mean.device.type
        'meta'
    """
    device = torch.device(device)
    if include_buffers:
        with device:  # tensors are born on the device: ties made in __init__ are kept as they are
            yield
        return
    original = nn.Module.register_parameter

    def register_parameter(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        original(module, name, param)
        # A parameter already on the target device is kept as the same object: re-wrapping it
        # (as accelerate does) would break ties assigned in __init__.
        if param is not None and param.device != device:
            kwargs = dict(param.__dict__)
            kwargs["requires_grad"] = param.requires_grad
            param_cls = type(module._parameters[name])
            module._parameters[name] = param_cls(param.to(device), **kwargs)

    nn.Module.register_parameter = register_parameter  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = original  # type: ignore[method-assign]
