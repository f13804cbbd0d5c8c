"""Run the teaching notebooks top to bottom in a fresh kernel and save them with their outputs.

The committed notebooks are read on GitHub, nbviewer and Binder as they are saved, so they are
saved *executed*: every cell's output, every figure (as PNG or SVG: they show with no script
and no network). Run this after editing a notebook, then ``pytest tests/test_notebooks_meta.py``.

Usage:
    python tools/execute_notebooks.py                 # every notebook in notebooks/
    python tools/execute_notebooks.py 06_offload_and_run 01_quickstart

The kernel starts with an IPython startup file of this script's (:data:`QUIET`) that silences
import-time log lines of other packages, which are not the notebooks' and would be saved as
stderr (tests/test_notebooks_meta.py refuses stderr in a saved notebook): transformers imports
torchao when it is installed, and a torchao build whose compiled parts do not match the Python
logs "Failed to load ...so" with the library's absolute path, then torch a deprecation notice;
bitsandbytes, on a CPU with AVX-512 BF16, logs that the optional ``kernels`` package is missing.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"
QUIET = """# written by tools/execute_notebooks.py: other packages' import-time log lines, not the notebook's
import logging

logging.getLogger("torchao").setLevel(logging.ERROR)  # "Failed to load .../torchao/_C_*.so" (a mismatched build)
logging.getLogger("torch.utils._pytree").setLevel(logging.ERROR)  # torchao's enums: a torch deprecation notice
logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)  # AVX-512 BF16 CPUs: "pip install kernels"
"""


def quiet_kernels(folder: Path) -> None:
    """Make kernels started from now on run :data:`QUIET` first (an IPython profile in ``folder``)."""
    startup = folder / "profile_default" / "startup"
    startup.mkdir(parents=True, exist_ok=True)
    (startup / "00-quiet.py").write_text(QUIET)
    os.environ["IPYTHONDIR"] = str(folder)


def execute(path: Path, *, timeout: int = 600) -> float:
    """Execute ``path`` in place (working directory: notebooks/); returns the seconds it took."""
    nb = nbformat.read(path, as_version=4)
    # no widget state in the file: it is large, and stale once the kernel is gone (the planner's
    # output carries its own picture for frontends without a kernel)
    client = NotebookClient(
        nb,
        timeout=timeout,
        kernel_name="python3",
        store_widget_state=False,
        resources={"metadata": {"path": str(NOTEBOOKS)}},
    )
    start = time.perf_counter()
    client.execute()
    took = time.perf_counter() - start
    for cell in nb.cells:  # timestamps would change every run: keep diffs to what changed
        cell.metadata.pop("execution", None)
    nbformat.write(nb, path)
    return took


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", help="notebook names without .ipynb (default: all)")
    args = parser.parse_args(argv)
    paths = [NOTEBOOKS / f"{n.removesuffix('.ipynb')}.ipynb" for n in args.names] or sorted(NOTEBOOKS.glob("*.ipynb"))
    with tempfile.TemporaryDirectory(prefix="bigviz-ipython-") as profile:
        quiet_kernels(Path(profile))
        for path in paths:
            print(f"{path.name}: {execute(path):.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
