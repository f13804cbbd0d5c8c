"""A newcomer's first hour: what the README's install gives, what the first commands print.

The shipped configs plan after ``pip install -e .`` (transformers is a dependency), an error
names what the user typed, progress bars show only for work that takes time, counts read
"1 unit", durations are never rounded to zero, the demo's report shows every column it has,
and what ``bigviz demo`` writes in a clone is ignored by git.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import torch

import bigviz
from bigviz.checkpoint import progress
from bigviz.cli import main
from bigviz.core.sizes import format_count, format_seconds
from bigviz.core.planner import make_plan
from bigviz.core.tree import SizeTree, TensorSpec
from bigviz.ui.presets import cost_html
from bigviz.ui.report import report_fragment, table_html

ROOT = Path(__file__).resolve().parents[1]


def _dependencies() -> set[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return {re.split(r"[<>=!~\[; ]", d)[0].lower() for d in project["dependencies"]}


def test_the_shipped_configs_plan_after_the_documented_install(tmp_path, capsys):
    """``pip install -e .`` must give what ``bigviz plan llama-3.1-70b`` (``bigviz --help``'s own
    example) needs: the configs are built with transformers, so it is a dependency, not an extra."""
    assert "transformers" in _dependencies()
    out = tmp_path / "map.json"
    code = main(["plan", "llama-3.1-70b", "--max-memory", "0=80GiB,1=80GiB,cpu=200GiB", "--out", str(out)])
    assert code == 0, capsys.readouterr().err
    assert "LlamaDecoderLayer" not in capsys.readouterr().err and set(bigviz.load_device_map(out).values()) == {0, 1}


def test_a_config_error_names_what_the_user_typed(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # a broken environment: the import fails
    code = main(["plan", "mixtral-8x7b", "--max-memory", "0=80GiB", "--out", str(tmp_path / "m.json")])
    err = capsys.readouterr().err
    assert code == 2 and "the shipped config 'mixtral-8x7b'" in err and "pip install transformers" in err, err
    config = tmp_path / "my-model" / "config.json"
    config.parent.mkdir()
    config.write_text('{"model_type": "llama"}')
    with pytest.raises(ValueError, match=re.escape(repr(str(config.parent)))):
        bigviz.plan(str(config.parent), {"cpu": "1GiB"})


def test_progress_bars_only_for_work_that_takes_time(tmp_path, capsys, monkeypatch):
    model = torch.nn.Linear(64, 64)
    folder = bigviz.save_sharded(model, tmp_path / "quick", progress=True)
    bigviz.load_checkpoint_in_model(torch.nn.Linear(64, 64), folder, progress=True)
    assert capsys.readouterr().err == "", "a bar for a save and a load of 16 KiB"
    monkeypatch.setattr(progress, "SHOW_AFTER_S", 0.0)  # as if the work were slow: the bar shows
    bigviz.save_sharded(model, tmp_path / "slow", progress=True)
    assert "saving" in capsys.readouterr().err


def test_counts_and_durations_read_as_people_write_them():
    assert format_count(1, "unit") == "1 unit" and format_count(2, "unit") == "2 units"
    plan = bigviz.plan(torch.nn.Linear(4, 4), {"cpu": "1MB"})
    assert "(auto, 1 unit," in plan.summary()
    assert "Placements (1 unit)" in report_fragment(plan) and "1 units" not in report_fragment(plan)
    assert format_seconds(0.0002) == "0.2 ms" and format_seconds(0.000049) == "0.049 ms"
    on_disk = make_plan(SizeTree.build([TensorSpec("w", 150_000, "float32")]), {"cpu": 0, "disk": 10**13})
    tiny = cost_html(on_disk.cost(disk_bandwidth="NVMe ("))  # 600 kB at 3 GB/s
    assert "<b>0.2 ms</b>" in tiny and " 0 ms" not in tiny, tiny


def test_the_report_of_a_plan_from_headers(tmp_path):
    """No empty class column (headers name no classes); the budget table, eight columns with a
    run, has a full-width section of its own instead of the 430 px side panel that cut it off."""
    folder = bigviz.save_sharded(bigviz.models.build("gpt-mini"), tmp_path / "c", progress=False)
    plan = bigviz.plan(folder, {"cpu": "300KiB"})
    assert "<th>class</th>" not in table_html(plan)
    assert "<th>class</th>" in table_html(bigviz.plan(bigviz.models.build("gpt-mini"), {"cpu": "300KiB"}))
    page = report_fragment(plan)
    side = page.split("flex:0 0 430px", 1)[1].split("</div></div>", 1)[0]
    assert "<th>budget</th>" not in side and "<h2>Budgets per device</h2>" in page


@pytest.mark.skipif(shutil.which("git") is None or not (ROOT / ".git").exists(), reason="not a git clone")
def test_what_the_first_commands_write_in_a_clone_is_ignored():
    for path in ("bigviz-demo/report.html", "device_map.json"):
        done = subprocess.run(["git", "check-ignore", "-q", path], cwd=ROOT)
        assert done.returncode == 0, f"{path} would show as untracked after the README's first commands"


def test_time_claims_say_what_they_depend_on():
    help_text = subprocess.run(
        [sys.executable, "-m", "bigviz.cli", "--help"], capture_output=True, text=True, check=True
    ).stdout
    assert "half a minute" not in help_text and "idle" in help_text
    readme = (ROOT / "README.md").read_text()
    install = next(line for line in readme.splitlines() if 'pip install -e ".[test]"' in line)
    assert "min" in install, "say beside the command how long the test extra takes to install"
