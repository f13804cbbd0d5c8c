"""Shared checks of the hostile-input suite: every case checks the error *and* that nothing
was lost. "Nothing lost" is checked byte for byte: `snapshot` reads every file under a folder,
and a case compares the snapshot after the failure with the one before. Models are compared
value for value with `model_state`.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import nn


def snapshot(folder: Path) -> dict[str, bytes]:
    """Every file under ``folder`` (symlinks followed), relative path -> bytes."""
    out: dict[str, bytes] = {}
    for root, _dirs, files in os.walk(folder):
        for name in files:
            path = Path(root) / name
            out[str(path.relative_to(folder))] = path.read_bytes()
    return out


def model_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """A detached copy of every parameter and buffer (by name), to compare after a failure."""
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_same_state(model: nn.Module, before: dict[str, torch.Tensor]) -> None:
    """``model`` holds exactly the values of ``before`` (names, dtypes, bits)."""
    after = model.state_dict()
    assert after.keys() == before.keys()
    for name, tensor in before.items():
        assert after[name].dtype == tensor.dtype and torch.equal(after[name], tensor), name
