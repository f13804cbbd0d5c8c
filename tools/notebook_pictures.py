"""One picture per notebook for the README's notebooks table, taken from its saved outputs.

The notebooks are saved executed (``tools/execute_notebooks.py``); this copies one figure of
each (the first, or the one :data:`PICKS` names) to ``docs/notebooks/<notebook>.png`` (or
``.svg``), so the README shows what each notebook draws without a second copy to keep in step
by hand. ``tests/test_readme.py`` checks the pictures are the notebooks' own.

Usage:
    python tools/notebook_pictures.py           # write docs/notebooks/*
    python tools/notebook_pictures.py --check   # exit 1 if one is missing or stale
"""

from __future__ import annotations

import argparse
import base64
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "docs" / "notebooks"
PICKS = {"08_will_it_fit": 1, "09_pipeline": 1}  # notebook -> which of its pictures (default: the first)


def pictures(notebook: Path) -> list[tuple[str, bytes]]:
    """``(suffix, bytes)`` of every PNG or SVG output of a saved notebook, in order."""
    out = []
    for cell in json.loads(notebook.read_text(encoding="utf-8"))["cells"]:
        for output in cell.get("outputs", []):
            data = output.get("data", {})
            if "image/png" in data:
                out.append((".png", base64.b64decode("".join(data["image/png"]))))
            elif "image/svg+xml" in data:
                svg = data["image/svg+xml"]
                out.append((".svg", ("".join(svg) if isinstance(svg, list) else svg).encode("utf-8")))
    return out


def wanted() -> dict[str, bytes]:
    """File name under ``docs/notebooks`` -> its bytes, for every notebook that draws."""
    files = {}
    for notebook in sorted((ROOT / "notebooks").glob("*.ipynb")):
        found = pictures(notebook)
        if found:
            suffix, data = found[min(PICKS.get(notebook.stem, 0), len(found) - 1)]
            files[notebook.stem + suffix] = data
    return files


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="only report missing or stale pictures")
    args = parser.parse_args(argv)
    stale = [name for name, data in wanted().items() if not (OUT / name).exists() or (OUT / name).read_bytes() != data]
    if stale and not args.check:
        OUT.mkdir(parents=True, exist_ok=True)
        for name, data in wanted().items():
            (OUT / name).write_bytes(data)
    print(("stale: " if args.check else "written: ") + ", ".join(stale) if stale else "notebook pictures up to date")
    return 1 if stale and args.check else 0


if __name__ == "__main__":
    sys.exit(main())
