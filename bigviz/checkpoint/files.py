"""Find which files make up a checkpoint, whatever layout it was saved in.

Layouts, in the order a folder is searched (safetensors first, like transformers):

1. ``model.safetensors.index.json`` (transformers), or one unambiguous variant such as
   ``model.safetensors.index.fp16.json``;
2. ``model.safetensors`` (a single shard);
3. ``index.json`` (accelerate's flat ``{name: file}``) whose files are safetensors;
4. exactly one ``*.safetensors`` file;
5. the same for torch pickles: ``pytorch_model.bin.index.json`` (or one variant),
   ``pytorch_model.bin``, ``index.json``, exactly one ``*.bin`` / ``*.pt`` / ``*.pth``.

A path to a weights file or to an index file is used as is.

Example:
    >>> import tempfile, torch, pathlib
    >>> folder = pathlib.Path(tempfile.mkdtemp())
    >>> torch.save({"w": torch.ones(1)}, folder / "pytorch_model.bin")
    >>> find_files(folder).files == [folder / "pytorch_model.bin"]
    True
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath, PureWindowsPath

from bigviz.checkpoint.errors import CheckpointError, raise_problems
from bigviz.checkpoint.torch_io import TORCH_SUFFIXES
from bigviz.core.serialize import DuplicateKeysError, parse_json

__all__ = ["CheckpointFiles", "find_files", "missing_problems", "MISSING_FIX"]

_SAFE = ".safetensors"


@dataclass(frozen=True)
class CheckpointFiles:
    """Where a checkpoint's tensors are: its format, files, and the index if there is one."""

    format: str  # "safetensors" | "torch"
    path: Path  # the index file, or the single weights file
    files: list[Path]
    weight_map: dict[str, Path] | None = None  # None: every tensor of the single file
    metadata: dict = field(default_factory=dict)
    missing: tuple[Path, ...] = ()  # files the index names that are not there (check_files=False)


def find_files(path: str | Path, *, prefer_safe: bool = True, check_files: bool = True) -> CheckpointFiles:
    """Resolve a file, an index file or a folder into a `CheckpointFiles`.

    Args:
        path: a weights file, an index ``.json`` file, or a folder.
        prefer_safe: when a folder holds both safetensors and torch files, use safetensors.
        check_files: raise when the index names shards the folder lacks; with False they
            are listed in ``CheckpointFiles.missing`` instead (and left out of ``files``), so that a
            caller reading the other shards can report every problem at once.

    Raises:
        CheckpointError: nothing usable found, an ambiguous folder, a bad index, or shards
            that the index names but the folder lacks (all listed).
    """
    path = Path(path)
    if path.is_dir():
        path = _pick_in_folder(path, prefer_safe)
    elif not path.exists():
        raise CheckpointError(f"checkpoint {str(path)!r} does not exist: check the path")
    if path.name.endswith(".json"):
        return _from_index_file(path, check_files=check_files)
    return CheckpointFiles(_format_of(path), path, [path])


def _format_of(path: Path) -> str:
    if path.name.endswith(_SAFE):
        return "safetensors"
    if path.name.endswith(TORCH_SUFFIXES):
        return "torch"
    raise CheckpointError(
        f"{path}: unknown checkpoint file type; expected .safetensors, .bin, .pt, .pth or an index .json"
    )


def _pick_in_folder(folder: Path, prefer_safe: bool) -> Path:
    names = sorted(p.name for p in folder.iterdir() if p.is_file())
    kinds = [_candidates_safe(folder, names), _candidates_torch(folder, names)]
    if not prefer_safe:
        kinds.reverse()
    for candidates in kinds:
        if len(candidates) == 1:
            _refuse_a_lone_shard(folder, candidates[0])
            return candidates[0]
        if len(candidates) > 1:
            listed = ", ".join(p.name for p in candidates)
            raise CheckpointError(
                f"{folder}: ambiguous checkpoint folder: it holds {listed}; "
                "pass the path of the index or weights file you mean"
            )
    shown = ", ".join(names[:10]) or "nothing"
    raise CheckpointError(
        f"{folder}: no checkpoint found (it holds {shown}); expected model.safetensors(.index.json), "
        "pytorch_model.bin(.index.json), an index.json mapping names to files, or one weights file"
    )


