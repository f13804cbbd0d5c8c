"""Open ``.bin`` / ``.pt`` / ``.pth`` pickles safely: ``weights_only=True``, memory-mapped.

``torch.load(weights_only=True)`` refuses any pickle that would run code (its unpickler only
rebuilds tensors and plain containers). ``mmap=True`` maps the tensor data instead of reading
it, so opening a file costs only its pickle, and a tensor is read when it is first used.
Files in the pre-1.6 format cannot be mapped; they are read (still with ``weights_only``).

Example:
    >>> import tempfile, torch, pathlib
    >>> path = pathlib.Path(tempfile.mkdtemp()) / "w.bin"
    >>> torch.save({"w": torch.ones(2)}, path)
    >>> load_torch_file(path)["w"]
    tensor([1., 1.])
"""
from __future__ import annotations

import pickle
import zipfile
from pathlib import Path

import torch

from bigviz.checkpoint.errors import raise_problems

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
    except pickle.UnpicklingError as err:
        if "weights only" not in str(err).lower():
            raise_problems([f"{path}: not a readable torch checkpoint ({str(err)[:200]})"],
                           f"cannot read '{path}'", fix="re-download the file or save it again")
        lines = [ln for ln in str(err).splitlines() if "GLOBAL" in ln or "Unsupported" in ln]
        first = (lines[0] if lines else str(err).strip().splitlines()[-1])[:200]
        problems.append(
            f"{path}: refused to unpickle ({first}); the pickle would build objects other than "
            "tensors, which could run code. If you trust its source, load it with "
            "torch.load(weights_only=False) and re-save it with bigviz.save_sharded"
        )
    except (RuntimeError, OSError, EOFError, ValueError, KeyError, zipfile.BadZipFile) as err:
        problems.append(f"{path}: not a readable torch checkpoint ({str(err)[:200]}); "
                        "the file is truncated or corrupt: re-download it or save it again")
    if not problems:
        state = _unwrap(state)
        if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
            problems.append(f"{path}: holds a {type(state).__name__}, not a dict of tensors")
    raise_problems(problems, f"cannot read '{path}'")
    return state  # type: ignore[return-value]


def _load(path: Path) -> object:
    if not zipfile.is_zipfile(path):
        # legacy (pre-1.6) format: mmap is impossible, but weights_only still guards it
        return torch.load(path, map_location="cpu", weights_only=True)
    return torch.load(path, map_location="cpu", weights_only=True, mmap=True)


def _unwrap(state: object) -> object:
    if isinstance(state, dict) and len(state) == 1:
        (key, inner), = state.items()
        if key in ("state_dict", "model") and isinstance(inner, dict):
            return inner
    return state
