"""Device maps and ``max_memory`` as JSON files that survive the round trip.

JSON object keys are always strings, so ``max_memory={0: "10GiB"}`` comes back as
``{"0": "10GiB"}``; these helpers turn digit keys back into GPU indices. Device-map *values*
stay ints, so the file can be given to transformers' ``from_pretrained(device_map=...)``
as it is.

Example:
    >>> import tempfile, os
    >>> path = os.path.join(tempfile.mkdtemp(), "map.json")
    >>> save_device_map({"h.0": 0, "lm_head": "cpu"}, path)
    >>> load_device_map(path)
    {'h.0': 0, 'lm_head': 'cpu'}
"""

from __future__ import annotations

import errno
import json
import os
import secrets
import stat
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from bigviz.core.devicemap import check_keys
from bigviz.core.errors import DeviceMapError, UsageError, short_repr
from bigviz.core.devices import Device, normalize_device
from bigviz.core.sizes import parse_max_memory

__all__ = [
    "save_device_map",
    "load_device_map",
    "save_max_memory",
    "load_max_memory",
    "write_json_atomic",
    "write_text_atomic",
    "parse_json",
    "DuplicateKeysError",
    "read_json",
]


def write_text_atomic(text: str, path: str | os.PathLike[str]) -> None:
    """Write ``text`` to a temporary file beside ``path`` and rename it into place, so a crash
    never leaves a half-written file.

    The file gets the usual permissions (``0o666`` less the umask, e.g. ``0o644``), or keeps
    those of the file it replaces; ``tempfile.mkstemp`` would leave it ``0o600``.

    Example:
        >>> import tempfile, os, stat
        >>> path = os.path.join(tempfile.mkdtemp(), "a.txt")
        >>> write_text_atomic("hi", path)
        >>> mask = os.umask(0); _ = os.umask(mask)
        >>> stat.S_IMODE(os.stat(path).st_mode) == 0o666 & ~mask
        True
    """
    path = Path(path)
    _check_writable(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.tmp-{secrets.token_hex(4)}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)  # the umask applies
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        try:
            os.chmod(tmp, os.stat(path).st_mode & 0o7777)  # replacing a file: keep its mode
        except FileNotFoundError:
            pass
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _check_writable(path: Path) -> None:
    """Refuse, before anything is made, a path a rename cannot replace with a file: a folder
    (``os.replace`` names the temporary file in its error), a FIFO or a device (``/dev/null``
    would be replaced by a regular file), or one under a regular file."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        mode = None
    except NotADirectoryError:
        raise NotADirectoryError(
            errno.ENOTDIR, f"cannot write {path}: a part of its folder path is a file, not a folder"
        ) from None
    if mode is not None and stat.S_ISDIR(mode):
        raise IsADirectoryError(errno.EISDIR, f"cannot write {path}: it is a folder; give a file path in it")
    if mode is not None and not stat.S_ISREG(mode):
        raise FileExistsError(errno.EEXIST, f"cannot write {path}: it exists and is not a regular file")


def write_json_atomic(data: Any, path: str | os.PathLike[str]) -> None:
    """Write JSON (indented) atomically, with the usual permissions (see `write_text_atomic`)."""
    write_text_atomic(json.dumps(data, indent=2) + "\n", path)


class DuplicateKeysError(UsageError):
    """A JSON object naming one key more than once (JSON parsers keep the last silently).

    Attributes:
        duplicates: key -> every value it was given, in file order (at any depth).
        doc: the document as JSON parsers read it (the last value of each key).
    """

    def __init__(self, message: str, duplicates: dict[str, list[Any]], doc: Any = None) -> None:
        super().__init__(message)
        self.duplicates = duplicates
        self.doc = doc


def _no_duplicates(found: dict[str, list[Any]]) -> Any:
    """An ``object_pairs_hook`` that builds the dict and records keys given twice."""

    def hook(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        out = dict(pairs)
        if len(out) != len(pairs):
            counts: dict[str, list[Any]] = {}
            for key, value in pairs:
                counts.setdefault(key, []).append(value)
            for key, values in counts.items():
                if len(values) > 1:
                    found.setdefault(key, []).extend(values)
        return out

    return hook


def parse_json(text: str | bytes, where: object, what: str) -> Any:
    """Parse JSON, or raise a :class:`UsageError` (a ``ValueError``) naming ``where`` it came from: bad syntax, bytes
    that are not UTF-8, nesting so deep that Python's parser would raise ``RecursionError``,
    or an object naming a key twice (:class:`DuplicateKeysError`: Python's parser keeps the
    last silently, so ``{"num_hidden_layers": 2, "num_hidden_layers": 80}`` would mean 80
    with no word, and which one was meant is unknown).

    Example:
        >>> parse_json("[" * 100_000, "x.json", "device map")
        Traceback (most recent call last):
        ...
        bigviz.core.errors.UsageError: x.json: JSON nested too deeply (Python's parser gives up); this is not a device map file
        >>> parse_json('{"a": 1, "a": 2}', "c.json", "model config")
        Traceback (most recent call last):
        ...
        bigviz.core.serialize.DuplicateKeysError: c.json: key 'a' appears twice (1, then 2); JSON keeps only the last, so bigviz refuses the file: keep one
    """
    duplicates: dict[str, list[Any]] = {}
    try:
        if isinstance(text, bytes):  # JSON files are UTF-8 (RFC 8259); json.loads would guess UTF-16 too
            text = text.decode("utf-8-sig")
        doc = json.loads(text, object_pairs_hook=_no_duplicates(duplicates))
    except RecursionError:
        raise UsageError(
            f"{where}: JSON nested too deeply (Python's parser gives up); this is not a {what} file"
        ) from None
    except ValueError as err:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise UsageError(f"{where}: not valid JSON ({err}); is this a {what} file?") from err
    if duplicates:
        shown = [_duplicate_text(key, values) for key, values in duplicates.items()]
        more = f" and {len(shown) - 5} more" if len(shown) > 5 else ""
        raise DuplicateKeysError(
            f"{where}: {'; '.join(shown[:5])}{more}; JSON keeps only the last, so bigviz refuses the file: keep one",
            duplicates,
            doc,
        )
    return doc


def _duplicate_text(key: str, values: list[Any]) -> str:
    """``key 'a' appears twice (1, then 2)`` or ``key 'a' appears 3 times (1, 2, 3)``."""
    if len(values) == 2:
        return f"key {key!r} appears twice ({short_repr(values[0], 40)}, then {short_repr(values[1], 40)})"
    return f"key {key!r} appears {len(values)} times ({', '.join(short_repr(v, 40) for v in values)})"


def read_json(path: str | os.PathLike[str], what: str) -> Any:
    """The JSON in the file at ``path``, or a `UsageError` naming the file and saying it is
    not a ``what`` file (see :func:`parse_json`); core's one reader of files."""
    with open(path, "rb") as f:
        return parse_json(f.read(), path, what)


def save_device_map(device_map: Mapping[str, object], path: str | os.PathLike[str]) -> None:
    """Write a device map as JSON (``{"module": 0 | "cpu" | "disk" | "mps"}``).

    Devices are written in canonical form (``"cuda:1"`` becomes ``1``).

    Raises:
        ValueError: a key is not a string (quoted), or a value is not a device.
    """
    check_keys(device_map)
    write_json_atomic({str(k): normalize_device(v) for k, v in device_map.items()}, path)


def load_device_map(path: str | os.PathLike[str]) -> dict[str, Device]:
    """Read a device map written by :func:`save_device_map`, by a planner export (a file with
    a ``"device_map"`` key) or by hand.

    Raises:
        DeviceMapError: (a ``ValueError``) naming the file and each bad entry.
    """
    data = read_json(path, "device map")
    if isinstance(data, dict) and isinstance(data.get("device_map"), dict):
        data = data["device_map"]
    if not isinstance(data, dict):
        raise UsageError(f"{path}: a device map is a JSON object {{module: device}}, got {type(data).__name__}")
    out: dict[str, Device] = {}
    problems = []
    for key, value in data.items():
        try:
            out[key] = normalize_device(value)
        except ValueError as err:
            problems.append(f"{key!r}: {err}")
    DeviceMapError.check(problems, f"{path}: invalid device map entries")
    return out


def save_max_memory(max_memory: Mapping[object, object], path: str | os.PathLike[str]) -> None:
    """Write ``max_memory`` as JSON; values keep their form (``"10GiB"`` or bytes)."""
    parse_max_memory(max_memory)  # refuse to write what could not be read back
    write_json_atomic({str(normalize_device(k)): v for k, v in max_memory.items()}, path)


def load_max_memory(path: str | os.PathLike[str]) -> dict[Device, object]:
    """Read ``max_memory`` from JSON with GPU keys back as ints (``"0"`` -> ``0``).

    Example:
        >>> import tempfile, os
        >>> p = os.path.join(tempfile.mkdtemp(), "mm.json")
        >>> save_max_memory({0: "10GiB", "cpu": 2**30}, p)
        >>> load_max_memory(p)
        {0: '10GiB', 'cpu': 1073741824}
    """
    data = read_json(path, "max_memory")
    if not isinstance(data, dict):
        raise UsageError(f"{path}: max_memory is a JSON object {{device: size}}")
    try:
        parse_max_memory(data)  # validates keys and values, naming each problem
    except ValueError as err:
        raise UsageError(f"{path}: {err}") from None
    return {normalize_device(k): v for k, v in data.items()}
