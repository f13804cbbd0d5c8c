"""One error type: a headline, every problem found, and how to fix them, formatted once.

Every check in bigviz collects all it finds before raising (three shards missing, a GPU this
machine lacks *and* a module no key covers), so each error carries ``problems``, one line
each, and prints them the same way. Every error bigviz raises on purpose is one of the family,
each with the builtin base its users catch: :class:`PlanError`, :class:`DeviceMapError` and
:class:`UsageError` are ``ValueError`` s, as are ``bigviz.checkpoint.CheckpointError`` and its
``OffloadFolderError``; :class:`ArgumentTypeError` is a ``TypeError``; :class:`StateError`
and :class:`FetchError` (a read of offloaded weights, at run time) are ``RuntimeError`` s. (The OS layer, ``bigviz.osio``, below them all, raises ``OSError`` s.)

Example:
    >>> err = PlanError("cannot plan", ["unknown strategy 'fast'", "reserve['x']: not a size"])
    >>> print(err)
    cannot plan (2 problems):
      - unknown strategy 'fast'
      - reserve['x']: not a size
    >>> isinstance(err, ValueError), err.problems[0]
    (True, "unknown strategy 'fast'")
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = [
    "MAX_LINES",
    "BigvizError",
    "PlanError",
    "DeviceMapError",
    "FetchError",
    "UsageError",
    "ArgumentTypeError",
    "StateError",
    "format_problems",
    "raise_problems",
    "short_repr",
]

MAX_LINES = 40
"""Problems shown in a message; the rest stay in ``err.problems`` (thousands of missing keys
would bury the first, most useful ones)."""


def format_problems(headline: str, problems: Sequence[str], *, fix: str = "") -> str:
    """``headline (N problems):`` then one ``  - problem`` line each, then ``fix``.

    Without problems the headline stands alone (an error that is one sentence).

    Example:
        >>> print(format_problems("cannot load 'ckpt'", ["missing: a.weight"], fix="Fix: re-save it"))
        cannot load 'ckpt' (1 problem):
          - missing: a.weight
        Fix: re-save it
        >>> format_problems("refused", [])
        'refused'
    """
    if not problems:
        return "\n".join([headline, fix]) if fix else headline
    count = f"{len(problems)} problem" + ("s" if len(problems) != 1 else "")
    lines = [f"{headline} ({count}):"]
    lines += [f"  - {p}" for p in problems[:MAX_LINES]]
    if len(problems) > MAX_LINES:
        lines.append(f"  ... and {len(problems) - MAX_LINES} more (see err.problems)")
    if fix:
        lines.append(fix)
    return "\n".join(lines)


class BigvizError(Exception):
    """Base of bigviz's errors: a message made by :func:`format_problems`, and the problems.

    Args:
        headline: what was being done (``"cannot plan"``), or the whole message when
            ``problems`` is empty.
        problems: one line per problem, each saying where, what, and the fix (none: the
            headline is the whole message).
        fix: a closing line saying how to fix the whole group.

    Attributes:
        problems: every problem found (the message may show fewer); an error made of one
            sentence is its own single problem.
        headline: the first argument.
    """

    def __init__(self, headline: str, problems: Sequence[str] = (), *, fix: str = "") -> None:
        listed = [str(p) for p in problems]
        super().__init__(format_problems(headline, listed, fix=fix))
        self.headline = headline
        self.problems: list[str] = listed or [headline]  # a one-sentence error is its own problem

    @classmethod
    def check(cls, problems: Sequence[str], headline: str, *, fix: str = "") -> None:
        """Raise ``cls(headline, problems)`` when there are problems; else return None.

        Example:
            >>> PlanError.check([], "cannot plan")  # nothing wrong: returns None
        """
        if problems:
            raise cls(headline, problems, fix=fix)


class PlanError(BigvizError, ValueError):
    """The model cannot be placed within the budgets, or the planner's inputs are invalid."""


class DeviceMapError(BigvizError, ValueError):
    """A device map that does not fit the model or this machine (every problem listed)."""


class UsageError(BigvizError, ValueError):
    """A value bigviz cannot use: a knob out of range, an unknown name or spelling (the message
    says what, where, and the values it takes)."""


class ArgumentTypeError(BigvizError, TypeError):
    """An argument of a kind bigviz does not take (the message names the kinds it does)."""


class StateError(BigvizError, RuntimeError):
    """An operation the object's state forbids now (a dispatched model moved or dispatched
    again, a widget asked for what it was not made with); the message says what to do first."""


class FetchError(BigvizError, RuntimeError):
    """Reading an offloaded unit's weights failed at run time (the cause is chained); raised
    in the caller, naming the unit, even when the read ran in the background."""


def raise_problems(
    problems: Sequence[str],
    headline: str,
    *,
    fix: str = "",
    error: type[BigvizError] = DeviceMapError,
) -> None:
    """Raise ``error(headline, problems)`` when there are problems (else do nothing).

    Example:
        >>> raise_problems(["key 0 is not a module name"], "invalid device_map")
        Traceback (most recent call last):
        ...
        bigviz.core.errors.DeviceMapError: invalid device_map (1 problem):
          - key 0 is not a module name
    """
    error.check(problems, headline, fix=fix)


def short_repr(value: object, limit: int = 60) -> str:
    """``repr(value)`` cut to ``limit`` characters, for a message that quotes what was wrong.

    Values from hostile files can be anything: nested deeper than ``repr`` recurses (``RecursionError``),
    or integers too long for ``str`` (Python refuses more than 4300 digits): both are described instead.

    Example:
        >>> short_repr("x" * 100, 10), short_repr(10**5000)
        ("'xxxxxx...", 'an integer of about 10**5000')
    """
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 100:
        return f"an integer of about 10**{int(abs(value).bit_length() * 0.30103)}"
    try:
        text = repr(value)
    except RecursionError:  # JSON nested just below the parser's limit
        return "(a deeply nested value)"
    return text if len(text) <= limit else text[: limit - 3] + "..."
