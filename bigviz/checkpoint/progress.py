"""Progress bars over bytes, shown only for work that takes a while.

Saving or loading a 1 MB checkpoint takes milliseconds: a bar for it is noise in a terminal
and two dead widgets in a notebook. Every bar bigviz draws (saving, loading, copying weights
into RAM) is made here, with tqdm's ``delay``: it appears only once the work has run for
:data:`SHOW_AFTER_S` seconds, so a slow disk or a big model still shows its progress.

Example:
    >>> with byte_bar(1024, "saving") as bar:  # finishes at once: nothing is printed
    ...     bar.update(1024)
"""

from __future__ import annotations

from typing import Any

__all__ = ["byte_bar", "SHOW_AFTER_S"]

SHOW_AFTER_S = 1.0
"""Seconds a piece of work runs before its bar appears."""


def byte_bar(total: int, desc: str, *, enabled: bool = True) -> Any:
    """A tqdm bar over ``total`` bytes, shown after :data:`SHOW_AFTER_S` seconds (never when
    ``enabled`` is false); ``update(n)`` it with bytes done, use it as a context manager."""
    from tqdm.auto import tqdm

    return tqdm(total=total, unit="B", unit_scale=True, desc=desc, disable=not enabled, delay=SHOW_AFTER_S)
