"""Promise: ``save_sharded`` never loses a checkpoint or a file next to it.

* ``overwrite=True`` replaces the checkpoint's own files (shards, index, stale shards of an
  earlier save) and keeps ``config.json``, tokenizer files and everything else;
* at every instant, and after a kill at any step, the folder holds a complete checkpoint, the
  old one or the new one (checked by killing a save at every file-system step, in a subprocess);
* ``overwrite=False`` never removes what another process put in the folder meanwhile;
* a full disk or a read-only folder is an ``OSError`` naming the folder, with nothing changed;
* temporaries of a killed save are cleaned by the next save, and only those.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import safetensors.torch
import torch

import bigviz
from bigviz.checkpoint import save as save_module
from bigviz.checkpoint.index import CheckpointIndex
from bigviz.checkpoint.lazy import LazyWeights

from tests.hostile.conftest import remount_read_only
from tests.hostile.helpers import snapshot

EXTRAS = {"config.json": '{"model_type": "test"}', "tokenizer.json": '{"vocab": {}}', "README.md": "# mine"}


def _state(seed: int, n: int = 6, width: int = 16) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"layers.{i}.weight": torch.randn(width, width, generator=g) for i in range(n)}  # 1 KiB each


def _with_extras(folder: Path) -> None:
    for name, text in EXTRAS.items():
        (folder / name).write_text(text)
    (folder / "sub").mkdir(exist_ok=True)
    (folder / "sub" / "mine.safetensors").write_bytes(b"not bigviz's")


def _bigviz_view(folder: Path) -> dict[str, torch.Tensor]:
    with LazyWeights(CheckpointIndex.open(folder)) as weights:
        return {k: weights[k].clone() for k in weights}


def _transformers_view(folder: Path, stem: str = "model", ext: str = "safetensors") -> dict[str, torch.Tensor]:
    """What transformers' from_pretrained reads: the single file first, else the index."""

    def read(path: Path) -> dict[str, torch.Tensor]:
        if ext == "safetensors":
            return safetensors.torch.load_file(path)
        return torch.load(path, weights_only=True)

    if (folder / f"{stem}.{ext}").is_file():
        return read(folder / f"{stem}.{ext}")
    index = json.loads((folder / f"{stem}.{ext}.index.json").read_text())
    out: dict[str, torch.Tensor] = {}
    for file in sorted(set(index["weight_map"].values())):
        out.update(read(folder / file))
    return {k: out[k] for k in index["weight_map"]}


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_overwrite_keeps_config_tokenizer_and_other_files(tmp_path: Path):
    folder = bigviz.save_sharded(_state(1), tmp_path / "c", max_shard_size=2500, progress=False)
    _with_extras(folder)
    kept = {k: v for k, v in snapshot(folder).items() if not k.startswith("model")}
    bigviz.save_sharded(_state(2), folder, max_shard_size=4500, overwrite=True, progress=False)
    assert {k: v for k, v in snapshot(folder).items() if not k.startswith("model")} == kept
    names = sorted(p.name for p in folder.iterdir() if p.name.startswith("model"))
    assert names == [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
        "model.safetensors.index.json",
    ]  # the 3 shards of the first save are gone
    assert _equal(_bigviz_view(folder), _state(2)) and _equal(_transformers_view(folder), _state(2))


