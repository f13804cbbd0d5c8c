"""Promise: every file the command line writes follows one rule. ``bigviz plan --out/--html`` and
``python -m bigviz.distributed --out/--report`` refuse, before planning or loading anything: an
existing file (unless ``--overwrite``), a file the command reads (the config being planned, a
checkpoint's shard, the ``--plan`` file; even with ``--overwrite``, even through a hard link), a
link, a folder, a missing folder or a folder that is a file, two outputs on one path. Files are
written atomically with the usual permissions (``0o666`` less the umask); ``--overwrite`` keeps a
replaced file's mode.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest
import torch

import bigviz
from bigviz.cli import main
from bigviz.checkpoint.outputs import write_output
from bigviz.models import GPT, GPTConfig


def snapshot(folder: Path) -> dict[str, object]:
    """Every file's bytes, and where each link points (a dangling one too)."""
    found = sorted(folder.rglob("*"))
    return {
        "files": {str(p.relative_to(folder)): p.read_bytes() for p in found if p.is_file()},
        "links": {str(p.relative_to(folder)): os.readlink(p) for p in found if p.is_symlink()},
    }


CONFIG = {"model_type": "bigviz-gpt", **GPTConfig.preset("gpt-tiny").to_dict()}


@pytest.fixture
def cfg(tmp_path: Path) -> Path:
    folder = tmp_path / "cfg"
    folder.mkdir()
    path = folder / "config.json"
    path.write_text(json.dumps(CONFIG))
    return path


def _plan(*extra: str, model: Path | str) -> int:
    return main(["plan", str(model), "--max-memory", "cpu=1GB", *extra])


def _refused(capsys: pytest.CaptureFixture[str], tmp_path: Path, says: str, *extra: str, model: Path | str) -> None:
    before = snapshot(tmp_path)
    assert _plan(*extra, model=model) == 2
    captured = capsys.readouterr()
    assert says in captured.err and "Traceback" not in captured.err, captured.err
    assert "DevicePlan" not in captured.out  # refused before planning
    assert snapshot(tmp_path) == before


def test_the_input_config_is_never_written(tmp_path: Path, cfg: Path, capsys):
    for flag in ("--out", "--html"):
        _refused(capsys, tmp_path, "a file this command reads", flag, str(cfg), "--overwrite", model=cfg)
    os.link(cfg, tmp_path / "hard.json")  # the same file under another name
    _refused(
        capsys, tmp_path, "a file this command reads", "--out", str(tmp_path / "hard.json"), "--overwrite", model=cfg
    )
    _refused(capsys, tmp_path, "a file this command reads", "--out", str(cfg), "--overwrite", model=cfg.parent)


def test_a_checkpoints_files_are_never_written(tmp_path: Path, capsys):
    folder = tmp_path / "ckpt"
    model = GPT(GPTConfig.preset("gpt-tiny"))
    bigviz.save_sharded(model, folder, max_shard_size="60KB", config=model.config, progress=False)
    shard = sorted(folder.glob("*.safetensors"))[0]
    for target in (shard, folder / "model.safetensors.index.json", folder / "config.json"):
        _refused(capsys, tmp_path, "a file this command reads", "--out", str(target), "--overwrite", model=folder)
        # named by one of its files, the checkpoint is still the whole folder
        _refused(capsys, tmp_path, "a file this command reads", "--out", str(target), "--overwrite", model=shard)
    mine = folder / "device_map.json"  # a file of yours beside them: the usual rule
    assert _plan("--out", str(mine), model=folder) == 0
    capsys.readouterr()
    _refused(capsys, tmp_path, "exists", "--out", str(mine), model=folder)
    assert _plan("--out", str(mine), "--overwrite", model=folder) == 0


