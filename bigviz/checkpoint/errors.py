"""The checkpoint layer's error: a `bigviz.core.errors.BigvizError` and a ``ValueError``.

Checkpoint problems come in groups (three shards missing, forty keys renamed), so every check
collects all of them first and raises once, each line saying where, what and how to fix it.

Example:
    >>> problems = ["a.safetensors: header length 99 is beyond the file end (12 bytes)"]
    >>> try:
    ...     raise_problems(problems, "cannot read checkpoint 'ckpt'")
    ... except CheckpointError as err:
    ...     print(err)
    cannot read checkpoint 'ckpt' (1 problem):
      - a.safetensors: header length 99 is beyond the file end (12 bytes)
"""

from __future__ import annotations

from collections.abc import Sequence

from bigviz.core.errors import BigvizError

__all__ = ["CheckpointError", "raise_problems"]


class CheckpointError(BigvizError, ValueError):
    """A checkpoint that cannot be read or does not fit the model.

    Attributes:
        problems: every problem found, one line each (the message may show fewer).
    """


def raise_problems(problems: Sequence[str], headline: str, *, fix: str = "") -> None:
    """Raise one `CheckpointError` listing ``problems``; do nothing when there are none.

    Args:
        problems: one line per problem.
        headline: what was being done, e.g. ``"cannot load 'ckpt' into GPT2"``.
        fix: an optional closing line saying how to fix the whole group.

    Example:
        >>> raise_problems([], "fine")  # no problems: returns None
    """
    CheckpointError.check(problems, headline, fix=fix)