def test_overwrite_replaces_the_checkpoint_in_every_format_and_variant(tmp_path: Path):
    """A stale file of another format or variant would shadow the new checkpoint (transformers
    reads model.safetensors before any .bin; bigviz reads an fp16 index before model.safetensors)."""
    folder = tmp_path / "c"
    folder.mkdir()
    _with_extras(folder)
    old = {
        "model.safetensors": b"old single",
        "model.fp16-00001-of-00002.safetensors": b"x",
        "model.fp16-00002-of-00002.safetensors": b"x",
        "model.safetensors.index.fp16.json": b"{}",
        "model-00001-of-00009.safetensors": b"stale",
        "pytorch_model.bin": b"old other format",
    }
    kept = {
        "model.safetensors.bak": b"kept",
        "my-model.safetensors": b"kept",
        "training_args.bin": b"kept",
        "adapter_model.safetensors": b"kept",
        "index.json": b"{}",
    }
    for name, data in {**old, **kept}.items():
        (folder / name).write_bytes(data)
    bigviz.save_sharded(_state(2), folder, max_shard_size=2500, overwrite=True, progress=False)
    names = {p.name for p in folder.iterdir()}
    assert not set(old) & names
    assert all((folder / name).read_bytes() == data for name, data in kept.items())
    assert all((folder / name).read_text() == text for name, text in EXTRAS.items())
    assert _equal(_bigviz_view(folder), _state(2)) and _equal(_transformers_view(folder), _state(2))
    bigviz.save_sharded(
        _state(3), folder, safe_serialization=False, max_shard_size=2500, overwrite=True, progress=False
    )
    names = {p.name for p in folder.iterdir()}
    assert not any(n.startswith("model") and n.endswith((".safetensors", ".json")) for n in names - set(kept))
    assert _equal(_transformers_view(folder, "pytorch_model", "bin"), _state(3))
    assert _equal(_bigviz_view(folder / "pytorch_model.bin.index.json"), _state(3))
    assert all((folder / name).read_bytes() == data for name, data in kept.items())


def test_without_overwrite_a_folder_holding_a_checkpoint_is_refused(tmp_path: Path):
    folder = bigviz.save_sharded(_state(1), tmp_path / "c", progress=False)
    files = snapshot(folder)
    with pytest.raises(FileExistsError, match="overwrite=True"):
        bigviz.save_sharded(_state(2), folder, progress=False)
    assert snapshot(folder) == files
    config_only = tmp_path / "d"
    config_only.mkdir()
    (config_only / "config.json").write_text("{}")
    bigviz.save_sharded(_state(2), config_only, progress=False)  # weights next to a config: fine
    assert (config_only / "config.json").read_text() == "{}" and _equal(_bigviz_view(config_only), _state(2))


def test_without_overwrite_what_another_process_wrote_meanwhile_is_kept(tmp_path: Path, monkeypatch):
    folder = tmp_path / "c"
    write = save_module.write_safetensors

    def racing(path: Path, tensors, **kwargs):  # another process saves into the folder mid-way
        folder.mkdir(exist_ok=True)
        if not (folder / "model.safetensors").exists():
            (folder / "model.safetensors").write_bytes(b"theirs")
            (folder / "notes.txt").write_text("theirs")
        return write(path, tensors, **kwargs)

    monkeypatch.setattr(save_module, "write_safetensors", racing)
    with pytest.raises(FileExistsError, match=str(folder)):
        bigviz.save_sharded(_state(1), folder, max_shard_size=2500, progress=False)
    assert snapshot(folder) == {"model.safetensors": b"theirs", "notes.txt": b"theirs"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c"]


def test_a_failed_save_into_a_new_folder_leaves_nothing(tmp_path: Path, monkeypatch):
    _fail_writes_after(monkeypatch, 1, errno.ENOSPC)
    with pytest.raises(OSError) as info:
        bigviz.save_sharded(_state(1), tmp_path / "new", max_shard_size=2500, progress=False)
    assert info.value.errno == errno.ENOSPC and str(tmp_path / "new") in str(info.value)
    assert list(tmp_path.iterdir()) == []


def _fail_writes_after(monkeypatch: pytest.MonkeyPatch, good: int, code: int) -> None:
    """The shard writer fails (after writing half a shard) once ``good`` shards were written."""
    write = save_module.write_safetensors
    done = [0]

    def faulty(path: Path, tensors, **kwargs):
        if done[0] >= good:
            path.write_bytes(b"\0" * 512)
            raise OSError(code, os.strerror(code))
        done[0] += 1
        return write(path, tensors, **kwargs)

    monkeypatch.setattr(save_module, "write_safetensors", faulty)


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EROFS, errno.EIO])
def test_a_write_error_mid_save_changes_nothing(tmp_path: Path, monkeypatch, code: int):
    folder = bigviz.save_sharded(_state(1), tmp_path / "c", max_shard_size=2500, progress=False)
    _with_extras(folder)
    files = snapshot(folder)
    _fail_writes_after(monkeypatch, 2, code)
    with pytest.raises(OSError) as info:
        bigviz.save_sharded(_state(2), folder, max_shard_size=2500, overwrite=True, progress=False)
    assert info.value.errno == code and str(folder) in str(info.value)
    assert snapshot(folder) == files and sorted(p.name for p in tmp_path.iterdir()) == ["c"]


