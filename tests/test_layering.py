"""Keep the layer arrows honest: parse every import in bigviz/ and check it points down.

    ui, engine, distributed  ->  planning  ->  checkpoint  ->  modeling  ->  core
    models: torch only.   cli, demo: anything.

A module's layer is its folder (``bigviz/planning/chain.py`` is in ``planning``); the plans
live low (``core/plan.py``, ``core/dispatch_plan.py`` pure; ``checkpoint/load_plan.py``), their
entry points in ``planning``, their executors in ``checkpoint/loader.py`` and ``engine``.
See docs/architecture.md.
Heavy libraries stay out of ``import bigviz``: core never imports torch, plotly or
ipywidgets; plotly and ipywidgets are imported only by ui.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "bigviz"
RANK = {
    "core": 0,
    "models": 0,
    "modeling": 1,
    "checkpoint": 2,
    "planning": 3,
    "engine": 4,
    "distributed": 4,
    "ui": 5,
    "demo": 6,
    "cli": 6,
    "teaching": 6,  # instruments for the notebooks: uses anything, used by nothing
}


def _layer(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if parts[0] == "bigviz" and len(parts) > 1 else None


def _imports(path: Path) -> list[str]:
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append(node.module)
    return out


FILES = sorted(p for p in ROOT.rglob("*.py") if p.parent != ROOT or p.stem in RANK)


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_imports_point_down(path):
    layer = path.parent.name if path.parent != ROOT else path.stem
    problems = []
    for module in _imports(path):
        target = _layer(module)
        top = module.split(".")[0]
        if target is not None and target in RANK and target != layer:
            if RANK[target] >= RANK[layer] and RANK[layer] < 6:  # cli and demo are one top layer
                problems.append(f"{module} (layer {target})")
        if layer in ("core",) and top in ("torch", "plotly", "ipywidgets", "numpy"):
            problems.append(f"{module} (core stays pure Python)")
        if layer != "ui" and top in ("plotly", "ipywidgets", "anywidget"):
            problems.append(f"{module} (only ui may use widget and plotting libraries)")
    assert not problems, f"{path.relative_to(ROOT)} imports upward or heavy: {problems}"


def test_import_bigviz_is_light():
    code = (
        "import sys, bigviz; bad = [m for m in ('torch', 'plotly', 'ipywidgets', 'pandas') if m in sys.modules];"
        "print(','.join(bad))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "", f"import bigviz pulled in: {out}"


def test_every_public_name_resolves_to_its_home():
    """Every lazy export of ``bigviz`` (accelerate's and transformers' names, the plans, the
    Planner) imports from the module the table names, and ``bigviz.planning`` keeps its names."""
    import importlib

    import bigviz
    import bigviz.planning

    missing = [name for name in bigviz.__all__ if name != "__version__" and getattr(bigviz, name, None) is None]
    assert not missing, f"bigviz exports names that do not resolve: {missing}"
    for name, module in bigviz._EXPORTS.items():
        assert getattr(importlib.import_module(module), name) is getattr(bigviz, name), name
    for name in (
        "plan",
        "infer_auto_device_map",
        "check_device_map",
        "load_plan",
        "dispatch_plan",
        "max_context",
        "plan_pipeline",
        "resolve_model",
        "as_tree",
    ):
        assert callable(getattr(bigviz.planning, name)), name


def test_docs_name_only_modules_that_exist():
    """docs/architecture.md says where each concept lives: every module path it names exists."""
    import re

    text = (ROOT.parent / "docs" / "architecture.md").read_text()
    named = set(re.findall(r"bigviz/[\w/]+\.py", text))
    named |= {f"bigviz/{m}" for m in re.findall(r"`((?:core|modeling|checkpoint|planning|engine|ui)/\w+\.py)", text)}
    assert len(named) > 30
    missing = sorted(p for p in named if not (ROOT.parent / p).exists())
    assert not missing, f"docs/architecture.md names modules that do not exist: {missing}"
