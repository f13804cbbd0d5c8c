"""Keep the layer arrows honest: parse every import in bigviz/ and check it points down.

    ui, engine, distributed  ->  planning  ->  checkpoint  ->  modeling  ->  core, osio
    models: torch only.   cli, demo: anything.   osio: the standard library only.

A module's layer is its top folder under ``bigviz/`` (``bigviz/planning/chain.py`` is in
``planning``, ``bigviz/engine/fetchers/ring.py`` in ``engine``); the plans live low
(``core/plan.py``, ``core/dispatch_plan.py``, ``core/stream_plan.py`` pure;
``checkpoint/load_plan.py``), their entry points in ``planning``, their executors in
``checkpoint/loader.py`` and ``engine``. See docs/architecture.md.
Heavy libraries stay out of ``import bigviz``: core never imports torch, plotly or
ipywidgets; plotly and ipywidgets are imported only by ui.

Inside a layer, files import each other without a cycle: every import counts, the ones inside
functions and under ``if TYPE_CHECKING:`` too (a file that needs another's private helper has
found a concept that wants its own home).
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
    "osio": 0,
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


def _module_of(path: Path) -> str:
    """``bigviz/engine/fetchers/ring.py`` -> ``bigviz.engine.fetchers.ring`` (a package: its name)."""
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, module: str | None = None, known: object = None) -> list[str]:
    """Every module ``path`` (the module ``module``, default: found from its place) imports, at
    any depth (functions, ``TYPE_CHECKING``), absolute and relative; ``from a import b`` gives
    ``a.b`` when that is a module of bigviz (of ``known``), else ``a``."""
    known = MODULES if known is None else known
    out = []
    here = (module or _module_of(path)).split(".")
    package = here if path.name == "__init__.py" else here[:-1]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                out.append(sub if sub in known else base)  # type: ignore[operator]
    return out


FILES = sorted(p for p in ROOT.rglob("*.py") if p.parent != ROOT or p.stem in RANK)
MODULES = {_module_of(p): p for p in ROOT.rglob("*.py")}


def _layer_of(path: Path) -> str:
    relative = path.relative_to(ROOT)
    return relative.parts[0] if len(relative.parts) > 1 else path.stem


STDLIB = set(sys.stdlib_module_names)


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_imports_point_down(path):
    layer = _layer_of(path)
    problems = []
    for module in _imports(path):
        target = _layer(module)
        top = module.split(".")[0]
        if target is not None and target in RANK and target != layer:
            if RANK[target] >= RANK[layer] and RANK[layer] < 6:  # cli and demo are one top layer
                problems.append(f"{module} (layer {target})")
        if layer in ("core",) and top in ("torch", "plotly", "ipywidgets", "numpy"):
            problems.append(f"{module} (core stays pure Python)")
        if layer == "osio" and top != "bigviz" and top not in STDLIB:
            problems.append(f"{module} (osio is the standard library only)")
        if layer == "osio" and target not in (None, "osio"):
            problems.append(f"{module} (osio is the bottom: it imports nothing of bigviz)")
        if layer != "ui" and top in ("plotly", "ipywidgets", "anywidget"):
            problems.append(f"{module} (only ui may use widget and plotting libraries)")
    assert not problems, f"{path.relative_to(ROOT)} imports upward or heavy: {problems}"


def _graph() -> dict[str, set[str]]:
    """Module -> the bigviz modules it imports, inside its own layer."""
    graph: dict[str, set[str]] = {}
    for name, path in MODULES.items():
        layer = _layer_of(path) if path.parent != ROOT else None
        graph[name] = {m for m in _imports(path) if m in MODULES and m != name and layer and _layer(m) == layer}
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import cycles of ``graph`` (strongly connected parts of more than one module, or a
    module importing itself), each as a sorted list.

    Example:
        >>> find_cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}})
        [['a', 'b']]
    """
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            part = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                part.append(w)
                if w == v:
                    break
            if len(part) > 1:
                cycles.append(sorted(part))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(cycles)


def test_no_import_cycle_inside_a_layer():
    cycles = find_cycles(_graph())
    assert not cycles, f"files that import each other (move what both need into a module of its own): {cycles}"


