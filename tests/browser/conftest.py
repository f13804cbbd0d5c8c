"""Headless Chromium for the browser tests: Debian's ``chromium`` package, no network; and a
Jupyter server on localhost for the live-widget tests.

Install it with ``apt-get install -y chromium``; without ``/usr/bin/chromium`` the tests
skip and say so. The live-widget tests drive Chromium with the ``playwright`` package (its
own browser download is never used: ``executable_path`` points at Debian's).
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import pytest

CHROMIUM = Path("/usr/bin/chromium")
FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--hide-scrollbars",
    "--host-resolver-rules=MAP * ~NOTFOUND",  # no network: the report must be offline
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


# ---- a Jupyter server for the live-widget tests --------------------------------------------


def one_cell_notebook(path: Path, source: str) -> None:
    """Write a notebook of one code cell (not run yet) for the python3 kernel at ``path``."""
    cell = {
        "cell_type": "code",
        "id": "planner",
        "metadata": {},
        "execution_count": None,
        "outputs": [],
        "source": source,
    }
    kernel = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb = {"nbformat": 4, "nbformat_minor": 5, "cells": [cell], "metadata": {"kernelspec": kernel}}
    path.write_text(json.dumps(nb))


@dataclass
class JupyterServer:
    """A Jupyter server (JupyterLab or Notebook 7) of this test run, on localhost."""

    url: str
    token: str
    root: Path
    process: subprocess.Popen

    def page_url(self, notebook: str, *, app: str = "lab") -> str:
        where = "lab/tree" if app == "lab" else "notebooks"
        return f"{self.url}/{where}/{notebook}?token={self.token}"

    def api(self, path: str, *, method: str = "GET", body: Any = None) -> Any:
        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(
            f"{self.url}/api/{path}",
            method=method,
            data=data,
            headers={"Authorization": f"token {self.token}", "Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=60) as reply:
            text = reply.read()
        return json.loads(text) if text else None

    def start_kernel(self, notebook: str) -> None:
        """Start the notebook's kernel session now (the page then joins it, asking nothing)."""
        self.api(
            "sessions",
            method="POST",
            body={"path": notebook, "name": notebook, "type": "notebook", "kernel": {"name": "python3"}},
        )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _settings(root: Path) -> dict[str, str]:
    """Every Jupyter folder inside ``root`` (nothing read from or written to the home folder),
    and JupyterLab's news and update checks off (no network, no pop-up)."""
    env = {
        "JUPYTER_CONFIG_DIR": "config",
        "JUPYTER_DATA_DIR": "data",
        "JUPYTER_RUNTIME_DIR": "runtime",
        "JUPYTERLAB_SETTINGS_DIR": "settings",
        "JUPYTERLAB_WORKSPACES_DIR": "workspaces",
        "IPYTHONDIR": "ipython",
    }
    env = {k: str(root / ".jupyter" / v) for k, v in env.items()}
    settings = {
        ("apputils-extension", "notification"): {"fetchNews": "false", "checkForUpdates": False},
        ("notebook-extension", "tracker"): {"autoStartDefaultKernel": True},
    }
    for (plugin, name), values in settings.items():
        folder = Path(env["JUPYTERLAB_SETTINGS_DIR"]) / "@jupyterlab" / plugin
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"{name}.jupyterlab-settings").write_text(json.dumps(values))
    return env


def _wait_until_up(server: JupyterServer, deadline: float) -> None:
    while True:
        if server.process.poll() is not None:
            log = (server.root / ".jupyter" / "server.log").read_text()[-3000:]
            raise RuntimeError(f"the Jupyter server exited ({server.process.returncode}):\n{log}")
        try:
            server.api("status")
            return
        except OSError:
            if time.monotonic() > deadline:
                raise TimeoutError("the Jupyter server did not answer within 120 s") from None
            time.sleep(0.3)


def _stop(server: JupyterServer) -> None:
    """Shut down the kernels, then the server; kill what is left of them (kernels run in
    their own sessions: found by the connection files under this server's runtime folder)."""
    try:
        for kernel in server.api("kernels"):
            server.api(f"kernels/{kernel['id']}", method="DELETE")
    except OSError:
        pass
    server.process.terminate()
    try:
        server.process.wait(30)
    except subprocess.TimeoutExpired:
        os.killpg(server.process.pid, signal.SIGKILL)
        server.process.wait(10)
    runtime = str(server.root / ".jupyter" / "runtime")
    for proc in psutil.process_iter(["pid", "cmdline"]):
        if any(runtime in arg for arg in proc.info["cmdline"] or ()):
            proc.kill()


@contextlib.contextmanager
def jupyter_server(root: Path, *, app: str = "lab") -> Iterator[JupyterServer]:
    """``jupyter lab`` (or ``notebook``) on a free localhost port, with a token, no browser,
    serving ``root``; stopped, kernels included, when the block ends (even on failure)."""
    env = {**os.environ, **_settings(root)}
    token = secrets.token_hex(16)
    port = _free_port()
    args = [
        sys.executable,
        "-m",
        "jupyter",
        app,
        "--no-browser",
        "--allow-root",
        "--ip=127.0.0.1",
        f"--port={port}",
        f"--IdentityProvider.token={token}",
        f"--ServerApp.root_dir={root}",
        "--ServerApp.open_browser=False",
        "--LabApp.expose_app_in_browser=True",
        "--JupyterNotebookApp.expose_app_in_browser=True",
    ]
    log = open(root / ".jupyter" / "server.log", "w")
    process = subprocess.Popen(args, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    server = JupyterServer(f"http://127.0.0.1:{port}", token, root, process)
    try:
        _wait_until_up(server, time.monotonic() + 120)
        yield server
    finally:
        _stop(server)
        log.close()


@contextlib.contextmanager
def browser_page(*, width: int = 1280, height: int = 800) -> Iterator[Any]:
    """A headless Chromium page (playwright driving Debian's chromium), closed at the end."""
    if not CHROMIUM.exists():
        pytest.skip("needs Debian's chromium at /usr/bin/chromium (apt-get install -y chromium)")
    from playwright.sync_api import sync_playwright  # the test extra installs it: missing is an error

    with sync_playwright() as p:
        # playwright adds --headless; the network stays off except for this machine's server
        flags = [f for f in FLAGS if f != "--headless" and not f.startswith("--host-resolver-rules")]
        flags.append("--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1")
        browser = p.chromium.launch(executable_path=str(CHROMIUM), args=flags)
        try:
            page = browser.new_page(viewport={"width": width, "height": height})
            page.set_default_timeout(90_000)
            yield page
        finally:
            browser.close()