@pytest.mark.parametrize("safe", [True, False], ids=["safetensors", "bin"])
def test_a_full_disk_changes_nothing(small_fs: Path, safe: bool):
    kw = {"max_shard_size": "70KB", "safe_serialization": safe, "progress": False}
    folder = bigviz.save_sharded(_state(1, n=4, width=128), small_fs / "c", **kw)
    _with_extras(folder)
    files = snapshot(folder)
    with pytest.raises(OSError) as info:  # 1.5 MiB of new weights on a 1 MiB disk (torch.save's too)
        bigviz.save_sharded(_state(2, n=24, width=128), folder, overwrite=True, **kw)
    assert info.value.errno == errno.ENOSPC and str(folder) in str(info.value)
    assert snapshot(folder) == files and sorted(p.name for p in small_fs.iterdir()) == ["c"]
    bigviz.save_sharded(_state(3, n=4, width=128), folder, overwrite=True, **kw)
    stem, ext = ("model", "safetensors") if safe else ("pytorch_model", "bin")
    assert _equal(_transformers_view(folder, stem, ext), _state(3, n=4, width=128))  # the space came back


@pytest.mark.parametrize("safe", [True, False], ids=["safetensors", "bin"])
def test_a_full_disk_with_a_config_keeps_the_old_config(small_fs: Path, safe: bool):
    kw = {"max_shard_size": "70KB", "safe_serialization": safe, "progress": False}
    folder = bigviz.save_sharded(_state(1, n=4, width=128), small_fs / "c", config={"n": 4}, **kw)
    files = snapshot(folder)
    with pytest.raises(OSError) as info:
        bigviz.save_sharded(_state(2, n=24, width=128), folder, overwrite=True, config={"n": 24}, **kw)
    assert info.value.errno == errno.ENOSPC and str(folder) in str(info.value)
    assert snapshot(folder) == files


def test_a_full_disk_into_a_new_folder_leaves_nothing(small_fs: Path):
    with pytest.raises(OSError) as info:
        bigviz.save_sharded(_state(2, n=24, width=128), small_fs / "new" / "c", safe_serialization=False)
    assert info.value.errno == errno.ENOSPC and "small" in str(info.value)
    assert list(small_fs.iterdir()) == []


def test_the_same_config_again_changes_nothing_and_a_different_one_is_refused(tmp_path: Path):
    folder = bigviz.save_sharded(_state(1), tmp_path / "c", config={"n": 6}, progress=False)
    before = (folder / "config.json").stat()
    bigviz.save_sharded(_state(2), folder, config={"n": 6}, overwrite=True, progress=False)
    assert (folder / "config.json").stat().st_ino == before.st_ino  # the same text: not rewritten
    (folder / "model.safetensors").unlink()  # a folder holding a config only
    files = snapshot(folder)
    with pytest.raises(FileExistsError, match="config.json exists and differs"):
        bigviz.save_sharded(_state(3), folder, config={"n": 7}, progress=False)
    assert snapshot(folder) == files


@pytest.mark.parametrize("kind", ["folder", "link"])
def test_a_config_json_that_is_not_a_file_is_never_replaced(tmp_path: Path, kind: str):
    """A ``config.json`` that is the user's folder (or a link to their config elsewhere) is not a
    file bigviz could have written: refused even with overwrite=True, before anything is written
    (it was moved into the save's stage and removed with it, contents and all)."""
    folder = bigviz.save_sharded(_state(1), tmp_path / "c", progress=False)
    if kind == "folder":
        (folder / "config.json").mkdir()
        (folder / "config.json" / "notes.txt").write_text("mine")
    else:
        (tmp_path / "elsewhere.json").write_text('{"n": 1}')
        (folder / "config.json").symlink_to(tmp_path / "elsewhere.json")
    files = snapshot(tmp_path)
    with pytest.raises(FileExistsError, match=f"config.json is a {'folder' if kind == 'folder' else 'symbolic link'}"):
        bigviz.save_sharded(_state(2), folder, config={"n": 2}, overwrite=True, progress=False)
    assert snapshot(tmp_path) == files and (folder / "config.json").is_symlink() == (kind == "link")
    bigviz.save_sharded(_state(2), folder, overwrite=True, progress=False)  # without config=: kept, saved
    assert (folder / "config.json").exists() and (folder / "model.safetensors").exists()