def _candidates_safe(folder: Path, names: list[str]) -> list[Path]:
    return _candidates(folder, names, "model.safetensors", lambda n: n.endswith(_SAFE), _SAFE)


def _candidates_torch(folder: Path, names: list[str]) -> list[Path]:
    return _candidates(folder, names, "pytorch_model.bin", lambda n: n.endswith(TORCH_SUFFIXES), ".bin")


def _candidates(folder: Path, names: list[str], main: str, is_weights, suffix: str) -> list[Path]:
    """The files of one format that could be the checkpoint, best rule first: the single file
    before its index, as transformers' ``from_pretrained`` looks (a folder holding both is read
    as transformers reads it; bigviz's own saves rank them the same way, ``commit._preference``)."""
    if main in names:
        return [folder / main]
    if f"{main}.index.json" in names:
        return [folder / f"{main}.index.json"]
    variants = [n for n in names if f"{suffix}.index" in n and n.endswith(".json")]
    if variants:
        return [folder / n for n in variants]
    if "index.json" in names and _index_format(folder / "index.json") == _format_name(suffix):
        return [folder / "index.json"]
    return [folder / n for n in names if is_weights(n)]


def _refuse_a_lone_shard(folder: Path, path: Path) -> None:
    """A folder whose only weights file is named as one shard of several (``-00001-of-00003``)
    holds part of a checkpoint, not one: its index and other shards are missing."""
    found = re.search(r"-(\d{5})-of-(\d{5})\.", path.name)
    if found and int(found.group(2)) > 1:
        raise CheckpointError(
            f"{folder}: incomplete checkpoint: it holds {path.name}, shard {int(found.group(1))} of "
            f"{int(found.group(2))}, with no index naming the shards; {MISSING_FIX} (or pass that file's "
            "path to read it alone)"
        )


def _format_name(suffix: str) -> str:
    return "safetensors" if suffix == _SAFE else "torch"


def _index_format(path: Path) -> str | None:
    try:
        doc = parse_json(path.read_bytes(), path, "checkpoint index")
    except DuplicateKeysError as err:
        doc = err.doc  # still this format's index: opening it reports the duplicates
    except (OSError, ValueError):
        return None
    mapping = doc.get("weight_map", doc) if isinstance(doc, dict) else {}
    files = {v for v in mapping.values() if isinstance(v, str)} if isinstance(mapping, dict) else set()
    if files and all(f.endswith(_SAFE) for f in files):
        return "safetensors"
    if files and all(f.endswith(TORCH_SUFFIXES) for f in files):
        return "torch"
    return None


def _from_index_file(path: Path, *, check_files: bool = True) -> CheckpointFiles:
    try:
        doc = parse_json(path.read_bytes(), path, "checkpoint index")  # deep nesting: an error, not a crash
    except OSError as err:
        raise CheckpointError(f"{path}: cannot read the index ({err.strerror or err})") from err
    except DuplicateKeysError as err:
        raise CheckpointError(
            f"index '{path}' names a key more than once", _duplicate_problems(path, err.duplicates), fix=_DUPLICATE_FIX
        ) from None
    except ValueError as err:
        raise CheckpointError(f"{err}; re-download or re-save it") from err
    if not isinstance(doc, dict):
        raise CheckpointError(f"{path}: the index must be a JSON object, not {type(doc).__name__}")
    mapping, metadata = (doc["weight_map"], doc.get("metadata", {})) if "weight_map" in doc else (doc, {})
    problems = _check_mapping(path, mapping)
    if not isinstance(metadata, dict):
        problems.append(f"{path}: 'metadata' must be a JSON object, not {type(metadata).__name__}")
    raise_problems(problems, f"cannot read index '{path}'")
    files = sorted({path.parent / f for f in mapping.values()}, key=lambda p: p.name)
    formats = {_format_of(f) for f in files}
    if len(formats) > 1:
        raise CheckpointError(f"{path}: the index mixes safetensors and torch files; keep one format")
    missing = tuple(f for f in files if not f.is_file())
    if check_files:
        raise_problems(missing_problems(missing), f"incomplete checkpoint '{path.parent}'", fix=MISSING_FIX)
    weight_map = {name: path.parent / f for name, f in mapping.items()}
    return CheckpointFiles(
        formats.pop() if formats else "safetensors",
        path,
        [f for f in files if f not in missing],
        weight_map,
        dict(metadata),
        missing,
    )


