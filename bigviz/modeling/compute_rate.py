"""How fast this machine computes a forward through weights in RAM: the compute floor.

A streamed forward cannot be faster than its compute with every weight in RAM, so the cost
model (:mod:`bigviz.core.cost`) needs this machine's compute rate beside its disk bandwidth:
bytes of weights a forward computes through per second, for the tokens and threads of the
run. Measured on one block in RAM (its parameters' bytes / its forward's seconds, best of a
few): every block of a transformer costs the same, and one block fits where the model does not.

Example:
    >>> import torch
    >>> block = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 256))
    >>> measure_compute_rate(block, torch.randn(1, 16, 256)) > 0
    True
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import nn

from bigviz.core.errors import UsageError

__all__ = ["measure_compute_rate", "forward_seconds"]


def forward_seconds(module: nn.Module, *args: Any, repeat: int = 5, **kwargs: Any) -> float:
    """Best of ``repeat`` timed forwards of ``module`` (after one untimed warm-up), no grad.

    Example:
        >>> forward_seconds(torch.nn.Linear(4, 4), torch.randn(2, 4)) >= 0
        True
    """
    if repeat < 1:
        raise UsageError(f"repeat={repeat!r} must be >= 1")
    with torch.no_grad():
        module(*args, **kwargs)  # warm-up: first-call allocations and kernel choice
        best = float("inf")
        for _ in range(repeat):
            start = time.perf_counter()
            module(*args, **kwargs)
            best = min(best, time.perf_counter() - start)
    return best


def measure_compute_rate(module: nn.Module, *args: Any, repeat: int = 5, **kwargs: Any) -> float:
    """Bytes of ``module``'s weights (parameters and buffers) its forward on ``args`` computes
    through per second: ``MachineFacts.compute_rate`` for runs of the same tokens and threads.

    Raises:
        UsageError: the module holds no weights in memory (on ``meta``, or none at all).
    """
    tensors = [*module.parameters(), *module.buffers()]
    nbytes = sum(t.numel() * t.element_size() for t in tensors if t.device.type != "meta")
    if not nbytes:
        raise UsageError(
            f"measure_compute_rate: {type(module).__name__} holds no weights in memory; "
            "pass one block with its weights materialised (e.g. built on the CPU)"
        )
    return nbytes / max(forward_seconds(module, *args, repeat=repeat, **kwargs), 1e-9)