def test_a_cycle_through_a_function_or_type_checking_import_is_found(tmp_path):
    """The checker itself: imports inside functions and under TYPE_CHECKING count."""
    sources = {
        "bigviz.core.a": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from bigviz.core.b import X\n",
        "bigviz.core.b": "def f():\n    from . import a\n    return a\n",
        "bigviz.core.c": "import bigviz.core.a\n",
    }
    graph = {}
    for name, text in sources.items():
        path = tmp_path / f"{name}.py"
        path.write_text(text)
        graph[name] = {m for m in _imports(path, name, sources) if m in sources and m != name}
    assert find_cycles(graph) == [["bigviz.core.a", "bigviz.core.b"]]


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
        "plan_chain",
        "max_context",
        "plan_pipeline",
        "resolve_model",
        "as_tree",
        "planner_inputs",
    ):
        assert callable(getattr(bigviz.planning, name)), name


def test_docs_name_only_modules_that_exist():
    """docs/architecture.md says where each concept lives: every module path it names exists."""
    import re

    text = (ROOT.parent / "docs" / "architecture.md").read_text()
    named = set(re.findall(r"bigviz/[\w/]+\.py", text))
    layers = "|".join(RANK)
    named |= {f"bigviz/{m}" for m in re.findall(rf"`((?:{layers})/[\w/]+\.py)", text)}
    assert len(named) > 30
    missing = sorted(p for p in named if not (ROOT.parent / p).exists())
    assert not missing, f"docs/architecture.md names modules that do not exist: {missing}"


