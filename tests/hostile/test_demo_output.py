"""Promise: ``bigviz demo --out DIR`` never deletes what it did not write. A non-empty folder
that is not an earlier demo output is refused, untouched; an earlier demo output is reused,
and files added to it are kept."""

from __future__ import annotations

from pathlib import Path

import pytest

from bigviz import demo
from bigviz.cli import main

from tests.hostile.helpers import snapshot


@pytest.fixture
def quick_demo(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The demo's steps replaced by stubs writing its output names (it runs in seconds)."""
    steps: list[str] = []

    def plan_big_models(out: Path) -> None:
        steps.append("plan")
        (out / "gpt2-xl.device_map.json").write_text("{}")

    def run_offloaded(out: Path, trained: object, tokens: int) -> bool:
        steps.append("run")
        (out / "device_map.json").write_text("{}")
        return True

    monkeypatch.setattr(demo, "plan_big_models", plan_big_models)
    monkeypatch.setattr(demo, "load_tiny", lambda: steps.append("load"))
    monkeypatch.setattr(demo, "run_offloaded", run_offloaded)
    return steps


def _user_folder(folder: Path) -> dict[str, bytes]:
    folder.mkdir(exist_ok=True)
    (folder / "notes.txt").write_text("my notes")
    (folder / "data").mkdir()
    (folder / "data" / "weights.bin").write_bytes(b"\x00\x01" * 100)
    return snapshot(folder)


def test_a_folder_the_demo_did_not_write_is_refused(tmp_path: Path, quick_demo: list[str], capsys):
    out = tmp_path / "mine"
    before = _user_folder(out)
    assert main(["demo", "--quick", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert str(out) in err and "not empty" in err and "notes.txt" in err and "never deletes" in err
    assert snapshot(out) == before and quick_demo == []


def test_out_dot_is_refused_in_a_busy_folder(tmp_path: Path, quick_demo: list[str], monkeypatch, capsys):
    before = _user_folder(tmp_path / "cwd")
    monkeypatch.chdir(tmp_path / "cwd")
    assert main(["demo", "--quick", "--out", "."]) == 2
    assert "not empty" in capsys.readouterr().err
    assert snapshot(tmp_path / "cwd") == before and quick_demo == []


def test_a_file_as_out_is_refused(tmp_path: Path, quick_demo: list[str], capsys):
    (tmp_path / "f").write_text("keep")
    assert main(["demo", "--quick", "--out", str(tmp_path / "f")]) == 2
    assert "is a file" in capsys.readouterr().err and (tmp_path / "f").read_text() == "keep"


def test_an_earlier_demo_output_is_reused_and_other_files_kept(tmp_path: Path, quick_demo: list[str]):
    out = tmp_path / "demo"
    assert demo.main(out, quick=True) == 0  # a new folder
    assert (out / "bigviz-demo.json").is_file() and (out / "device_map.json").is_file()
    (out / "my-notes.txt").write_text("added by hand")
    assert demo.main(out, quick=True) == 0  # its own earlier output: accepted
    assert (out / "my-notes.txt").read_text() == "added by hand"
    assert quick_demo == ["plan", "load", "run"] * 2
    empty = tmp_path / "empty"
    empty.mkdir()
    assert demo.main(empty, quick=True) == 0  # an empty folder is fine too
