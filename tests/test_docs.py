"""Every example of the manual (``docs/*.md``) runs as written on a CPU-only machine.

Each ```python block of a page runs in a fresh namespace holding what the manual's examples
take as given (``PRELUDE``: ``bigviz``, ``torch``, a small GPT ``model`` on ``meta``, its sharded
checkpoint in ``ckpt/``, ``idx``, ``max_memory``), in an empty folder, one subprocess per page
(one torch import). A block that cannot run here (several processes, a GPU) says why on its
first line, ``# not run: <why>``, and is only compiled.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = sorted((ROOT / "docs").glob("*.md"))
NOT_RUN = "# not run:"

PRELUDE = """
import torch, bigviz
from bigviz.models import GPT, GPTConfig
torch.manual_seed(0)
MyModel, config = GPT, GPTConfig.preset("gpt-tiny")
trained = GPT(config).eval()  # weights in memory (random: a stand-in for a trained model)
bigviz.save_sharded(trained, "ckpt/", max_shard_size="40KB", config=config, progress=False)
with bigviz.init_empty_weights():
    model = GPT(config)  # on meta
model_or_checkpoint_path = model_or_config = model
max_memory = {"cpu": "1GiB"}
device_map = {"": "cpu"}
idx = torch.randint(0, config.vocab_size, (1, 8))
"""

RUNNER = """
import json, sys, traceback
blocks = json.loads(sys.stdin.read())
prelude, failures = blocks.pop(0), []
base = {}
exec(compile(prelude, "<prelude>", "exec"), base)
for i, code in blocks:
    space = dict(base)
    if "model" in base:  # a fresh model on meta for each block (a block may dispatch it)
        exec("with bigviz.init_empty_weights():\\n    model = GPT(config)\\nmodel_or_checkpoint_path = model_or_config = model", space)
    try:
        exec(compile(code, f"<block {i}>", "exec"), space)
    except Exception:
        failures.append([i, traceback.format_exc(limit=3)[-1500:]])
print(json.dumps(failures))
"""


def python_blocks(text: str) -> list[str]:
    """The ```python blocks of a markdown page, in order."""
    return re.findall(r"(?m)^```python\n(.*?)^```", text, re.S)


@pytest.mark.parametrize(
    "page", [p for p in PAGES if python_blocks(p.read_text(encoding="utf-8"))], ids=lambda p: p.name
)
@pytest.mark.slow
def test_every_example_of_the_manual_runs(page: Path, tmp_path: Path) -> None:
    blocks = python_blocks(page.read_text(encoding="utf-8"))
    runnable = []
    for i, code in enumerate(blocks, 1):
        first = code.splitlines()[0] if code.strip() else ""
        if first.startswith(NOT_RUN):
            assert first[len(NOT_RUN) :].strip(), f"{page.name} block {i}: say why it is not run"
            compile(code, f"{page.name} block {i}", "exec")  # still valid Python
        else:
            runnable.append([i, code])
    if not runnable:
        return
    env_code = json.dumps([PRELUDE, *runnable])
    done = subprocess.run(
        [sys.executable, "-c", RUNNER],
        input=env_code,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=900,
        env={"CUDA_VISIBLE_DEVICES": "", "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    failures = json.loads(done.stdout.strip().splitlines()[-1])
    assert not failures, "\n".join(f"{page.name} block {i}:\n{err}" for i, err in failures)


def test_the_manual_has_examples_and_every_page_is_listed() -> None:
    assert sum(len(python_blocks(p.read_text(encoding="utf-8"))) for p in PAGES) >= 8
    index = (ROOT / "docs" / "index.md").read_text(encoding="utf-8")
    pages = {p.name for p in PAGES} - {"index.md"}
    missing = sorted(name for name in pages if f"]({name})" not in index)
    assert not missing, f"docs/index.md does not list {missing}"


def test_links_between_pages_lead_somewhere() -> None:
    broken = []
    for page in [*PAGES, ROOT / "README.md"]:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text(encoding="utf-8")):
            if "://" in target or target.startswith("mailto:"):
                continue
            if not (page.parent / target).exists():
                broken.append(f"{page.relative_to(ROOT)} -> {target}")
    assert not broken, broken
