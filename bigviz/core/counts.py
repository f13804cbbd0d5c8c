"""Counts a caller gives (batch size, context length, stages, micro-batches, tokens): whole
numbers, checked once, the same way everywhere.

``int(2.5)`` is 2 and ``True`` is 1 to Python, so a setter that converts takes both without a
word; a count is therefore checked, never converted: an ``int`` (or anything with
``__index__``, such as a NumPy integer), not a ``bool``, at least ``minimum``.

Example:
    >>> check_count("batch_size", 4)
    4
    >>> check_count("context_length", 2.5)
    Traceback (most recent call last):
    ...
    bigviz.core.errors.PlanError: context_length=2.5 must be a whole number >= 1 (a float is not taken as 2)
"""

from __future__ import annotations

import operator

from bigviz.core.errors import BigvizError, PlanError

__all__ = ["count_problem", "check_count"]


def count_problem(name: str, value: object, *, minimum: int = 1) -> str | None:
    """What is wrong with ``value`` as the count ``name`` (None: nothing).

    Example:
        >>> count_problem("batch_size", 0), count_problem("batch_size", True) is not None
        ('batch_size=0 must be a whole number >= 1', True)
    """
    if isinstance(value, bool):
        return f"{name}={value!r} must be a whole number >= {minimum} (a bool is not a count)"
    try:
        number = operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        taken = f" (a float is not taken as {int(value)})" if isinstance(value, float) and abs(value) < 1e18 else ""
        return f"{name}={value!r} must be a whole number >= {minimum}{taken}"
    if number < minimum:
        return f"{name}={value!r} must be a whole number >= {minimum}"
    return None


def check_count(name: str, value: object, *, minimum: int = 1, error: type[BigvizError] = PlanError) -> int:
    """``value`` as an ``int`` if it is a whole number >= ``minimum``, else raise ``error``."""
    problem = count_problem(name, value, minimum=minimum)
    if problem:
        raise error(problem)
    return operator.index(value)  # type: ignore[arg-type]
