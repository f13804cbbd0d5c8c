"""Fixtures of the hostile-input suite: real small and read-only filesystems (tmpfs)."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    """A 1 MiB tmpfs (a real full disk); skipped where mounting is not allowed."""
    mount = tmp_path / "small"
    mount.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)], capture_output=True, text=True
    )
    if done.returncode != 0:
        pytest.skip(
            f"cannot mount a small tmpfs here ({done.stderr.strip()[:100]}); "
            "the fault-injected ENOSPC test covers the same path"
        )
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], capture_output=True)


def remount_read_only(mount: Path) -> None:
    done = subprocess.run(["mount", "-o", "remount,ro", str(mount)], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot remount read-only here ({done.stderr.strip()[:100]})")
