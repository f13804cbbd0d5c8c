"""Headless Chromium for the browser tests: Debian's ``chromium`` package, no network.

Install it with ``apt-get install -y chromium``; without ``/usr/bin/chromium`` the tests
skip and say so.
"""
from __future__ import annotations

import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

CHROMIUM = Path("/usr/bin/chromium")
FLAGS = (
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
    "--hide-scrollbars", "--host-resolver-rules=MAP * ~NOTFOUND",  # no network: the report must be offline
)

Chromium = Callable[..., subprocess.CompletedProcess]


@pytest.fixture
def chromium(tmp_path: Path) -> Chromium:
    """``chromium(url, *flags)`` runs headless Chromium once and returns the finished process."""
    if not CHROMIUM.exists():
        pytest.skip("needs Debian's chromium at /usr/bin/chromium (apt-get install -y chromium)")
    profile = tmp_path / "chromium-profile"

    def run(url: str, *flags: str) -> subprocess.CompletedProcess:
        args = [str(CHROMIUM), *FLAGS, f"--user-data-dir={profile}", *flags, url]
        done = subprocess.run(args, capture_output=True, text=True, timeout=600)  # slow only when the machine is busy
        assert done.returncode == 0, f"chromium failed ({done.returncode}): {done.stderr[-2000:]}"
        return done

    return run
