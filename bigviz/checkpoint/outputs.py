"""Files the command line writes: one rule for every writer (``bigviz plan --out/--html``,
``python -m bigviz.distributed --out/--report``).

Checked up front, before anything is planned or loaded (:func:`output_problems`), every
problem listed at once:

* an existing file is replaced only with ``overwrite`` (``--overwrite``);
* never a file the command reads (the ``config.json`` being planned, a checkpoint's shards, a
  ``--plan`` file), not even with ``overwrite``, and not through another name (a hard link);
* never a link (even one that points nowhere: bigviz would write where it points), a folder or
  anything but a regular file;
* the folder must exist and be writable (bigviz does not create folders behind a typo), and two
  outputs may not share a path.

Written atomically (:func:`write_output`): a temporary file beside the target, renamed into place,
so a crash never leaves half a file; with the usual permissions (``0o666`` less the umask; a
replaced file keeps its mode). Without ``overwrite`` the last step is a hard link, which fails
on an existing name, so a file that appeared while the command ran is not replaced either.

Example:
    >>> import os, tempfile
    >>> folder = tempfile.mkdtemp()
    >>> out = os.path.join(folder, "map.json")
    >>> output_problems({"--out": out}, overwrite=False)
    []
    >>> write_output(out, lambda tmp: open(tmp, "w").write("{}"), overwrite=False)
    >>> output_problems({"--out": out}, overwrite=False)  # doctest: +ELLIPSIS
    ['--out .../map.json exists: bigviz does not overwrite it unless you pass --overwrite']
"""

from __future__ import annotations

import errno
import os
import secrets
import stat
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

from bigviz.core.errors import BigvizError

__all__ = ["OutputError", "check_outputs", "output_problems", "write_output", "input_files"]

PathLike = str | os.PathLike[str]

_WEIGHTS = (".safetensors", ".bin", ".pt", ".pth")


def input_files(source: PathLike) -> list[Path]:
    """The files a command reads from ``source``: a checkpoint's weights, index and
    ``config.json`` (a folder, or one of its files: the rest of the folder is read with it), or a
    lone file such as a ``config.json``.

    Example:
        >>> import os, tempfile
        >>> folder = tempfile.mkdtemp()
        >>> for name in ("model.safetensors", "config.json", "device_map.json"):
        ...     _ = open(os.path.join(folder, name), "w").write("{}")
        >>> [p.name for p in input_files(folder)]
        ['config.json', 'model.safetensors']
        >>> [p.name for p in input_files(os.path.join(folder, "device_map.json"))]
        ['device_map.json']
    """
    path = Path(source)
    if path.is_dir():
        return sorted(p for p in path.iterdir() if _checkpoint_file(p.name) and p.is_file())
    if not path.is_file():
        return []
    if path.name != "config.json" and _checkpoint_file(path.name):
        return sorted({path, *input_files(path.parent)})
    return [path]


def _checkpoint_file(name: str) -> bool:
    """Weights, an index (``model.safetensors.index.json``, ``...index.fp16.json``), a config."""
    return name.endswith(_WEIGHTS) or name == "config.json" or (".index" in name and name.endswith(".json"))


class OutputError(BigvizError, ValueError):
    """Outputs a command will not write (every problem listed); nothing was done."""


def check_outputs(
    outputs: Mapping[str, PathLike | None],
    *,
    overwrite: bool,
    inputs: Iterable[PathLike] = (),
    headline: str = "nothing was done",
) -> None:
    """Raise :class:`OutputError` listing every :func:`output_problems`, or return None."""
    OutputError.check(output_problems(outputs, overwrite=overwrite, inputs=inputs), headline)


def output_problems(
    outputs: Mapping[str, PathLike | None], *, overwrite: bool, inputs: Iterable[PathLike] = ()
) -> list[str]:
    """What is wrong with writing each output (``{flag: path}``; ``None``: not asked for), one
    sentence each, naming the flag and the path.

    Args:
        outputs: the files to write, by the option that names them.
        overwrite: whether an existing regular file may be replaced.
        inputs: files the command reads; none of them is ever written.
    """
    problems = []
    read = [Path(p) for p in inputs]
    seen: dict[str, str] = {}
    for flag, given in outputs.items():
        if given is None:
            continue
        path = Path(given)
        where = f"{flag} {given}"
        problem = _path_problem(path, where, overwrite=overwrite, inputs=read)
        real = os.path.realpath(path)
        if problem is None and real in seen:
            problem = f"{where} is also {seen[real]}: give each output its own file"
        seen.setdefault(real, flag)
        if problem:
            problems.append(problem)
    return problems


def _path_problem(path: Path, where: str, *, overwrite: bool, inputs: list[Path]) -> str | None:
    folder = path.parent
    if not folder.exists():
        return f"{where}: the folder {str(folder)!r} does not exist: create it first (bigviz does not create folders)"
    if not folder.is_dir():
        return f"{where}: {str(folder)!r} is a file, not a folder"
    if not os.access(folder, os.W_OK | os.X_OK):
        return f"{where}: the folder {str(folder)!r} is not writable"
    if path.is_symlink():
        return f"{where} is a link (to {os.readlink(path)!r}): bigviz does not write through links; give another path"
    if any(_same_file(path, p) for p in inputs):
        return f"{where} is a file this command reads: bigviz never writes onto its input; give another path"
    if not os.path.lexists(path):
        return None
    mode = os.lstat(path).st_mode
    if stat.S_ISDIR(mode):
        return f"{where} is a folder: give a file name"
    if not stat.S_ISREG(mode):
        return f"{where} exists and is not a regular file: give another path"
    if not overwrite:
        return f"{where} exists: bigviz does not overwrite it unless you pass --overwrite"
    return None


def _same_file(a: Path, b: Path) -> bool:
    """Same path once resolved, or one file under two names (a hard link)."""
    if os.path.realpath(a) == os.path.realpath(b):
        return True
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def write_output(path: PathLike, write: Callable[[Path], object], *, overwrite: bool) -> None:
    """``write(tmp)`` writes the content to a temporary path beside ``path``; it is then renamed
    into place (replacing an existing file only with ``overwrite``). The temporary file is
    removed whatever happens.

    Raises:
        FileExistsError: without ``overwrite``, a file appeared at ``path`` meanwhile (kept).
        IsADirectoryError: ``path`` became a folder meanwhile.
    """
    path = Path(path)
    tmp = path.parent / f".bigviz-{secrets.token_hex(6)}.tmp"
    try:
        write(tmp)
        if overwrite:
            _keep_mode(tmp, path)
            if path.is_symlink() or path.is_dir():
                raise IsADirectoryError(f"{path} became a link or a folder while bigviz worked: left as it is")
            os.replace(tmp, path)
        else:
            _link_new(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _link_new(tmp: Path, path: Path) -> None:
    """Give ``tmp``'s file the name ``path``, failing if the name exists (no replace)."""
    try:
        os.link(tmp, path)
    except FileExistsError:
        raise FileExistsError(
            f"{path} appeared while bigviz worked: left as it is (pass --overwrite to replace it)"
        ) from None
    except OSError as err:  # a filesystem without hard links: check, then rename
        if err.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EMLINK, errno.EXDEV):
            raise
        if os.path.lexists(path):
            raise FileExistsError(
                f"{path} appeared while bigviz worked: left as it is (pass --overwrite to replace it)"
            ) from None
        os.replace(tmp, path)


def _keep_mode(tmp: Path, path: Path) -> None:
    try:
        os.chmod(tmp, stat.S_IMODE(os.stat(path).st_mode))  # replacing a file: keep its mode
    except FileNotFoundError:
        pass