_DUPLICATE_FIX = (
    "JSON keeps only the last of them, so which file holds the tensor is unknown: fix the index so "
    "each tensor is listed once, or re-download or re-save the checkpoint"
)


def _duplicate_problems(path: Path, duplicates: dict[str, list[object]]) -> list[str]:
    """One line per key given twice: a tensor in two files (both named), or another key."""
    out = []
    for key, values in duplicates.items():
        if all(isinstance(v, str) for v in values):
            files = ", ".join(dict.fromkeys(str(v) for v in values))
            same = " (the same file each time)" if len(set(values)) == 1 else ""
            out.append(f"{path.name}: tensor {key!r} is listed {len(values)} times, in {files}{same}")
        else:
            out.append(f"{path.name}: key {key!r} appears {len(values)} times")
    return out


MISSING_FIX = "download or copy the missing shards into the folder (or fix the index)"


def missing_problems(missing: tuple[Path, ...]) -> list[str]:
    """One problem line per shard the index names but the folder lacks."""
    return [f"{f}: shard named by the index is missing" for f in missing]


def _check_mapping(path: Path, mapping: object) -> list[str]:
    if not isinstance(mapping, dict):
        return [f"{path}: 'weight_map' must map tensor names to file names"]
    values = list(mapping.values())
    if values and all(isinstance(v, dict) and "dtype" in v for v in values):
        return [
            f"{path}: this is an accelerate offload index (tensors in .dat files), not a "
            "checkpoint; load the original checkpoint instead"
        ]
    problems = []
    by_file: dict[str, list[str]] = {}
    for name, file in mapping.items():
        if not isinstance(file, str):
            problems.append(f"{path}: tensor {name!r} maps to {_short(file)}, not a file name")
        else:
            by_file.setdefault(file, []).append(name)
    for file, names in by_file.items():  # each file checked once (thousands of tensors, few files)
        who = f"tensor {names[0]!r}" + (f" (and {len(names) - 1} more)" if len(names) > 1 else "")
        problems += _entry_problems(path, who, file)
    return problems


def _entry_problems(path: Path, who: str, file: str) -> list[str]:
    """An index entry must name a file inside the index's folder: not absolute, no ``..``, and
    no directory on the way that leads outside (a symlinked directory). The file itself may
    be a symlink: the Hugging Face cache keeps every file of a snapshot as a symlink into its
    ``blobs`` folder."""
    where = f"{path}: {who} maps to {file!r}"
    parts = PurePosixPath(file.replace("\\", "/"))
    if not file or parts.is_absolute() or PureWindowsPath(file).drive or PureWindowsPath(file).root:
        return [
            f"{where}, an absolute or empty path: index entries name files inside the checkpoint "
            "folder; this index may be crafted, do not use it"
        ]
    if ".." in parts.parts:
        return [f"{where}, which leads out of the checkpoint folder ('..'); this index may be crafted, do not use it"]
    folder = path.parent.resolve()
    directory = (path.parent / parts).parent.resolve()
    if directory != folder and folder not in directory.parents:
        return [
            f"{where}, inside a directory that leads out of the checkpoint folder (to {directory}); "
            "this index may be crafted, do not use it"
        ]
    return []


def _short(value: object) -> str:
    try:
        text = repr(value)
    except RecursionError:
        return "(a deeply nested value)"
    return text if len(text) <= 80 else text[:77] + "..."