def test_existing_files_need_overwrite(tmp_path: Path, cfg: Path, capsys):
    out, html = tmp_path / "map.json", tmp_path / "report.html"
    out.write_text("my map")
    html.write_text("my report")
    os.chmod(out, 0o640)
    _refused(
        capsys,
        tmp_path,
        "exists: bigviz does not overwrite it unless you pass --overwrite",
        "--out",
        str(out),
        model=cfg,
    )
    _refused(capsys, tmp_path, "--html", "--out", str(tmp_path / "new.json"), "--html", str(html), model=cfg)
    assert _plan("--out", str(out), "--html", str(html), "--overwrite", model=cfg) == 0
    assert bigviz.load_device_map(out) == {"": "cpu"} and html.stat().st_size > 10_000
    assert stat.S_IMODE(out.stat().st_mode) == 0o640  # a replaced file keeps its mode


def test_links_folders_and_missing_folders_are_refused(tmp_path: Path, cfg: Path, capsys):
    target = tmp_path / "elsewhere.json"
    target.write_text("keep")
    (tmp_path / "link.json").symlink_to(target)
    (tmp_path / "dangling.json").symlink_to(tmp_path / "nowhere.json")
    (tmp_path / "a-folder").mkdir()
    (tmp_path / "a-file").write_text("x")
    cases = [
        ("link.json", "is a link"),
        ("dangling.json", "is a link"),  # it would create nowhere.json through the link
        ("a-folder", "is a folder"),
        ("missing/map.json", "does not exist: create it first"),
        ("a-file/map.json", "is a file, not a folder"),
    ]
    for name, says in cases:
        _refused(capsys, tmp_path, says, "--out", str(tmp_path / name), "--overwrite", model=cfg)
    assert not (tmp_path / "nowhere.json").exists() and target.read_text() == "keep"
    both = str(tmp_path / "same.html")
    _refused(capsys, tmp_path, "give each output its own file", "--out", both, "--html", both, model=cfg)


def test_all_problems_are_listed_at_once(tmp_path: Path, cfg: Path, capsys):
    (tmp_path / "map.json").write_text("mine")
    assert _plan("--out", str(tmp_path / "map.json"), "--html", str(tmp_path / "no" / "r.html"), model=cfg) == 2
    err = capsys.readouterr().err
    assert "2 problems" in err and "--out" in err and "--html" in err


@pytest.mark.parametrize("umask", [0o022, 0o002])
def test_written_files_get_the_usual_permissions(tmp_path: Path, cfg: Path, umask: int):
    old = os.umask(umask)
    try:
        assert _plan("--out", str(tmp_path / "map.json"), "--html", str(tmp_path / "r.html"), model=cfg) == 0
    finally:
        os.umask(old)
    for name in ("map.json", "r.html"):
        assert stat.S_IMODE((tmp_path / name).stat().st_mode) == 0o666 & ~umask
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temporaries left


def test_a_file_that_appears_meanwhile_is_not_replaced(tmp_path: Path):
    path = tmp_path / "out.pt"

    def write(tmp: Path) -> None:
        torch.save(torch.ones(2), tmp)
        path.write_text("another process wrote this")  # between the check and the rename

    with pytest.raises(FileExistsError, match="appeared while bigviz worked"):
        write_output(path, write, overwrite=False)
    assert path.read_text() == "another process wrote this" and os.listdir(tmp_path) == ["out.pt"]


# ---- python -m bigviz.distributed ------------------------------------------------------------
@pytest.fixture
def checkpoint(tmp_path: Path) -> Path:
    model = GPT(GPTConfig.preset("gpt-tiny"))
    return bigviz.save_sharded(model, tmp_path / "ckpt", config=model.config, progress=False)


@pytest.fixture
def no_loading(monkeypatch: pytest.MonkeyPatch) -> None:
    from bigviz.distributed import cli

    def forbidden(*args: object, **kwargs: object) -> None:
        raise AssertionError("the request was not refused before running")

    monkeypatch.setattr(cli, "_run", forbidden)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")


def _distributed(capsys: pytest.CaptureFixture[str], checkpoint: Path, *extra: str) -> str:
    from bigviz.distributed import cli

    assert cli.main([str(checkpoint), "--stages", "2", "--input-ids", "1,2", *extra]) == 2
    return capsys.readouterr().err


