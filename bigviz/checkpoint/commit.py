"""Put a staged checkpoint into its folder so that a loader finds a complete one at every instant.

`save_sharded` writes a new checkpoint into a *stage*, a hidden folder of bigviz's own naming
inside the target folder (``.bigviz-save-<12 hex>``, same filesystem, so files move by
rename), then commits it:

1. Make the new checkpoint live. A single file is renamed into place (atomic). For shards,
   when a new shard name is taken by an old file (two saves with the same number of shards),
   an *interim* index pointing into the stage replaces the old index first (atomic), so the
   old shards are no longer read when they are replaced; then the shards are linked into
   place and the final index replaces the interim one (atomic).
2. Remove the old checkpoint's *pointer* files (single files, index files) that a loader would
   still prefer to the new ones, in the order loaders prefer them: each removal switches a
   loader from one complete checkpoint to the next.
3. Remove the old shards the new index does not name, and the stage.

With a ``config.json`` to commit (``save_sharded(config=...)`` when it differs from the folder's),
the config goes in the same commit: two files cannot change in one rename, so the old one is set
aside in the stage just before the first step that can switch a loader to the new weights, and
the new one goes in after the last. A kill in between leaves the folder with weights and *no*
``config.json`` (a loader that needs one fails, naming it: never new weights read with the old
config, or the reverse); the next save puts back the config of the weights that are live (the
stage's manifest says which files are the new ones) before it removes the stage. Without
``overwrite`` the config goes in first: a folder holding only the killed save's config takes
the next save as it would have.

A checkpoint's own files are those in transformers' naming, both formats, any variant:
``model.safetensors``, ``model-00001-of-00003.safetensors``, ``model.fp16-...``,
``model.safetensors.index(.fp16).json``, ``pytorch_model...bin`` and its index. Everything else
in the folder (``config.json``, tokenizer files, your files) is never touched.

A stage is locked (``flock``) while its save runs. A killed save leaves its stage behind,
unlocked: the next save removes it, unless the live index still points into it (a kill
during step 1), and then only once its own index no longer does; with it go the links a killed
``overwrite=False`` save made into the folder that no live index names (the same files as the
stage's, so never anything of anyone else's). Nothing else is ever removed.

Example:
    >>> checkpoint_names(["model.safetensors", "config.json", "model.fp16-00001-of-00002.safetensors",
    ...                   "pytorch_model.bin.index.json", "training_args.bin", "adapter_model.safetensors"])
    ['model.safetensors', 'model.fp16-00001-of-00002.safetensors', 'pytorch_model.bin.index.json']
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import secrets
import shutil
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows: no advisory locks, stale stages are kept
    fcntl = None  # type: ignore[assignment]

__all__ = ["Stage", "checkpoint_names", "commit", "clean_stale_stages", "STAGE_PREFIX", "CONFIG"]

STAGE_PREFIX = ".bigviz-save-"
CONFIG = "config.json"
_CONFIG_BEFORE = ".config-before.json"  # in a stage: the folder's config, set aside during the commit
_MANIFEST = ".manifest.json"  # in a stage: inode of each new weights file (which weights are live)
_STAGE = re.compile(r"\.bigviz-save-[0-9a-f]{12}")
_FORMATS = (("model", "safetensors"), ("pytorch_model", "bin"))


def _patterns(stem: str, ext: str) -> tuple[re.Pattern[str], re.Pattern[str], str]:
    s, e = re.escape(stem), re.escape(ext)
    weights = re.compile(rf"{s}(\.[\w-]+)?(-\d{{5}}-of-\d{{5}})?\.{e}")
    index = re.compile(rf"{s}\.{e}\.index(\.[\w-]+)?\.json")
    return weights, index, f"{stem}.{ext}"


_FAMILIES = [_patterns(stem, ext) for stem, ext in _FORMATS]


def checkpoint_names(names: Iterable[str]) -> list[str]:
    """The names that are a checkpoint's own files (transformers' naming, both formats, any
    variant), in the order given."""
    return [n for n in names if any(w.fullmatch(n) or i.fullmatch(n) for w, i, _ in _FAMILIES)]


def folder_checkpoint(folder: Path) -> list[str]:
    """The checkpoint files ``folder`` holds now, sorted (none for a missing folder).

    Example:
        >>> folder_checkpoint(Path("no/such/folder"))
        []
    """
    try:
        return sorted(checkpoint_names(e.name for e in os.scandir(folder) if not e.is_dir()))
    except FileNotFoundError:
        return []


def _preference(name: str) -> tuple[int, int]:
    """Where a file stands in the loaders' search order (lower: looked at first). Shards
    last: they are read only through a pointer (an index), never found on their own."""
    for rank, (weights, index, single) in enumerate(_FAMILIES):
        if name == single:
            return (rank, 0)
        if index.fullmatch(name):
            return (rank, 1 if name == f"{single}.index.json" else 2)
        if weights.fullmatch(name) and not re.search(r"-\d{5}-of-\d{5}\.", name):
            return (rank, 3)  # a variant's single file
    return (len(_FAMILIES), 0)


@dataclass(eq=False)
class Stage:
    """A locked hidden folder inside ``folder`` where a save writes before it commits.

    Attributes:
        folder: the checkpoint folder.
        path: the stage itself.
        referenced: True while the live index points into the stage (it is then kept).
    """

    folder: Path
    path: Path
    referenced: bool = False
    _fd: int | None = field(default=None, repr=False)

    @classmethod
    @contextlib.contextmanager
    def create(cls, folder: Path) -> Iterator[Stage]:
        """Make and lock a stage; on exit remove it (unless the live index points into it)."""
        with _folder_lock(folder, exclusive=False):  # no cleaner sees it before it is locked
            path = folder / f"{STAGE_PREFIX}{secrets.token_hex(6)}"
            path.mkdir()
            stage = cls(folder, path, _fd=_lock(path))
        try:
            yield stage
        finally:
            if not stage.referenced:
                shutil.rmtree(stage.path, ignore_errors=True)
            if stage._fd is not None:
                os.close(stage._fd)


def commit(stage: Stage, files: Sequence[str], index: str | None, *, overwrite: bool, config: bool = False) -> None:
    """Move the staged ``files`` (shards, then ``index`` if sharded) into the folder, and with
    ``config`` the staged ``config.json`` in the same commit (see the module's docstring).

    Raises:
        FileExistsError: ``overwrite`` is False and the folder holds a checkpoint now (another
            process saved into it meanwhile); nothing of this save is left in the folder.
        OSError: a rename or link failed; the folder holds a complete checkpoint, old or new,
            with its own config.
    """
    _fsync_all(stage.path, [*files, *([CONFIG] if config else [])])
    if not overwrite:
        _commit_exclusive(stage, files, index, config=config)
        return
    if config:
        _write_manifest(stage, files)
    old = [n for n in folder_checkpoint(stage.folder) if n not in files]
    try:
        if config and os.path.lexists(stage.folder / CONFIG):
            os.replace(stage.folder / CONFIG, stage.path / _CONFIG_BEFORE)  # aside: no weights switch yet
        if index is None:
            os.replace(stage.path / files[0], stage.folder / files[0])
        else:
            _commit_shards(stage, [f for f in files if f != index], index)
        _fsync_dir(stage.folder)
        for name in sorted(old, key=_preference):  # pointers first, in the loaders' order; shards last
            with contextlib.suppress(FileNotFoundError):
                os.unlink(stage.folder / name)
        if config:
            os.replace(stage.path / CONFIG, stage.folder / CONFIG)  # the weights are the new ones now
    except BaseException:
        if config:
            restore_config(stage.folder, stage.path)  # the config of the weights that are live
        raise


def _write_manifest(stage: Stage, files: Sequence[str]) -> None:
    """Record which inodes are this save's weights files, before any of them moves: after a
    kill, the next save tells from it whether the live weights are the old or the new ones."""
    inodes = {name: os.stat(stage.path / name).st_ino for name in files}
    (stage.path / _MANIFEST).write_text(json.dumps(inodes))
    _fsync_all(stage.path, [_MANIFEST])


def restore_config(folder: Path, stage: Path) -> None:
    """After a commit stopped between setting the old ``config.json`` aside and putting the new
    one in: give the folder the config of the weights a loader reads now (the stage's new
    one when they are this save's, else the one set aside). Nothing when the folder has one."""
    if os.path.lexists(folder / CONFIG):
        return
    source = stage / (CONFIG if _new_weights_live(folder, stage) else _CONFIG_BEFORE)
    if not source.is_file():
        return
    try:
        os.link(source, folder / CONFIG)  # never over a config that appeared meanwhile
    except FileExistsError:
        pass
    except OSError:  # no hard links here: a copy (the stage is removed next)
        if not os.path.lexists(folder / CONFIG):
            shutil.copyfile(source, folder / CONFIG)


def _new_weights_live(folder: Path, stage: Path) -> bool:
    """Whether the file loaders read first in ``folder`` is one of ``stage``'s new files (by
    inode, from its manifest), or an interim index reading from the stage."""
    pointers = [n for n in sorted(folder_checkpoint(folder), key=_preference) if _preference(n)[0] < len(_FAMILIES)]
    if not pointers:
        return False
    first = folder / pointers[0]
    if first.name.endswith(".json") and stage.name in _referenced_dirs(folder, [first.name]):
        return True
    try:
        inodes = set(json.loads((stage / _MANIFEST).read_text()).values())
        return first.stat().st_ino in inodes
    except (OSError, ValueError, AttributeError):
        return False


def _commit_shards(stage: Stage, shards: Sequence[str], index: str) -> None:
    folder = stage.folder
    taken = [n for n in shards if os.path.lexists(folder / n)]
    if taken:  # old shards share the new names: stop reading them before they are replaced
        interim = _write_interim_index(stage, index)
        os.replace(interim, folder / index)
        stage.referenced = True
    for name in shards:
        if stage.referenced:
            _link_into_place(stage, name)  # the interim index still reads the staged file
        else:
            os.replace(stage.path / name, folder / name)
    os.replace(stage.path / index, folder / index)
    stage.referenced = False


def _write_interim_index(stage: Stage, index: str) -> Path:
    doc = json.loads((stage.path / index).read_text())
    doc["weight_map"] = {k: f"{stage.path.name}/{v}" for k, v in doc["weight_map"].items()}
    interim = stage.path / ".interim-index.json"
    interim.write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")
    _fsync_all(stage.path, [interim.name])
    return interim


def _link_into_place(stage: Stage, name: str) -> None:
    """A second name for a staged file, renamed over the folder's file (a copy where the
    filesystem has no hard links)."""
    tmp = stage.path / f".link-{name}"
    try:
        os.link(stage.path / name, tmp)
    except OSError as err:
        if err.errno not in (errno.EPERM, errno.EXDEV, errno.EMLINK, errno.ENOTSUP, errno.EOPNOTSUPP):
            raise
        shutil.copyfile(stage.path / name, tmp)
        _fsync_all(stage.path, [tmp.name])
    os.replace(tmp, stage.folder / name)


def _commit_exclusive(stage: Stage, files: Sequence[str], index: str | None, *, config: bool) -> None:
    """Link each file in without replacing anything; undo and refuse if one appeared.

    The config goes first (a folder holding only it is no checkpoint: the next save takes it
    as it would have). Shards are never seen without their index: an interim index reading
    them from the stage makes the checkpoint complete in one link, then the shards are linked
    beside it and the final index replaces it (a loader finding shard 1 of 3 alone would read
    a third of a model)."""
    folder, placed = stage.folder, []
    shards = [f for f in files if f != index]
    try:
        _refuse_if_checkpoint(folder)
        if config:
            _link_exclusive(stage.path / CONFIG, folder / CONFIG)
            placed.append(CONFIG)
        if index is not None:
            _link_exclusive(_write_interim_index(stage, index), folder / index)
            placed.append(index)
            stage.referenced = True
        for name in shards:
            _link_exclusive(stage.path / name, folder / name)
            placed.append(name)
        if index is not None:
            os.replace(stage.path / index, folder / index)  # the interim one was ours: linked above
            stage.referenced = False
    except FileExistsError:
        for name in placed:  # ours only: the same file as the staged one (or its interim index)
            with contextlib.suppress(OSError):
                ours = stage.path / (".interim-index.json" if name == index and stage.referenced else name)
                if os.path.samefile(ours, folder / name):
                    os.unlink(folder / name)
        stage.referenced = False
        raise
    _fsync_dir(folder)


def _refuse_if_checkpoint(folder: Path) -> None:
    found = folder_checkpoint(folder)
    if found:
        raise FileExistsError(
            f"{folder} holds a checkpoint now ({', '.join(found[:4])}{', ...' if len(found) > 4 else ''}), "
            "written while this save ran; nothing was replaced. Pass overwrite=True to replace it "
            "(config.json and your other files are kept), or choose another folder"
        )


def _link_exclusive(src: Path, dst: Path) -> None:
    try:
        os.link(src, dst)  # fails with EEXIST rather than replacing: atomic "create if absent"
    except FileExistsError:
        _refuse_if_checkpoint(dst.parent)
        raise FileExistsError(f"{dst} appeared while this save ran; nothing was replaced") from None
    except OSError as err:
        if err.errno not in (errno.EPERM, errno.EXDEV, errno.EMLINK, errno.ENOTSUP, errno.EOPNOTSUPP):
            raise
        if os.path.lexists(dst):  # no hard links here: check, then rename (a narrow race)
            raise FileExistsError(f"{dst} appeared while this save ran; nothing was replaced") from None
        os.replace(src, dst)


def clean_stale_stages(folder: Path) -> list[str]:
    """Remove stages of killed saves in ``folder`` (unlocked, and not read by a live index).

    Returns the names removed. Nothing else is removed; without ``flock`` nothing at all.

    Example:
        >>> import tempfile
        >>> folder = Path(tempfile.mkdtemp())
        >>> (folder / ".bigviz-save-0123456789ab").mkdir()  # left by a killed save
        >>> (folder / ".bigviz-save-mine").mkdir()  # not bigviz's naming: kept
        >>> clean_stale_stages(folder), sorted(p.name for p in folder.iterdir())
        (['.bigviz-save-0123456789ab'], ['.bigviz-save-mine'])
    """
    names = [e.name for e in os.scandir(folder) if _STAGE.fullmatch(e.name) and e.is_dir(follow_symlinks=False)]
    if not names or fcntl is None:
        return []
    referenced = _referenced_dirs(folder)
    removed = []
    with _folder_lock(folder, exclusive=True) as got:
        if not got:  # a save is creating its stage right now: tidy up next time
            return []
        for name in names:
            if name not in referenced and _remove_if_unlocked(folder / name):
                removed.append(name)
    return removed


def _remove_if_unlocked(path: Path) -> bool:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return False  # its save is running
    try:
        _finish_killed(path.parent, path)
        shutil.rmtree(path, ignore_errors=True)
    finally:
        os.close(fd)
    return True


def _finish_killed(folder: Path, stage: Path) -> None:
    """What a save killed while committing ``stage`` left for the next one to finish: the
    config of the live weights back in place, and the links of a killed ``overwrite=False``
    commit that no live index names (the stage's own files under their names, nothing else)."""
    with contextlib.suppress(OSError):
        restore_config(folder, stage)
    named = _named_files(folder)
    for entry in os.scandir(stage):
        target = folder / entry.name
        if entry.name.startswith(".") or entry.name in named or not entry.is_file(follow_symlinks=False):
            continue
        with contextlib.suppress(OSError):
            if os.path.samefile(entry.path, target):
                os.unlink(target)


def _named_files(folder: Path) -> set[str]:
    """Every file a pointer of the folder makes live: single weights files, index files and
    the shards their entries name."""
    out: set[str] = set()
    for name in folder_checkpoint(folder):
        if name.endswith(".json"):
            out.add(name)
            with contextlib.suppress(OSError, ValueError, RecursionError, AttributeError):
                doc = json.loads((folder / name).read_bytes())
                out.update(v for v in doc.get("weight_map", {}).values() if isinstance(v, str))
        elif not re.search(r"-\d{5}-of-\d{5}\.", name):
            out.add(name)
    if os.path.lexists(folder / CONFIG):
        out.add(CONFIG)  # a config in place is never a killed save's leftover
    return out


def _referenced_dirs(folder: Path, names: Iterable[str] | None = None) -> set[str]:
    """First path components of every index entry in the folder (interim indexes point into
    stages)."""
    out: set[str] = set()
    for name in folder_checkpoint(folder) if names is None else names:
        if not name.endswith(".json"):
            continue
        try:
            doc = json.loads((folder / name).read_bytes())
            entries = doc.get("weight_map", {}).values()
        except (OSError, ValueError, RecursionError, AttributeError):
            continue
        out.update(e.split("/")[0] for e in entries if isinstance(e, str) and "/" in e)
    return out


@contextlib.contextmanager
def _folder_lock(folder: Path, *, exclusive: bool) -> Iterator[bool]:
    """A lock on the folder itself: shared while a stage is made, exclusive (non-blocking)
    while stale stages are looked for. Yields whether it was got (always, when shared)."""
    if fcntl is None:
        yield not exclusive
        return
    fd = os.open(folder, os.O_RDONLY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB if exclusive else fcntl.LOCK_SH)
        except OSError:
            yield False
            return
        yield True
    finally:
        os.close(fd)


def _lock(path: Path) -> int | None:
    """Hold an exclusive ``flock`` on ``path`` (until the descriptor is closed). Where locks
    are not supported the stage is just unlocked: cleaners fail to lock it too, and keep it."""
    if fcntl is None:
        return None
    fd = os.open(path, os.O_RDONLY)
    with contextlib.suppress(OSError):
        fcntl.flock(fd, fcntl.LOCK_EX)
    return fd


def _fsync_all(folder: Path, names: Iterable[str]) -> None:
    """Flush written files to disk before they are renamed into place: a crash of the machine
    (not only of the process) must not leave an index naming shards whose data never reached
    the disk. (The folder they move to is flushed after the renames.)"""
    for name in names:
        fd = os.open(folder / name, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _fsync_dir(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some filesystems cannot sync a directory; the files themselves are synced
    finally:
        os.close(fd)