def test_a_transformers_config_saved_by_save_pretrained_is_the_same_config(tmp_path: Path):
    """``save_pretrained`` writes a config's difference from its class's defaults and the
    version: the same config given to save_sharded is recognised, the file left as it is; one
    that differs is still refused."""
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(vocab_size=64, n_embd=16, n_layer=1, n_head=2, n_positions=32)
    folder = tmp_path / "c"
    config.save_pretrained(folder)
    written = (folder / "config.json").read_bytes()
    bigviz.save_sharded(_state(1), folder, config=config, progress=False)
    assert (folder / "config.json").read_bytes() == written
    (folder / "model.safetensors").unlink()  # a folder holding the config only
    with pytest.raises(FileExistsError, match="exists and differs"):
        bigviz.save_sharded(_state(1), folder, config=transformers.GPT2Config(n_layer=2), progress=False)
    assert (folder / "config.json").read_bytes() == written


@pytest.mark.parametrize(
    ("case", "safe", "error"),
    [
        ("metadata value", True, "metadata must map strings to strings.*'epoch': int"),
        ("metadata key", True, "metadata must map strings to strings"),
        ("int key", True, "tensor names must be non-empty strings.*1"),
        ("int key", False, "tensor names must be non-empty strings"),
        ("header name", True, "named '__metadata__'"),
        ("sparse", True, "not dense.*sparse_coo.*to_dense"),
    ],
)
def test_what_no_loader_could_read_is_refused_before_a_good_checkpoint_is_replaced(
    tmp_path: Path, case: str, safe: bool, error: str
):
    """Inputs that made a checkpoint neither bigviz nor safetensors reads back (and, with
    overwrite=True, replaced a readable one with it) are refused first, naming what is wrong."""
    folder = bigviz.save_sharded(_state(1), tmp_path / "c", progress=False, safe_serialization=safe)
    files = snapshot(folder)
    state: dict = dict(_state(2))
    metadata: dict | None = None
    if case == "metadata value":
        metadata = {"epoch": 3}
    elif case == "metadata key":
        metadata = {1: "one"}
    elif case == "int key":
        state[1] = torch.zeros(2)
    elif case == "header name":
        state["__metadata__"] = torch.zeros(2)
    else:
        state["s"] = torch.eye(3).to_sparse()
    with pytest.raises((TypeError, ValueError), match=error):
        bigviz.save_sharded(state, folder, overwrite=True, metadata=metadata, progress=False, safe_serialization=safe)
    assert snapshot(folder) == files
    assert CheckpointIndex.open(folder).keys() == _state(1).keys()


def test_a_lone_shard_in_a_folder_is_refused_not_read_as_a_checkpoint(tmp_path: Path):
    folder = bigviz.save_sharded(_state(1), tmp_path / "c", max_shard_size=2500, progress=False)
    (folder / "model.safetensors.index.json").unlink()
    for shard in sorted(folder.glob("model-*"))[1:]:
        shard.unlink()
    with pytest.raises(ValueError, match="incomplete checkpoint.*shard 1 of 3"):
        CheckpointIndex.open(folder)


def test_a_read_only_folder_changes_nothing(small_fs: Path):
    folder = bigviz.save_sharded(_state(1), small_fs / "c", max_shard_size=2500, progress=False)
    _with_extras(folder)
    files = snapshot(folder)
    remount_read_only(small_fs)
    for overwrite in (True, False):
        with pytest.raises(OSError) as info:
            bigviz.save_sharded(_state(2), folder, max_shard_size=2500, overwrite=True, progress=False)
        assert info.value.errno == errno.EROFS and str(folder) in str(info.value)
    assert snapshot(folder) == files


