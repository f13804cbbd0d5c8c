"""Promise: ``bigviz demo --out DIR`` never deletes what it did not write. A non-empty folder
that is not an earlier demo output is refused, untouched; an earlier demo output is reused,
and files added to it are kept. Its marker is read, not trusted by name: an empty or foreign
``bigviz-demo.json`` is refused, and so is an output that is a link (a ``checkpoint`` link to
your own checkpoint), of the wrong type, changed by hand or added since the demo wrote it, all
before step 1."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from torch import nn

import bigviz
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
        steps.append("run")  # the real demo's writes: a checkpoint replaced in place, a map, a report
        bigviz.save_sharded(nn.Linear(4, 4), out / "checkpoint", overwrite=True, progress=False)
        (out / "device_map.json").write_text("{}")
        (out / "report.html").write_text("<html></html>")
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


def _user_checkpoint(folder: Path) -> dict[str, bytes]:
    bigviz.save_sharded(nn.Linear(8, 8), folder, progress=False)
    (folder / "config.json").write_text('{"mine": true}')
    return snapshot(folder)


@pytest.mark.parametrize("marker", [b"", b"[]", b'{"written_by": "someone"}', b"\xff\xfe", b'{"a":' * 50_000])
def test_a_marker_the_demo_did_not_write_is_refused(tmp_path: Path, quick_demo: list[str], capsys, marker: bytes):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "bigviz-demo.json").write_bytes(marker)
    (out / "report.html").write_text("my report")
    (out / "device_map.json").write_text('{"my": "map"}')
    before = snapshot(out)
    assert main(["demo", "--quick", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "bigviz-demo.json that the demo did not write" in err and "Traceback" not in err, err
    assert snapshot(out) == before and quick_demo == []


def test_a_marker_that_is_a_link_or_a_folder_is_refused(tmp_path: Path, quick_demo: list[str], capsys):
    earlier = tmp_path / "earlier"
    assert demo.main(earlier, quick=True) == 0
    for kind in ("link", "folder"):
        out = tmp_path / kind
        out.mkdir()
        (out / "report.html").write_text("mine")
        if kind == "link":
            (out / "bigviz-demo.json").symlink_to(earlier / "bigviz-demo.json")
        else:
            (out / "bigviz-demo.json").mkdir()
        assert main(["demo", "--quick", "--out", str(out)]) == 2
        assert "did not write" in capsys.readouterr().err and (out / "report.html").read_text() == "mine"


def test_a_checkpoint_link_to_your_checkpoint_is_refused(tmp_path: Path, quick_demo: list[str], capsys):
    """An earlier demo folder whose ``checkpoint`` now points at your own: not a byte of yours changes."""
    out = tmp_path / "demo"
    assert demo.main(out, quick=True) == 0
    mine = tmp_path / "my-checkpoint"
    before = _user_checkpoint(mine)
    for f in (out / "checkpoint").iterdir():
        f.unlink()
    (out / "checkpoint").rmdir()
    (out / "checkpoint").symlink_to(mine)
    steps = len(quick_demo)
    assert main(["demo", "--quick", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "checkpoint is a link" in err and str(mine) in err
    assert snapshot(mine) == before and len(quick_demo) == steps


def _edit_report(out: Path) -> None:
    (out / "report.html").write_text("edited by hand")


def _add_note(out: Path) -> None:
    (out / "checkpoint" / "notes.txt").write_text("mine")


def _rewrite_shard(out: Path) -> None:
    shard = out / "checkpoint" / "model.safetensors"
    shard.write_bytes(shard.read_bytes()[:-4] + b"\x00" * 4)  # same size, other bytes


def _map_to_folder(out: Path) -> None:
    (out / "device_map.json").unlink()
    (out / "device_map.json").mkdir()


def _map_to_link(out: Path) -> None:
    (out.parent / "my-map.json").write_text('{"my": "map"}')
    (out / "device_map.json").unlink()
    (out / "device_map.json").symlink_to(out.parent / "my-map.json")


@pytest.mark.parametrize(
    "change, says",
    [
        (_edit_report, "report.html changed since the demo wrote it"),
        (_add_note, "checkpoint/notes.txt was not written by the demo"),
        (_rewrite_shard, "checkpoint/model.safetensors changed since the demo wrote it"),
        (_map_to_folder, "device_map.json is not a file"),
        (_map_to_link, "device_map.json is a link"),
    ],
)
def test_outputs_changed_since_the_demo_wrote_them_are_kept(
    tmp_path: Path, quick_demo: list[str], capsys, change, says
):
    out = tmp_path / "demo"
    assert demo.main(out, quick=True) == 0
    change(out)
    before = snapshot(out)
    steps = len(quick_demo)
    assert main(["demo", "--quick", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert says in err and "Traceback" not in err, err
    assert snapshot(out) == before and len(quick_demo) == steps


def test_a_checkpoint_that_is_a_file_and_out_that_is_a_link_are_refused(tmp_path: Path, quick_demo: list[str], capsys):
    out = tmp_path / "demo"
    assert demo.main(out, quick=True) == 0
    link = tmp_path / "link"
    link.symlink_to(out)
    assert main(["demo", "--quick", "--out", str(link)]) == 2
    assert "is a link" in capsys.readouterr().err
    for f in (out / "checkpoint").iterdir():
        f.unlink()
    (out / "checkpoint").rmdir()
    (out / "checkpoint").write_text("a file where the demo keeps a folder")
    assert main(["demo", "--quick", "--out", str(out)]) == 2
    assert "checkpoint is not a folder" in capsys.readouterr().err
    assert (out / "checkpoint").read_text() == "a file where the demo keeps a folder"


def test_a_demo_stopped_midway_can_run_again(tmp_path: Path, quick_demo: list[str], monkeypatch):
    """Files the demo was writing when it stopped (Ctrl-C) are its own: the next run goes on."""
    out = tmp_path / "demo"

    def stopped(out: Path, trained: object, tokens: int) -> bool:
        bigviz.save_sharded(nn.Linear(4, 4), out / "checkpoint", overwrite=True, progress=False)
        (out / "report.html").write_text("half")
        raise KeyboardInterrupt

    with monkeypatch.context() as patch:
        patch.setattr(demo, "run_offloaded", stopped)
        with pytest.raises(KeyboardInterrupt):
            demo.main(out, quick=True)
    assert demo.main(out, quick=True) == 0
    assert (out / "report.html").read_text() == "<html></html>"
    (out / "report.html").write_text("now edited by hand")  # after a finished run: the user's again
    with pytest.raises(FileExistsError, match="report.html changed"):
        demo.main(out, quick=True)


def test_an_older_demos_marker_is_still_read(tmp_path: Path, quick_demo: list[str], capsys):
    """bigviz 0.1 wrote ``{"written_by": "bigviz demo", "outputs": [...]}`` without stamps: its
    outputs are taken as the demo's, links and wrong types still refused."""
    out = tmp_path / "old-demo"
    out.mkdir()
    legacy = {"written_by": "bigviz demo", "outputs": list(demo.OUTPUTS)}
    (out / "bigviz-demo.json").write_text(json.dumps(legacy))
    (out / "report.html").write_text("an old report")
    assert demo.main(out, quick=True) == 0
    assert (out / "report.html").read_text() == "<html></html>"
    mine = tmp_path / "my-checkpoint"
    before = _user_checkpoint(mine)
    other = tmp_path / "old-demo-2"
    other.mkdir()
    (other / "bigviz-demo.json").write_text(json.dumps(legacy))
    (other / "checkpoint").symlink_to(mine)
    assert main(["demo", "--quick", "--out", str(other)]) == 2
    assert "checkpoint is a link" in capsys.readouterr().err and snapshot(mine) == before
