"""Open ``.bin`` / ``.pt`` / ``.pth`` pickles safely: ``weights_only=True``, memory-mapped.

``torch.load(weights_only=True)`` refuses any pickle that would run code (its unpickler only
rebuilds tensors and plain containers). ``mmap=True`` maps the tensor data instead of reading
it, so opening a file costs only its pickle, and a tensor is read when it is first used.
Files in the pre-1.6 format cannot be mapped; they are read (still with ``weights_only``).

Mapping trusts the zip: torch takes each tensor's bytes at its record's offset, so a record
that is compressed or shorter than its tensor would silently give garbage. Every record is
checked first (its size against the storage the pickle declares, and its compression, read
without building anything the pickle names): a short record is refused, naming the file;
a compressed one is read with torch's checked reader instead (it decompresses and checks
sizes). Keys that are not strings, tensors on ``meta`` and values that are not tensors are
refused up front too, all listed, with the file named.

Example:
    >>> import tempfile, torch, pathlib
    >>> path = pathlib.Path(tempfile.mkdtemp()) / "w.bin"
    >>> torch.save({"w": torch.ones(2)}, path)
    >>> load_torch_file(path)["w"]
    tensor([1., 1.])
"""

from __future__ import annotations

import functools
import io
import pickle
import struct
import warnings
import zipfile
from pathlib import Path

import torch

from bigviz.checkpoint.errors import CheckpointError, raise_problems

__all__ = ["load_torch_file", "TORCH_SUFFIXES"]

TORCH_SUFFIXES = (".bin", ".pt", ".pth")


def load_torch_file(path: Path) -> dict[str, torch.Tensor]:
    """A flat ``{name: tensor}`` dict from a torch checkpoint file, mapped, never running code.

    A top-level ``{"state_dict": {...}}`` or ``{"model": {...}}`` wrapper (common in training
    checkpoints) is unwrapped.

    Raises:
        CheckpointError: the file is missing, not a torch checkpoint, would run code when
            unpickled, or holds no tensors.
    """
    problems: list[str] = []
    state: object = None
    try:
        state = _load(path)
    except FileNotFoundError:
        problems.append(f"{path}: file not found")
    except CheckpointError as err:  # a record shorter than its tensor (before ValueError: a subclass)
        problems += err.problems
    except pickle.UnpicklingError as err:
        if "weights only" not in str(err).lower():
            raise_problems(
                [f"{path}: not a readable torch checkpoint ({str(err)[:200]})"],
                f"cannot read '{path}'",
                fix="re-download the file or save it again",
            )
        lines = [ln for ln in str(err).splitlines() if "GLOBAL" in ln or "Unsupported" in ln]
        first = (lines[0] if lines else str(err).strip().splitlines()[-1])[:200]
        problems.append(
            f"{path}: refused to unpickle ({first}); the pickle would build objects other than "
            "tensors, which could run code. If you trust its source, load it with "
            "torch.load(weights_only=False) and re-save it with bigviz.save_sharded"
        )
    except (RuntimeError, OSError, EOFError, ValueError, KeyError, zipfile.BadZipFile) as err:
        problems.append(
            f"{path}: not a readable torch checkpoint ({str(err)[:200]}); "
            "the file is truncated or corrupt: re-download it or save it again"
        )
    if not problems:
        state = _unwrap(state)
        problems += _content_problems(path, state)
    raise_problems(problems, f"cannot read '{path}'")
    return state  # type: ignore[return-value]


def _content_problems(path: Path, state: object) -> list[str]:
    """What makes ``state`` not a flat ``{name: tensor}`` with data: every bad key listed."""
    if not isinstance(state, dict):
        return [f"{path}: holds a {type(state).__name__}, not a dict of tensors"]
    problems = []
    for key, value in state.items():
        if not isinstance(key, str):
            problems.append(f"{path}: key {key!r} is {_a(key)}, not a tensor name (a string)")
        elif not isinstance(value, torch.Tensor):
            problems.append(
                f"{path}: {key!r} holds {_a(value)}, not a tensor (nested or "
                "non-tensor values are not weights: save a flat {name: tensor} state dict)"
            )
        elif value.is_meta:
            problems.append(
                f"{path}: {key!r} is a tensor on the meta device: the file holds no data for "
                "it; save the model after its weights are loaded"
            )
    return problems


def _a(value: object) -> str:
    name = type(value).__name__
    return f"{'an' if name[0] in 'aeiou' else 'a'} {name}"


