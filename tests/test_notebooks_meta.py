"""Structure checks for the teaching notebooks in ``notebooks/`` (fast: JSON only, no kernel).

nbval (``pytest --nbval-lax notebooks/``) re-runs the notebooks; these tests check what is
committed: every notebook ran top to bottom without errors, ends in a cell of assertions, keeps
its stored outputs small, names no absolute path of the machine it ran on, and writes only
under ``tempfile.mkdtemp()``.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"
EXPECTED = [
    "01_quickstart",
    "02_why_big_models_break",
    "03_sharded_checkpoints",
    "04_device_maps",
    "05_room_to_run",
    "06_offload_and_run",
    "07_transformers",
    "08_will_it_fit",
    "09_pipeline",
    "10_shrink_it",
]
MAX_OUTPUT_BYTES = 150_000  # one stored output (a planner's static HTML is ~120 KB)
MAX_NOTEBOOK_BYTES = 1_000_000  # the whole .ipynb file
# an absolute path of a POSIX home/temp/work folder or a Windows drive, e.g. "/tmp/x", "C:\Users"
ABSOLUTE_PATH = re.compile(r"(?<![\w.~])/(?:tmp|home|Users|root|work|var/folders|private)/|\b[A-Za-z]:\\\\?Users")


def _load(name: str) -> dict[str, Any]:
    return json.loads((NOTEBOOKS / f"{name}.ipynb").read_text(encoding="utf-8"))


def _code_cells(nb: dict[str, Any]) -> list[dict[str, Any]]:
    return [c for c in nb["cells"] if c["cell_type"] == "code"]


def _text(source: str | list[str]) -> str:
    return source if isinstance(source, str) else "".join(source)


def _output_texts(cell: dict[str, Any]) -> list[str]:
    """Every stored output of a code cell as text (images excluded: they are base64)."""
    texts = []
    for out in cell.get("outputs", []):
        if "text" in out:
            texts.append(_text(out["text"]))
        for mime, value in out.get("data", {}).items():
            if not mime.startswith("image/"):
                texts.append(value if isinstance(value, str) else json.dumps(value))
        if out.get("output_type") == "error":
            texts.append("\n".join(out.get("traceback", [])))
    return texts


def test_every_expected_notebook_is_there() -> None:
    found = sorted(p.stem for p in NOTEBOOKS.glob("*.ipynb"))
    assert found == EXPECTED, f"notebooks/ holds {found}, expected {EXPECTED}"


@pytest.mark.parametrize("name", EXPECTED)
def test_valid_notebook_with_the_venv_kernel(name: str) -> None:
    nb = _load(name)
    assert nb["nbformat"] == 4
    assert nb["metadata"]["kernelspec"]["name"] == "python3"
    first = nb["cells"][0]
    assert first["cell_type"] == "markdown" and _text(first["source"]).startswith(f"# {name[:2]} ")
    ids = [c.get("id") for c in nb["cells"]]
    assert all(ids) and len(set(ids)) == len(ids), "every cell needs a unique id"


@pytest.mark.parametrize("name", EXPECTED)
def test_ran_top_to_bottom_without_errors(name: str) -> None:
    cells = _code_cells(_load(name))
    counts = [c["execution_count"] for c in cells]
    assert counts == list(range(1, len(cells) + 1)), f"{name}: run it top to bottom in a fresh kernel ({counts})"
    errors = [i for i, c in enumerate(cells) for o in c.get("outputs", []) if o["output_type"] == "error"]
    assert not errors, f"{name}: code cells {errors} stored an error"


@pytest.mark.parametrize("name", EXPECTED)
def test_ends_with_a_cell_of_assertions(name: str) -> None:
    last = _code_cells(_load(name))[-1]
    source = _text(last["source"])
    assert source.count("assert ") >= 3, f"{name}: the last code cell must check the story with assertions"
    assert any("all checks passed" in t for t in _output_texts(last)), f"{name}: stored run did not pass its checks"


@pytest.mark.parametrize("name", EXPECTED)
def test_stored_outputs_are_small(name: str) -> None:
    path = NOTEBOOKS / f"{name}.ipynb"
    assert path.stat().st_size < MAX_NOTEBOOK_BYTES, f"{name}: {path.stat().st_size} bytes; clear big outputs"
    for i, cell in enumerate(_code_cells(_load(name))):
        for out in cell.get("outputs", []):
            size = len(json.dumps(out))
            assert size < MAX_OUTPUT_BYTES, f"{name}: code cell {i} stores a {size}-byte output"


@pytest.mark.parametrize("name", EXPECTED)
def test_no_absolute_paths(name: str) -> None:
    nb = _load(name)
    for i, cell in enumerate(nb["cells"]):
        texts = [_text(cell["source"])] + (_output_texts(cell) if cell["cell_type"] == "code" else [])
        for text in texts:
            match = ABSOLUTE_PATH.search(text)
            assert match is None, (
                f"{name}: cell {i} names an absolute path: ...{text[max(0, match.start() - 40) : match.end() + 40]}..."
            )


@pytest.mark.parametrize("name", EXPECTED)
def test_writes_only_to_a_temporary_folder(name: str) -> None:
    source = "\n".join(_text(c["source"]) for c in _code_cells(_load(name)))
    assert "tempfile.mkdtemp(" in source, f"{name}: write under tempfile.mkdtemp()"
    assert "rmtree(workdir" in source, f"{name}: remove the temporary folder at the end"
    # relative output paths would land in notebooks/ (the kernel's working directory)
    writes = re.findall(
        r"""(?:save_json|save_html|save_sharded|save_pretrained|torch\.save|save_device_map)\(\s*(['"][^'"]+['"])""",
        source,
    )
    writes += re.findall(r"""open\(\s*(['"][^'"]+['"])\s*,\s*['"][wax]""", source)
    writes = [w for w in writes if not w.strip("'\"").startswith("/proc/")]  # kernel knobs, not files
    assert not writes, f"{name}: writes to literal paths {writes}; use paths under the temporary folder"


@pytest.mark.parametrize("name", EXPECTED)
def test_checked_outputs_are_plain_text(name: str) -> None:
    """Cells whose output nbval compares must print deterministic text only (no images, no HTML)."""
    for i, cell in enumerate(_code_cells(_load(name))):
        if "# NBVAL_CHECK_OUTPUT" in _text(cell["source"]):
            kinds = {o["output_type"] for o in cell["outputs"]}
            assert kinds <= {"stream"}, f"{name}: checked cell {i} stores {kinds}; print text instead"
            assert cell["outputs"], f"{name}: checked cell {i} prints nothing to compare"


INTERACTIVE = ("application/vnd.plotly.v1+json", "application/vnd.jupyter.widget-view+json")
PICTURES = ("image/png", "image/svg+xml")
# matplotlib draws when a cell shows it (a Planner or treemap shown carries an interactive output)
FIGURE_CALLS = re.compile(r"plt\.show\(\)|\.plot(?:\.\w+)?\(")


def _is_picture(mime: str, value: str | list[str]) -> bool:
    """A PNG (base64, starting with the PNG signature) or a well-formed SVG document."""
    text = _text(value)
    if mime == "image/png":
        return text.startswith("iVBORw0KGgo")  # base64 of b"\x89PNG\r\n\x1a\n"
    import xml.etree.ElementTree as ET

    return ET.fromstring(text).tag == "{http://www.w3.org/2000/svg}svg"


@pytest.mark.parametrize("name", EXPECTED)
def test_every_figure_has_a_picture_that_needs_no_script(name: str) -> None:
    """Read on GitHub, nbviewer or offline, a figure's script draws nothing: its picture must be there."""
    for i, cell in enumerate(_code_cells(_load(name))):
        outputs = [o.get("data", {}) for o in cell.get("outputs", [])]
        for data in outputs:
            html = _text(data.get("text/html", ""))
            assert not re.search(r"<script[^>]+src=['\"]?(?:https?:)?//", html), (
                f"{name}: cell {i} loads a script from the network"
            )
            interactive = (
                any(m in data for m in INTERACTIVE)
                or "<script" in html
                or "<Figure size" in _text(data.get("text/plain", ""))
            )
            if interactive:
                pictures = [m for m in PICTURES if m in data]
                assert pictures, f"{name}: cell {i} stores a figure ({sorted(data)}) with no PNG or SVG beside it"
                assert all(_is_picture(m, data[m]) for m in pictures), f"{name}: cell {i}'s picture is not a PNG/SVG"
        if FIGURE_CALLS.search(_text(cell["source"])):
            assert any(m in data for data in outputs for m in PICTURES), (
                f"{name}: cell {i} draws a figure but stores no picture"
            )


@pytest.mark.parametrize("name", EXPECTED)
def test_keeps_no_stderr(name: str) -> None:
    """A warning or notice kept in a saved notebook reads as a problem nobody explained: silence
    what is expected (and say so in the text), fix the rest."""
    for i, cell in enumerate(_code_cells(_load(name))):
        for out in cell.get("outputs", []):
            assert out.get("name") != "stderr", f"{name}: code cell {i} keeps stderr: {_text(out['text'])[:200]!r}"


def _third_party_imports() -> dict[str, set[str]]:
    """Top-level modules the notebooks import (stdlib and bigviz left out) -> notebooks."""
    import sys

    found: dict[str, set[str]] = {}
    for name in EXPECTED:
        for cell in _code_cells(_load(name)):
            for line in _text(cell["source"]).splitlines():
                match = re.match(r"\s*(?:from|import)\s+([A-Za-z_]\w*)", line)
                if match and match.group(1) not in sys.stdlib_module_names and match.group(1) != "bigviz":
                    found.setdefault(match.group(1), set()).add(name[:2])
    return found


def _requirement_names(lines: list[str]) -> set[str]:
    names = set()
    for line in lines:
        line = line.split("#")[0].strip()
        if line and not line.startswith(("-", ".")):
            names.add(re.split(r"[<>=!~\[; ]", line)[0].lower().replace("_", "-"))
    return names


def test_what_the_notebooks_import_is_installed() -> None:
    """`pip install -e ".[notebooks]"` and Binder's requirements give every notebook what it
    imports (a module missing there is a notebook that stops at its first cell)."""
    import importlib.metadata
    import tomllib

    root = NOTEBOOKS.parent
    project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    dependencies = _requirement_names(project["dependencies"])
    extra = dependencies | _requirement_names(project["optional-dependencies"]["notebooks"])
    binder_lines = (root / "binder" / "requirements.txt").read_text().splitlines()
    binder = _requirement_names(binder_lines) | (dependencies if "." in [ln.strip() for ln in binder_lines] else set())
    distributions = importlib.metadata.packages_distributions()
    problems = []
    for module, notebooks in sorted(_third_party_imports().items()):
        names = {d.lower().replace("_", "-") for d in distributions.get(module, [module])}
        for where, installed in (("the notebooks extra", extra), ("binder/requirements.txt", binder)):
            if not names & installed:
                problems.append(f"{module} (notebooks {sorted(notebooks)}) is not in {where}")
    assert not problems, problems