def test_distributed_outputs_are_checked_up_front(tmp_path: Path, checkpoint: Path, capsys, no_loading):
    (tmp_path / "a-file").write_text("x")
    shard = next(checkpoint.glob("*.safetensors"))
    plan = tmp_path / "plan.json"
    with bigviz.init_empty_weights():
        bigviz.plan_pipeline(GPT(GPTConfig.preset("gpt-tiny")), 2).save_json(plan)
    before = snapshot(tmp_path)
    cases = [
        (["--out", str(tmp_path / "a-file" / "logits.pt")], "is a file, not a folder"),
        (["--out", str(tmp_path / "missing" / "logits.pt")], "does not exist: create it first"),
        (["--out", str(shard), "--overwrite"], "a file this command reads"),
        (["--out", str(checkpoint / "config.json"), "--overwrite"], "a file this command reads"),
        (["--out", str(tmp_path / "x.pt"), "--report", str(tmp_path / "x.pt")], "give each output its own file"),
        (["--out", str(tmp_path / "x.pt"), "--report", str(tmp_path)], "is a folder"),
    ]
    for extra, says in cases:
        err = _distributed(capsys, checkpoint, *extra)
        assert says in err and "nothing was loaded" in err, err
    from bigviz.distributed import cli

    argv = [str(checkpoint), "--plan", str(plan), "--input-ids", "1", "--out", str(plan), "--overwrite"]
    assert cli.main(argv) == 2 and "a file this command reads" in capsys.readouterr().err
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("dtype", ["int8", "torch.bool", "float17", "3"])
def test_distributed_dtype_is_checked_up_front(tmp_path: Path, checkpoint: Path, capsys, no_loading, dtype: str):
    """A dtype no load can cast to was a traceback on every rank once the stage was built."""
    err = _distributed(capsys, checkpoint, "--out", str(tmp_path / "x.pt"), "--dtype", dtype)
    assert f"--dtype={dtype!r}" in err and "float16" in err and "nothing was loaded" in err, err
    assert not (tmp_path / "x.pt").exists()


def test_only_rank_0_checks_the_outputs(tmp_path: Path, checkpoint: Path, no_loading):
    """Rank 0 writes; another machine's rank may not have the folder at all."""
    from bigviz.distributed import cli

    argv = [str(checkpoint), "--stages", "2", "--input-ids", "1", "--out", str(tmp_path / "missing" / "x.pt")]
    args = cli._parser().parse_args(argv)
    _, rank1 = cli._prepare(args, cli._Env(world=2, rank=1, local_rank=1, joinable=False))
    _, rank0 = cli._prepare(args, cli._Env(world=2, rank=0, local_rank=0, joinable=False))
    assert not any("--out" in p for p in rank1), rank1
    assert any("--out" in p and "missing" in p for p in rank0), rank0


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_distributed_logits_and_report_get_the_usual_permissions(tmp_path: Path, checkpoint: Path, umask: int):
    """What rank 0 writes after the run: torch.save's logits and the JSON report."""
    from bigviz.distributed import cli

    out, report = tmp_path / "logits.pt", tmp_path / "report.json"
    args = cli._parser().parse_args(
        [str(checkpoint), "--stages", "2", "--input-ids", "1", "--out", str(out), "--report", str(report)]
    )
    with bigviz.init_empty_weights():
        plan = bigviz.plan_pipeline(GPT(GPTConfig.preset("gpt-tiny")), 2)
    job = cli._Job(args, 0, 2, None, plan, "float32", "cpu", {})
    result = {"ranks": [{"rank": 0}, {"rank": 1, "result": torch.ones(1, 4)}]}
    old = os.umask(umask)
    try:
        cli._write(job, result)
    finally:
        os.umask(old)
    assert torch.equal(torch.load(out), torch.ones(1, 4)) and json.loads(report.read_text())["dtype"] == "float32"
    assert {stat.S_IMODE(p.stat().st_mode) for p in (out, report)} == {0o666 & ~umask}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "logits.pt", "report.json"]