def test_temporaries_of_others_and_of_a_live_save_are_kept(tmp_path: Path):
    folder = bigviz.save_sharded(_state(1), tmp_path / "c", max_shard_size=2500, progress=False)
    (folder / ".cache").mkdir()
    (folder / ".cache" / "x").write_text("keep")
    (folder / ".tmp-mine").mkdir()
    live = folder / ".bigviz-save-0123456789ab"  # another save in progress holds its lock
    live.mkdir()
    (live / "model.safetensors").write_bytes(b"in progress")
    fd = os.open(live, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    try:
        bigviz.save_sharded(_state(2), folder, overwrite=True, progress=False)
        assert (live / "model.safetensors").read_bytes() == b"in progress"
    finally:
        os.close(fd)
    assert (folder / ".cache" / "x").read_text() == "keep" and (folder / ".tmp-mine").is_dir()
    bigviz.save_sharded(_state(3), folder, overwrite=True, progress=False)
    assert not live.exists()  # its save died (lock released): a stale temporary, cleaned


KILL_SCRIPT = textwrap.dedent('''
    import builtins, json, os, shutil, signal, sys
    from pathlib import Path
    import torch
    torch.set_num_threads(1)
    import bigviz

    MUTATORS = ("rename", "replace", "link", "unlink", "rmdir", "remove", "symlink", "mkdir", "truncate")
    EXTRAS = json.loads(sys.argv[3])


    def state(seed, n):
        g = torch.Generator().manual_seed(seed)
        return {f"layers.{i}.weight": torch.randn(16, 16, generator=g) for i in range(n)}


    def save(cfg, seed, folder, overwrite):
        bigviz.save_sharded(state(seed, cfg["n"]), folder, max_shard_size=cfg["shard"],
                            safe_serialization=cfg["safe"], overwrite=overwrite, progress=False,
                            config=cfg.get("config"))


    def killed_at(k, new, folder):
        """In a fork: run the save, SIGKILLed just before its k-th file-system change."""
        count = [0]

        def step():
            count[0] += 1
            if count[0] == k:
                os.kill(os.getpid(), signal.SIGKILL)

        def wrap(fn):
            def wrapped(*args, **kwargs):
                step()
                return fn(*args, **kwargs)
            return wrapped

        for name in MUTATORS:
            setattr(os, name, wrap(getattr(os, name)))
        real_open = builtins.open

        def opening(file, mode="r", *args, **kwargs):
            if any(c in mode for c in "wax+"):
                step()
            return real_open(file, mode, *args, **kwargs)

        builtins.open = opening
        save(new, 2, folder, new.get("overwrite", True))


    def scenario(work, old, new):
        run = work / "run"
        if old is not None:
            save(old, 1, run / "ckpt", False)
        (run / "ckpt").mkdir(parents=True, exist_ok=True)
        for name, text in EXTRAS.items():
            if not (name == "config.json" and (new.get("config") or (old or {}).get("config"))):
                (run / "ckpt" / name).write_text(text)
        shutil.copytree(run, work / "initial", symlinks=True)
        kills = 0
        for k in range(1, 400):
            pid = os.fork()
            if pid == 0:
                try:
                    killed_at(k, new, run / "ckpt")
                except BaseException:
                    os._exit(3)
                os._exit(0)
            _, status = os.waitpid(pid, 0)
            if not os.WIFSIGNALED(status):
                return {"kills": kills, "exit": os.WEXITSTATUS(status)}
            kills += 1
            shutil.copytree(run, work / f"killed-{k}", symlinks=True)  # what is left after the kill
            shutil.rmtree(run)
            shutil.copytree(work / "initial", run, symlinks=True)


    root, scenarios = Path(sys.argv[1]), json.loads(sys.argv[2])
    print(json.dumps({name: scenario(root / name, old, new) for name, (old, new) in scenarios.items()}))
''')

SCENARIOS = {  # (old save, new save): same shard names, single <-> sharded, fewer shards, .bin
    "same-names": ({"n": 6, "shard": 2500, "safe": True}, {"n": 6, "shard": 2500, "safe": True}),
    "single-to-sharded": ({"n": 6, "shard": 10**9, "safe": True}, {"n": 6, "shard": 2500, "safe": True}),
    "sharded-to-single": ({"n": 6, "shard": 2500, "safe": True}, {"n": 5, "shard": 10**9, "safe": True}),
    "fewer-shards": ({"n": 6, "shard": 2500, "safe": True}, {"n": 6, "shard": 4500, "safe": True}),
    "bin": ({"n": 6, "shard": 2500, "safe": False}, {"n": 6, "shard": 2500, "safe": False}),
}
CONFIG_A, CONFIG_B = {"model_type": "test", "n_layer": 6}, {"model_type": "test", "n_layer": 5}
CONFIG_SCENARIOS = {  # config.json in the same commit; and saves without overwrite into an empty folder
    "config-same-names": (
        {"n": 6, "shard": 2500, "safe": True, "config": CONFIG_A},
        {"n": 6, "shard": 2500, "safe": True, "config": CONFIG_B},
    ),
    "config-single-to-sharded": (
        {"n": 6, "shard": 10**9, "safe": True, "config": CONFIG_A},
        {"n": 5, "shard": 2500, "safe": True, "config": CONFIG_B},
    ),
    "config-sharded-to-single": (
        {"n": 6, "shard": 2500, "safe": True, "config": CONFIG_A},
        {"n": 5, "shard": 10**9, "safe": True, "config": CONFIG_B},
    ),
    "config-added": ({"n": 6, "shard": 2500, "safe": True}, {"n": 5, "shard": 2500, "safe": True, "config": CONFIG_B}),
    "config-bin": (
        {"n": 6, "shard": 2500, "safe": False, "config": CONFIG_A},
        {"n": 5, "shard": 2500, "safe": False, "config": CONFIG_B},
    ),
    "no-overwrite-sharded": (None, {"n": 6, "shard": 2500, "safe": True, "overwrite": False, "config": CONFIG_B}),
    "no-overwrite-single": (None, {"n": 6, "shard": 10**9, "safe": True, "overwrite": False}),
    "no-overwrite-bin": (None, {"n": 6, "shard": 2500, "safe": False, "overwrite": False}),
}


@pytest.fixture(scope="module")
def killed_saves(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    """Every scenario's save killed before each of its file-system steps in turn, in forks of
    one subprocess (one torch import); what each kill left is copied for the checks."""
    root = tmp_path_factory.mktemp("killed")
    done = subprocess.run(
        [sys.executable, "-c", KILL_SCRIPT, str(root), json.dumps(SCENARIOS | CONFIG_SCENARIOS), json.dumps(EXTRAS)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return root, json.loads(done.stdout.strip().splitlines()[-1])


def _state16(seed: int, n: int) -> dict[str, torch.Tensor]:
    return _state(seed, n=n, width=16)


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_a_save_killed_at_any_step_leaves_a_complete_checkpoint(killed_saves: tuple[Path, dict], scenario: str):
    root, results = killed_saves
    result = results[scenario]
    assert result["exit"] == 0 and result["kills"] >= 4, result
    old_cfg, new_cfg = SCENARIOS[scenario]
    old, new = _state16(1, old_cfg["n"]), _state16(2, new_cfg["n"])
    stem, ext = ("model", "safetensors") if new_cfg["safe"] else ("pytorch_model", "bin")
    for k in range(1, result["kills"] + 1):
        run = root / scenario / f"killed-{k}"
        folder = run / "ckpt"
        for view in (_bigviz_view(folder), _transformers_view(folder, stem, ext)):
            assert _equal(view, old) or _equal(view, new), f"killed before step {k}: neither old nor new"
        for name, text in EXTRAS.items():
            assert (folder / name).read_text() == text, (k, name)
        newer = _state16(3, 4)  # the next save finishes the job and cleans what the kill left
        bigviz.save_sharded(
            newer,
            folder,
            max_shard_size=new_cfg["shard"],
            safe_serialization=new_cfg["safe"],
            overwrite=True,
            progress=False,
        )
        assert [p.name for p in run.iterdir()] == ["ckpt"], (k, list(run.iterdir()))
        left = sorted(p.name for p in folder.iterdir() if p.name not in EXTRAS)
        assert all(n.startswith(stem) for n in left), (k, left)
        assert all((folder / name).read_text() == text for name, text in EXTRAS.items()), k
        assert _equal(_bigviz_view(folder), newer) and _equal(_transformers_view(folder, stem, ext), newer)


def _config(folder: Path) -> dict | None:
    path = folder / "config.json"
    return json.loads(path.read_text()) if path.is_file() else None


def _view_or_none(folder: Path, stem: str, ext: str) -> tuple[dict | None, dict | None]:
    """bigviz's and transformers' view of the folder's checkpoint; None where there is none."""
    out = []
    for read in (_bigviz_view, lambda f: _transformers_view(f, stem, ext)):
        try:
            out.append(read(folder))
        except (ValueError, OSError):
            out.append(None)
    return out[0], out[1]


@pytest.mark.parametrize("scenario", sorted(CONFIG_SCENARIOS))
def test_a_save_killed_at_any_step_never_pairs_weights_with_another_config(
    killed_saves: tuple[Path, dict], scenario: str
):
    """At every kill: the weights are the old or the new ones (or, without ``overwrite`` into
    an empty folder, none yet), and ``config.json`` is theirs or absent, never the other's; the
    user's files are untouched; the next save finishes the job (an ``overwrite=False`` save
    again is refused only when the killed one had completed)."""
    root, results = killed_saves
    result = results[scenario]
    assert result["exit"] == 0 and result["kills"] >= 4, result
    old_cfg, new_cfg = CONFIG_SCENARIOS[scenario]
    old = _state16(1, old_cfg["n"]) if old_cfg is not None else None
    new = _state16(2, new_cfg["n"])
    old_config, new_config = (old_cfg or {}).get("config"), new_cfg.get("config")
    stem, ext = ("model", "safetensors") if new_cfg["safe"] else ("pytorch_model", "bin")
    extras = {k: v for k, v in EXTRAS.items() if not (k == "config.json" and (old_config or new_config))}
    if old_cfg is not None and old_config is None:
        old_config = json.loads(EXTRAS["config.json"])  # the user's own config.json
    overwrite = new_cfg.get("overwrite", True)
    for k in range(1, result["kills"] + 1):
        folder = root / scenario / f"killed-{k}" / "ckpt"
        config = _config(folder) if (old_config or new_config) else None
        for view in _view_or_none(folder, stem, ext):
            if view is not None and _equal(view, new):
                assert config in (new_config, None) or (new_config is None and config == old_config), (k, config)
            elif view is not None:
                assert old is not None and _equal(view, old), f"killed before step {k}: neither old nor new"
                assert config in (old_config, None), (k, config)
            else:
                assert old is None, f"killed before step {k}: the old checkpoint is gone"
        for name, text in extras.items():
            assert (folder / name).read_text() == text, (k, name)
        complete = _view_or_none(folder, stem, ext)[0] is not None
        again = {"max_shard_size": new_cfg["shard"], "safe_serialization": new_cfg["safe"], "progress": False}
        if overwrite or not complete:  # the next save finishes the job and cleans what the kill left
            bigviz.save_sharded(new, folder, overwrite=overwrite, config=new_config, **again)
            assert _equal(_bigviz_view(folder), new) and _equal(_transformers_view(folder, stem, ext), new), k
            if new_config or old_config:
                assert _config(folder) == (new_config or old_config), k
        else:
            with pytest.raises(FileExistsError):  # the killed save had finished: its checkpoint is kept
                bigviz.save_sharded(new, folder, overwrite=False, config=new_config, **again)
            bigviz.save_sharded(new, folder, overwrite=True, config=new_config, **again)  # then tidied
        assert [p.name for p in folder.parent.iterdir()] == ["ckpt"], (k, list(folder.parent.iterdir()))
        left = sorted(p.name for p in folder.iterdir() if p.name not in extras and p.name != "config.json")
        assert all(n.startswith(stem) for n in left), (k, left)
        assert not [p for p in folder.iterdir() if p.name.startswith(".")], k  # no temporaries left
        assert all((folder / name).read_text() == text for name, text in extras.items()), k
