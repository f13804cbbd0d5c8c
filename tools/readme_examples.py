"""The printed examples of the README and the manual (``docs/*.md``), made by the code they
describe (``tests/test_readme.py`` checks them).

A page that quotes a planner's output goes stale the day the planner changes. The blocks
written here sit in a page between ``<!-- readme_examples: NAME -->`` and the end of the code
block that follows it; the test fails when the page's copy differs from what the code prints
today, and this script rewrites them.

Usage:
    python tools/readme_examples.py            # rewrite the generated blocks
    python tools/readme_examples.py --check    # exit 1 if one of them is stale
"""

from __future__ import annotations

import argparse
import re
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
WIDTH = 96  # the README's text blocks stay readable on GitHub without scrolling


def reason_example() -> str:
    """The reasons of the "Ten lines" plan (gpt2-xl on one 3 GiB GPU and 2 GiB of RAM).

    Shows the last block that fits GPU 0, the first block sent to each other device, and the
    tied head: one line of each kind of reason.
    """
    import bigviz
    from bigviz.models import GPT, GPTConfig

    with bigviz.init_empty_weights():
        model = GPT(GPTConfig.preset("gpt2-xl"))
    frame = bigviz.plan(model, max_memory={0: "3GiB", "cpu": "2GiB"}).to_frame()
    blocks = frame[frame["class"] == "Block"]
    rows = [blocks[blocks["device"] == "GPU 0"].iloc[-1]]
    rows += [blocks[blocks["device"] == device].iloc[0] for device in ("CPU", "disk")]
    rows += [frame[frame["module"] == "lm_head"].iloc[0]]
    return _reason_lines([(row["module"], row["reason"]) for row in rows])


def workload_example() -> str:
    """The reasons of "Will it fit?": Llama 3.1 70B with a 32k context on two 80 GiB GPUs.

    The first layer (which also holds the prefill's activations), the second, and the head.
    """
    import bigviz

    plan = bigviz.plan(
        bigviz.config_path("llama-3.1-70b"),
        {0: "80GiB", 1: "80GiB", "cpu": "340GiB"},
        batch_size=1,
        context_length=32768,
    )
    reasons = plan.to_frame().set_index("module")["reason"]
    return _reason_lines([(name, reasons[name]) for name in ("model.layers.0", "model.layers.1", "lm_head")])


def pipeline_example() -> str:
    """The "Across machines" example: Llama 3.1 70B in bfloat16 on four 80 GiB ranks, 8 sequences of 8192
    tokens in 4 micro-batches: the plan's stages with their run, and the longest context."""
    import torch

    import bigviz

    model = bigviz.model_from_config(bigviz.config_path("llama-3.1-70b"))
    run = dict(batch_size=8, microbatches=4, dtype=torch.bfloat16)
    plan = bigviz.plan_pipeline(model, ["80GiB"] * 4, context_length=8192, **run)  # type: ignore[arg-type]
    lines = [line for line in plan.summary().splitlines() if line.startswith(("PipelinePlan", "  run:", "  stage"))]
    lines = [wrapped for line in lines for wrapped in _wrap(line)]
    longest = bigviz.max_context(model, stages=["80GiB"] * 4, **run)  # type: ignore[arg-type]
    return "\n".join([*lines, f"max_context(model, stages=['80GiB'] * 4, ...): {longest} tokens"])


def _wrap(line: str) -> list[str]:
    indent = " " * (len(line) - len(line.lstrip()) + 4)
    return textwrap.wrap(line, WIDTH, subsequent_indent=indent, break_on_hyphens=False)


def _reason_lines(rows: list[tuple[str, str]]) -> str:
    """``module  reason`` lines, reasons wrapped under themselves at the README's width."""
    width = max(len(module) for module, _ in rows) + 2
    lines = []
    for module, reason in rows:
        wrapped = textwrap.wrap(reason, WIDTH - width)
        lines.append(module.ljust(width) + wrapped[0])
        lines += [" " * width + more for more in wrapped[1:]]
    return "\n".join(lines)


EXAMPLES: dict[str, Callable[[], str]] = {
    "reasons": reason_example,
    "workload": workload_example,
    "pipeline": pipeline_example,
}


def block_pattern(name: str) -> re.Pattern[str]:
    """The marker comment and the fenced block after it; group 2 is the block's lines (maybe none)."""
    return re.compile(rf"(<!-- readme_examples: {re.escape(name)} -->\n```\w*\n)((?:(?!```)[^\n]*\n)*)(```)")


def readme_block(name: str, readme: str) -> str:
    """A page's current copy of example ``name``."""
    match = block_pattern(name).search(readme)
    if match is None:
        raise ValueError(f"readme_examples: missing block marked <!-- readme_examples: {name} -->")
    return match.group(2).removesuffix("\n")


def page_of(name: str) -> Path:
    """The page (README or a page of the manual) that holds example ``name``."""
    for page in PAGES:
        if block_pattern(name).search(page.read_text(encoding="utf-8")):
            return page
    raise ValueError(f"readme_examples: missing block marked <!-- readme_examples: {name} --> in README.md and docs/")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="only report stale blocks")
    args = parser.parse_args(argv)
    stale = []
    for name, make in EXAMPLES.items():
        page, text = page_of(name), make()
        content = page.read_text(encoding="utf-8")
        if readme_block(name, content) != text:
            stale.append(f"{name} ({page.relative_to(ROOT)})")
            content = block_pattern(name).sub(
                lambda m, text=text: m.group(1) + text + "\n" + m.group(3), content, count=1
            )
            if not args.check:
                page.write_text(content, encoding="utf-8")
    print(("stale: " if args.check else "rewritten: ") + ", ".join(stale) if stale else "printed examples up to date")
    return 1 if stale and args.check else 0


if __name__ == "__main__":
    sys.exit(main())
