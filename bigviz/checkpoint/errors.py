"""The one error type of the checkpoint layer, and a helper to raise it with every problem.

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

__all__ = ["CheckpointError", "raise_problems"]

# Long lists (thousands of missing keys) are cut so the message stays readable.
_MAX_LINES = 40


class CheckpointError(ValueError):
    """A checkpoint that cannot be read or does not fit the model.

    Attributes:
        problems: every problem found, one line each (the message may show fewer).
    """

    def __init__(self, message: str, problems: Sequence[str] = ()) -> None:
        super().__init__(message)
        self.problems: list[str] = list(problems)


def raise_problems(problems: Sequence[str], headline: str, *, fix: str = "") -> None:
    """Raise one `CheckpointError` listing ``problems``; do nothing when there are none.

    Args:
        problems: one line per problem.
        headline: what was being done, e.g. ``"cannot load 'ckpt' into GPT2"``.
        fix: an optional closing line saying how to fix the whole group.

    Example:
        >>> raise_problems([], "fine")  # no problems: returns None
    """
    if not problems:
        return
    count = f"{len(problems)} problem" + ("s" if len(problems) != 1 else "")
    lines = [f"{headline} ({count}):"]
    lines += [f"  - {p}" for p in problems[:_MAX_LINES]]
    if len(problems) > _MAX_LINES:
        lines.append(f"  ... and {len(problems) - _MAX_LINES} more (see err.problems)")
    if fix:
        lines.append(fix)
    raise CheckpointError("\n".join(lines), problems)