def _load(path: Path) -> object:
    if not zipfile.is_zipfile(path):
        # legacy (pre-1.6) format: mmap is impossible, but weights_only still guards it
        return torch.load(path, map_location="cpu", weights_only=True)
    mappable = _records_mappable(path)
    return torch.load(path, map_location="cpu", weights_only=True, mmap=mappable)


def _records_mappable(path: Path) -> bool:
    """True when every tensor record is stored uncompressed and long enough to be mapped.

    Raises:
        CheckpointError: a record is shorter than the storage the pickle declares for it.
    """
    with zipfile.ZipFile(path) as archive:
        names = archive.namelist()
        root = names[0].split("/")[0] if names else ""
        try:
            storages = _declared_storages(archive.read(f"{root}/data.pkl"))
        except Exception:  # noqa: BLE001 - not our format to judge: torch's checked read will say
            return False
        size = path.stat().st_size
        problems, mappable = [], True
        with open(path, "rb") as raw:
            for key, nbytes in storages.items():
                verdict = _record_verdict(archive, raw, f"{root}/data/{key}", nbytes, size)
                if verdict == "compressed":
                    mappable = False
                elif verdict:
                    problems.append(
                        f"{path}: {verdict}; the file is truncated or corrupt: re-download it or save it again"
                    )
    raise_problems(problems, f"cannot read '{path}'")
    return mappable


def _record_verdict(archive: zipfile.ZipFile, raw: io.BufferedReader, name: str, nbytes: int | None, size: int) -> str:
    """``""`` for a record that can be mapped, ``"compressed"``, or what is wrong with it."""
    try:
        info = archive.getinfo(name)
    except KeyError:
        return f"record {name} is missing"
    raw.seek(info.header_offset)
    local = raw.read(30)
    if len(local) < 30 or local[:4] != b"PK\x03\x04":
        return f"record {name} has no valid local header"
    (method,) = struct.unpack("<H", local[8:10])
    name_len, extra_len = struct.unpack("<HH", local[26:30])
    if info.compress_type != zipfile.ZIP_STORED or method != zipfile.ZIP_STORED or nbytes is None:
        return "compressed"  # or a storage type we cannot size: read it the checked way
    start = info.header_offset + 30 + name_len + extra_len
    if info.file_size < nbytes or start + nbytes > size:
        held = min(info.file_size, max(size - start, 0))
        return f"record {name} holds {held} bytes but its tensor storage needs {nbytes}"
    return ""


class _Inert:
    """Stands for anything a pickle names: built from any arguments, does nothing."""

    def __new__(cls, *args: object, **kwargs: object) -> _Inert:
        return object.__new__(cls)

    def __init__(self, *args: object, **kwargs: object) -> None:
        pass

    def __setstate__(self, state: object) -> None:
        pass


class _StorageType(_Inert):
    pass


class _StorageScan(pickle.Unpickler):
    """Reads which storages a torch pickle refers to (key -> bytes) and builds nothing real:
    every global it names becomes an inert stand-in, so no code of the file's choosing runs."""

    def __init__(self, data: bytes) -> None:
        super().__init__(io.BytesIO(data))
        self.storages: dict[str, int | None] = {}

    def find_class(self, module: str, name: str) -> type:
        if (module, name) == ("collections", "OrderedDict"):
            return dict
        if name.endswith("Storage"):
            return type(name, (_StorageType,), {"itemsize": _storage_itemsizes().get(name)})
        return _Inert

    def persistent_load(self, pid: object) -> None:
        if isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage":
            _, kind, key, _location, numel = pid
            itemsize = getattr(kind, "itemsize", None)
            ok = isinstance(numel, int) and itemsize is not None
            self.storages[str(key)] = numel * itemsize if ok else None


def _declared_storages(data: bytes) -> dict[str, int | None]:
    scan = _StorageScan(data)
    scan.load()
    return scan.storages


@functools.cache
def _storage_itemsizes() -> dict[str, int]:
    """Bytes per element of torch's storage classes by name (``UntypedStorage`` counts bytes)."""
    sizes = {"UntypedStorage": 1}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TypedStorage is deprecated; its dtype is all we read
        for name in dir(torch):
            dtype = getattr(getattr(torch, name, None), "dtype", None) if name.endswith("Storage") else None
            if isinstance(dtype, torch.dtype):
                sizes[name] = dtype.itemsize
    return sizes


def _unwrap(state: object) -> object:
    if isinstance(state, dict) and len(state) == 1:
        ((key, inner),) = state.items()
        if key in ("state_dict", "model") and isinstance(inner, dict):
            return inner
    return state
