"""The README's examples run as written, and the printed outputs of the README and the manual
(``docs/``) are the code's own (the manual's examples run in ``tests/test_docs.py``).

- "Ten lines" runs as written in a fresh interpreter that sees no GPU, in an empty folder.
- The reasons printed in it are what the planner says today (``tools/readme_examples.py``
  makes them; this test fails when they go stale).
- The README names the notebooks that are in ``notebooks/``, and only those.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"


def _tool() -> ModuleType:
    spec = importlib.util.spec_from_file_location("readme_examples", ROOT / "tools" / "readme_examples.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def python_block_after(heading: str, readme: str) -> str:
    """The first ```python block of the README section that starts with ``heading``."""
    section = readme.split(f"\n{heading}\n", 1)[1].split("\n## ", 1)[0]
    match = re.search(r"```python\n(.*?)\n```", section, re.S)
    assert match, f"no python block under {heading!r}"
    return match.group(1)


@pytest.mark.slow
def test_ten_lines_run_as_written_without_a_gpu(tmp_path: Path) -> None:
    code = python_block_after("## Ten lines", README.read_text(encoding="utf-8"))
    script = tmp_path / "ten_lines.py"
    script.write_text(
        code + "\nimport json\nprint(json.dumps({str(k): v for k, v in tiny.device_map.items()}))\n", encoding="utf-8"
    )
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.strip().splitlines()
    # the plan for hardware it does not have: one GPU, RAM and disk, summarised and saved
    assert lines[0].startswith("DevicePlan") and any(line.strip().startswith("GPU 0:") for line in lines)
    saved = json.loads((tmp_path / "device_map.json").read_text(encoding="utf-8"))
    assert {0, "cpu", "disk"} <= set(saved.values())
    # the tiny GPT, part of it on disk, wrote what the model in memory writes
    from bigviz.models import decode_bytes, encode_bytes, tiny_gpt

    tiny_map = json.loads(lines[-1])
    assert "disk" in tiny_map.values() and "cpu" in tiny_map.values()
    expected = decode_bytes(tiny_gpt().generate(encode_bytes("Big models "), 60)[0])
    assert "\n".join(lines[:-1]).endswith(expected)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["reasons", "workload", "pipeline"])
def test_printed_examples_are_what_the_planner_says_today(name: str) -> None:
    tool = _tool()
    page = tool.page_of(name)
    shown = tool.readme_block(name, page.read_text(encoding="utf-8"))
    assert shown == tool.EXAMPLES[name](), f"{page.name}'s {name!r} block is stale: run python tools/readme_examples.py"


def test_readme_example_blocks_are_found_and_replaced() -> None:
    tool = _tool()
    text = "a\n<!-- readme_examples: x -->\n```text\n```\n\n## Next\n```python\ny = 1\n```\n"
    assert tool.readme_block("x", text) == ""
    once = tool.block_pattern("x").sub(lambda m: m.group(1) + "new\nlines\n" + m.group(3), text, count=1)
    assert tool.readme_block("x", once) == "new\nlines"
    assert once.endswith("```\n\n## Next\n```python\ny = 1\n```\n"), "the next block must be left alone"
    with pytest.raises(ValueError, match="readme_examples: missing"):
        tool.readme_block("missing", text)


def test_readme_lists_the_notebooks_there_are() -> None:
    readme = README.read_text(encoding="utf-8")
    section = readme.split("\n## Notebooks\n", 1)[1].split("\n## ", 1)[0]
    listed = re.findall(r"^\| `(\d\d_\w+)` \|", section, re.M)
    assert listed == sorted(p.stem for p in (ROOT / "notebooks").glob("*.ipynb"))
    assert "OWNER" not in readme, "no link to a repository that does not exist"


def test_notebooks_extra_installs_what_the_notebooks_import() -> None:
    import tomllib

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    required = {
        re.split(r"[<>=\[ ]", d)[0].lower()
        for d in extras["optional-dependencies"]["notebooks"] + extras["dependencies"]
    }
    imported = set()
    for path in (ROOT / "notebooks").glob("*.ipynb"):
        for cell in json.loads(path.read_text(encoding="utf-8"))["cells"]:
            if cell["cell_type"] == "code":
                source = "".join(cell["source"])
                imported |= set(re.findall(r"^\s*(?:import|from)\s+(\w+)", source, re.M))
    third_party = {name for name in imported if name not in sys.stdlib_module_names and name != "bigviz"}
    assert third_party and third_party <= required, f"not in the notebooks extra: {third_party - required}"
    assert {"jupyterlab", "ipywidgets", "anywidget", "plotly"} <= required


def test_the_notebooks_pictures_are_the_notebooks_own() -> None:
    """Each picture of the README's notebooks table exists and is one the notebook saved
    (``tools/notebook_pictures.py`` copies them; run it after re-executing a notebook)."""
    spec = importlib.util.spec_from_file_location("notebook_pictures", ROOT / "tools" / "notebook_pictures.py")
    assert spec and spec.loader
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    shown = re.findall(r'<img src="(docs/notebooks/[^"]+)"', README.read_text(encoding="utf-8"))
    wanted = tool.wanted()
    assert shown and {Path(s).name for s in shown} == set(wanted), "README shows another set of pictures"
    stale = [name for name, data in wanted.items() if (ROOT / "docs" / "notebooks" / name).read_bytes() != data]
    assert not stale, f"stale pictures {stale}: run python tools/notebook_pictures.py"


def test_the_planner_block_plans_what_the_picture_shows() -> None:
    """The README's Planner block builds the model and budgets the live picture was recorded
    with (docs/planner-live.png, frames from tests/browser/test_planner_browser.py's SETUP)."""
    from tests.browser.test_planner_browser import SETUP

    readme = (ROOT / "README.md").read_text()
    block = readme.split("## See and change the plan in Jupyter", 1)[1].split("```python", 1)[1].split("```", 1)[0]

    def calls(text: str) -> list[str]:
        preset = re.findall(r'GPTConfig\.preset\("([^"]+)"\)', text)
        planner = re.findall(r"bigviz\.Planner\(\w+, (.*)\)", text)
        return preset + planner

    assert calls(block) and calls(block) == calls(SETUP), (calls(block), calls(SETUP))
    assert "planner-live.png" in readme.split("## See and change the plan in Jupyter", 1)[1][:2000]


def test_the_larger_than_ram_table_is_the_benchs_own() -> None:
    """The README's table of splits is the one ``bench/beyond_ram.py`` recorded in
    ``bench/RESULTS.md`` (header and rows verbatim: copy it from there after a run), and its
    picture is the timeline the same run drew (``docs/larger-than-ram-run.svg``)."""
    readme = README.read_text(encoding="utf-8")
    section = readme.split("\n## Larger than RAM\n", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("|")]
    results = (ROOT / "bench" / "RESULTS.md").read_text(encoding="utf-8")
    assert len(rows) >= 4, "the README's larger-than-RAM section has no table of splits"
    stale = [row for row in rows if row not in results.splitlines()]
    assert not stale, f"rows not in bench/RESULTS.md (copy the bench's table): {stale[:2]}"
    pictures = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", section)
    assert pictures == ["docs/larger-than-ram-run.svg"]
    svg = (ROOT / pictures[0]).read_text(encoding="utf-8")
    title = re.search(r"<text[^>]*>([^<]+)</text>", svg)
    assert title and title.group(1).split(",")[0] in section, "the picture is of another model than the table"
