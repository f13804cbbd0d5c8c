"""The benchmark records: one section file per bench, ``bench/RESULTS.md`` assembled from them.

Each bench's latest figures live in ``bench/results/<bench>.md``, written by :func:`write_section`
when the bench runs (``python bench/run.py``, or ``bench/beyond_ram.py`` on its own). The
section a new run replaces is not lost: it is appended to the dated diary,
``bench/history/<date of that run>.md``. :func:`assemble` then writes ``bench/RESULTS.md``
whole, from every section file there is (the benches not run this time keep their last
figures), in a fixed order, with the list of the diary's pages: nothing is edited by hand,
nothing is dropped.

    python bench/records.py          # assemble bench/RESULTS.md from bench/results/ again
"""

from __future__ import annotations

import datetime
import re
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
HISTORY = HERE / "history"
ORDER = [
    "planning",
    "load",
    "dispatch",
    "slider",
    "workload",
    "gpu",
    "pipeline",
    "quant",
    "beyond_ram",
    "beyond_ram_in_use",
]
STAMP = re.compile(r"^<!-- bench: (?P<name>\w+), (?P<date>\d{4}-\d\d-\d\d)(?P<rest>[^>]*)-->\n", re.M)


def write_section(name: str, text: str, *, note: str = "", today: datetime.date | None = None) -> Path:
    """Record ``text`` as bench ``name``'s latest figures; the figures it replaces go to the
    diary (``bench/history/<their date>.md``). Returns the section file.

    Args:
        name: The bench (``planning``, ``beyond_ram``, ...).
        text: Its markdown section, as the bench printed it.
        note: A line kept in the stamp (how it was run: ``--quick``, the time it took).
        today: The date of this run (default: today).
    """
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"{name}.md"
    if path.exists():
        replaced = _replaced(path.read_text(encoding="utf-8"), text)
        if replaced:
            _to_history(replaced, name)
    date = (today or datetime.date.today()).isoformat()
    stamp = f"<!-- bench: {name}, {date}{', ' + note if note else ''} -->\n"
    path.write_text(stamp + text.strip() + "\n", encoding="utf-8")
    return path


KEPT = re.compile(r"^\(Kept from this \w+'s last run[^\n]*\)\n\n?", re.M)


def _chunks(text: str) -> list[str]:
    """The ``## `` sections of a record (what comes before the first one as a chunk of its own)."""
    parts = re.split(r"(?m)^(?=## )", text)
    return [p.strip() for p in parts if p.strip()]


def _replaced(old: str, new: str) -> str:
    r"""What of the ``old`` record the ``new`` one replaces: its ``## `` sections that the new
    record does not carry on. A bench that measures one of several sizes carries the others
    on, marked "(Kept from this size's last run, ...)"; those are not replaced, so they do
    not go to the diary (they go when a run measures them again). The stamp line stays.

    Example:
        >>> old = "<!-- bench: x, 2026-12-01 -->\n## A\n\n1 s\n\n## B\n\n2 s\n"
        >>> new = "## A\n\n0.9 s\n\n## B\n\n(Kept from this size's last run, 2026-12-01.)\n\n2 s\n"
        >>> print(_replaced(old, new))
        <!-- bench: x, 2026-12-01 -->
        ## A
        <BLANKLINE>
        1 s
    """
    stamp = STAMP.search(old)
    carried = {KEPT.sub("", c) for c in _chunks(STAMP.sub("", new))}
    gone = [c for c in _chunks(STAMP.sub("", old)) if KEPT.sub("", c) not in carried]
    if not gone:
        return ""
    return (stamp.group(0) if stamp else "") + "\n\n".join(gone)


def _to_history(old: str, name: str) -> None:
    """Append a replaced section to the diary page of the day it was measured."""
    found = STAMP.search(old)
    date = found.group("date") if found else "undated"
    HISTORY.mkdir(exist_ok=True)
    page = HISTORY / f"{date}.md"
    head = (
        ""
        if page.exists()
        else f"# Benchmark diary, {date}\n\nFigures later runs replaced in `bench/RESULTS.md`, and notes of that day.\n"
    )
    body = STAMP.sub("", old).strip()
    with page.open("a", encoding="utf-8") as f:
        f.write(f"{head}\n<!-- replaced section: {name} -->\n{body}\n")


def assemble(machine: str = "") -> Path:
    """Write ``bench/RESULTS.md`` from every section file, in :data:`ORDER` (then any other)."""
    sections = {p.stem: p.read_text(encoding="utf-8") for p in sorted(RESULTS.glob("*.md"))}
    names = [n for n in ORDER if n in sections] + sorted(n for n in sections if n not in ORDER)
    parts = [
        "# Benchmark results\n",
        "Assembled by `python bench/run.py` (or `python bench/records.py`) from `bench/results/`, one file "
        "per bench, each the latest run of that bench (its date in the line under its title). Do not edit "
        "this file: run the bench, or edit its section file. Figures a run replaced, and notes of the day, "
        "are in the diary, `bench/history/`. The machine is shared and noisy: ratios from one run, side by "
        "side, are what to compare.\n",
    ]
    if machine:
        parts.append(f"Machine of the last run: {machine}.\n")
    for name in names:
        found = STAMP.search(sections[name])
        when = f"_(measured {found.group('date')}{found.group('rest').rstrip()})_\n\n" if found else ""
        body = STAMP.sub("", sections[name]).strip()
        title, _, rest = body.partition("\n")
        parts.append(f"{title}\n\n{when}{rest.strip()}\n")
    pages = sorted(HISTORY.glob("*.md"), reverse=True)
    if pages:
        parts.append(
            "## The diary\n\n" + "\n".join(f"- [`{p.relative_to(HERE)}`]({p.relative_to(HERE)})" for p in pages) + "\n"
        )
    studies = HERE / "studies" / "README.md"
    if studies.exists():
        parts.append(
            "## Studies\n\nThe experiments behind the streaming design, their questions and answers: "
            "[`studies/README.md`](studies/README.md).\n"
        )
    out = HERE / "RESULTS.md"
    out.write_text("\n".join(parts), encoding="utf-8")
    return out


if __name__ == "__main__":
    print(f"wrote {assemble()}")