def _concept_rows() -> list[tuple[str, str, list[str]]]:
    """``(concept, home module path, names it defines)`` of the table in docs/architecture.md."""
    import re

    text = (ROOT.parent / "docs" / "architecture.md").read_text()
    table = text.split("## Concept -> the one module where it lives", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[1].startswith("`bigviz/"):
            rows.append((cells[0], cells[1].strip("`"), re.findall(r"`(\w+)`", cells[2])))
    return rows


def _top_level_names(path: Path) -> set[str]:
    """Classes, functions and assigned names a module defines at its top level (re-exports
    by import do not count: a name is defined where its code is)."""
    names: set[str] = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    return names


def test_docs_name_one_home_per_concept():
    """Each concept of docs/architecture.md lives in one module: the names the table says it
    defines are defined there, and in no other module of bigviz."""
    rows = _concept_rows()
    assert len(rows) > 40
    defined = {p: _top_level_names(p) for p in ROOT.rglob("*.py")}
    problems = []
    for concept, home, names in rows:
        home_path = ROOT.parent / home
        assert names, f"{concept!r}: say what {home} defines for it"
        for name in names:
            where = sorted(str(p.relative_to(ROOT.parent)) for p, found in defined.items() if name in found)
            if where != [home]:
                problems.append(f"{name} ({concept}): defined in {where}, the table says {home}")
        assert home_path.exists(), home
    assert not problems, "one home per concept:\n" + "\n".join(problems)


FILE_CALLS = {"read_text", "write_text", "read_bytes", "write_bytes", "iterdir", "glob", "rglob", "mkdir", "unlink"}


def _file_io(path: Path) -> list[str]:
    """``line: call`` for each call of ``path`` that touches files: ``open``, ``os.*`` (but
    ``os.path`` and ``os.fspath``), ``shutil.*``, and the file methods of ``pathlib``."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        if isinstance(func, ast.Name) and func.id == "open":
            out.append(f"{node.lineno}: open")
        elif isinstance(func, ast.Attribute):
            owner = func.value.id if isinstance(func.value, ast.Name) else None
            if (owner == "os" and func.attr != "fspath") or owner == "shutil":
                out.append(f"{node.lineno}: {owner}.{func.attr}")
            elif func.attr in FILE_CALLS:
                out.append(f"{node.lineno}: {func.attr}")
    return sorted(out)


def test_core_reads_and_writes_files_in_one_module():
    """docs/architecture.md: core's only I/O is the plans' own JSON files, in core/serialize.py;
    everything else in core is a pure function of its arguments."""
    found = [
        f"{path.relative_to(ROOT)}:{call}"
        for path in sorted((ROOT / "core").rglob("*.py"))
        if path.name != "serialize.py"
        for call in _file_io(path)
    ]
    assert not found, f"core does I/O outside core/serialize.py (read or write through it): {found}"


def test_the_io_check_finds_a_file_read(tmp_path: Path) -> None:
    source = tmp_path / "probe.py"
    source.write_text("import os\ndef f(p):\n    os.path.join(p, 'a')\n    return open(p).read(), p.read_text()\n")
    assert _file_io(source) == ["4: open", "4: read_text"]


OS_CALLS = {("ctypes", "CDLL"), ("os", "posix_fadvise"), ("os", "O_DIRECT"), ("os", "POSIX_FADV_DONTNEED")}


def test_kernel_calls_live_in_osio_only():
    """libc through ctypes, page-cache advice, O_DIRECT and /proc/self are osio's: one home for
    each OS-level helper, the rest of bigviz imports it."""
    problems = []
    for path in FILES:
        if _layer_of(path) == "osio":
            continue
        tree = ast.parse(path.read_text())
        docstrings = {
            id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant)
        }
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
                if (node.value.id, node.attr) in OS_CALLS:
                    problems.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.value.id}.{node.attr}")
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
                if node.value.startswith("/proc/"):
                    problems.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.value!r}")
    assert not problems, f"OS-level calls outside bigviz/osio: {problems}"


def _bare_raises(path: Path) -> list[str]:
    """``line: ValueError`` for each ``raise ValueError(...)`` / ``TypeError`` /
    ``RuntimeError`` of ``path``."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call) and isinstance(node.exc.func, ast.Name):
            if node.exc.func.id in ("ValueError", "TypeError", "RuntimeError"):
                out.append(f"{node.lineno}: {node.exc.func.id}")
    return out


def test_bigviz_raises_through_the_error_family():
    """Errors raised on purpose are BigvizErrors (with the builtin base users catch:
    ``UsageError`` is a ``ValueError``, ``ArgumentTypeError`` a ``TypeError``, ``StateError`` a
    ``RuntimeError``), not bare builtins: one format, every problem listed, the fix. In every
    layer but ``models``: the reference GPT and Llama import torch only (a notebook reads them
    whole), so their config checks stay plain ``ValueError`` s; ``osio`` raises ``OSError`` s."""
    bare = [
        f"{path.relative_to(ROOT)}:{line}"
        for path in FILES
        if _layer_of(path) != "models"
        for line in _bare_raises(path)
    ]
    assert not bare, f"raise one of bigviz.core.errors instead: {bare}"


def test_the_error_check_finds_a_bare_raise(tmp_path: Path) -> None:
    """The checker itself: a bare builtin is found, one of the family is not."""
    source = tmp_path / "probe.py"
    source.write_text("def f(x):\n    if x:\n        raise UsageError('no')\n    raise TypeError('kind')\n")
    assert _bare_raises(source) == ["4: TypeError"]


CROSS_CUTTING_FOLDERS = {"hostile", "zoo", "browser"}  # attacks, architectures, a real browser: across layers
TOP_LEVEL_TESTS = {  # about the whole project, not one package
    "test_bench_beyond_ram.py",
    "test_bench_records.py",
    "test_cli.py",
    "test_docs.py",
    "test_first_use.py",
    "test_gpu.py",
    "test_layering.py",
    "test_notebooks_meta.py",
    "test_readme.py",
}


def test_tests_mirror_the_package():
    """tests/<package>/ for each bigviz sub-package (tests/core runs without torch), beside
    the cross-cutting folders; at the top only the tests about the whole project."""
    tests = ROOT.parent / "tests"
    packages = {p.name for p in ROOT.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    folders = {p.name for p in tests.iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert folders <= packages | CROSS_CUTTING_FOLDERS, f"not a bigviz package: {sorted(folders - packages)}"
    for folder in folders:
        assert (tests / folder / "__init__.py").exists(), f"tests/{folder} needs an __init__.py (unique module names)"
    loose = sorted(p.name for p in tests.glob("test_*.py") if p.name not in TOP_LEVEL_TESTS)
    assert not loose, f"move these into tests/<package>/: {loose}"
