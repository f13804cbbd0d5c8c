"""Promise: bigviz only reuses or deletes the offload-folder files its own record
(``bigviz-offload.json``) says it wrote. A folder holding anything else (a saved checkpoint,
your files) is refused by ``disk_offload``, ``dispatch_model`` and ``.bin`` loads with a disk
map, naming the folder and the files, before anything is written or moved."""

from __future__ import annotations

import copy
import errno
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import bigviz
from bigviz.models import GPT, GPTConfig

from tests.hostile.helpers import assert_same_state, model_state, snapshot


def _gpt(seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(GPTConfig.preset("gpt-tiny")).eval()


def _ids() -> torch.Tensor:
    return torch.randint(0, 128, (1, 6), generator=torch.Generator().manual_seed(5))


def _folder_with_a_checkpoint(folder: Path, *, sharded: bool = True) -> dict[str, bytes]:
    """An offload folder someone pointed at their saved checkpoint (no bigviz record in it)."""
    bigviz.save_sharded(_gpt(9), folder, max_shard_size="30KB" if sharded else "1GB", progress=False)
    return snapshot(folder)


def _refused(err: pytest.ExceptionInfo, folder: Path, files: dict[str, bytes]) -> None:
    message = str(err.value)
    assert str(folder) in message and "bigviz-offload.json" in message, message
    assert sorted(files)[0] in message  # the files are named
    assert snapshot(folder) == files


@pytest.mark.parametrize("sharded", [True, False])
def test_disk_offload_refuses_a_folder_holding_a_checkpoint(tmp_path: Path, sharded: bool):
    folder = tmp_path / "off"
    files = _folder_with_a_checkpoint(folder, sharded=sharded)
    model = _gpt()
    before = model_state(model)
    with pytest.raises(ValueError) as err:
        bigviz.disk_offload(model, folder)
    _refused(err, folder, files)
    assert_same_state(model, before) and not hasattr(model, "_hf_hook")


def test_dispatch_model_refuses_a_folder_holding_other_files(tmp_path: Path):
    folder = tmp_path / "off"
    files = _folder_with_a_checkpoint(folder)
    (folder / "notes.txt").write_text("mine")
    files = snapshot(folder)
    model = _gpt()
    before = model_state(model)
    device_map = {
        "transformer.wte": "cpu",
        "transformer.wpe": "cpu",
        "transformer.h": "disk",
        "transformer.ln_f": "cpu",
        "lm_head": "cpu",
    }
    with pytest.raises(ValueError) as err:
        bigviz.dispatch_model(model, device_map, offload_folder=folder)
    _refused(err, folder, files)
    assert "notes.txt" in str(err.value)
    assert_same_state(model, before) and not hasattr(model, "_hf_hook")


def test_a_bin_load_with_a_disk_map_refuses_a_folder_holding_a_checkpoint(tmp_path: Path):
    source = _gpt(1)
    bigviz.save_sharded(source, tmp_path / "bin", safe_serialization=False, progress=False)
    folder = tmp_path / "off"
    files = _folder_with_a_checkpoint(folder, sharded=False)  # a user's model.safetensors
    with bigviz.init_empty_weights():
        model = GPT(source.config)
    device_map = {
        "transformer.wte": "cpu",
        "transformer.wpe": "cpu",
        "transformer.h": "disk",
        "transformer.ln_f": "cpu",
        "lm_head": "cpu",
    }
    with pytest.raises(ValueError) as err:
        bigviz.load_checkpoint_and_dispatch(model, tmp_path / "bin", device_map, offload_folder=folder)
    _refused(err, folder, files)
    assert all(p.is_meta for p in model.parameters())


def test_its_own_offload_folder_is_reused_and_only_its_files_replaced(tmp_path: Path):
    folder = tmp_path / "off"
    first, second = _gpt(1), _gpt(2)
    with torch.no_grad():
        want = second(_ids())[0]
    bigviz.remove_hooks(bigviz.disk_offload(copy.deepcopy(first), folder))
    record = json.loads((folder / "bigviz-offload.json").read_text())
    old_files = set(record["files"])
    model = bigviz.disk_offload(copy.deepcopy(second), folder)  # bigviz's own folder: replaced
    with torch.no_grad():
        assert torch.equal(model(_ids())[0], want)
    record = json.loads((folder / "bigviz-offload.json").read_text())
    on_disk = {p.name for p in folder.iterdir()}
    assert on_disk == set(record["files"]) | {"bigviz-offload.json"}  # no stale files of the first
    assert not old_files & set(record["files"])
    for name, stamp in record["files"].items():
        st = (folder / name).stat()
        assert stamp == {"inode": st.st_ino, "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def test_a_file_added_to_its_offload_folder_is_kept(tmp_path: Path):
    folder = tmp_path / "off"
    bigviz.remove_hooks(bigviz.disk_offload(_gpt(1), folder))
    (folder / "notes.txt").write_text("mine")
    files = snapshot(folder)
    model = _gpt(2)
    with pytest.raises(ValueError) as err:
        bigviz.disk_offload(model, folder)
    _refused(err, folder, files)
    assert "notes.txt" in str(err.value)


def test_a_file_of_its_own_changed_by_hand_is_no_longer_its_own(tmp_path: Path):
    folder = tmp_path / "off"
    bigviz.remove_hooks(bigviz.disk_offload(_gpt(1), folder))
    record = json.loads((folder / "bigviz-offload.json").read_text())
    mine = folder / sorted(record["files"])[0]
    mine.write_bytes(b"my own bytes now")
    files = snapshot(folder)
    with pytest.raises(ValueError) as err:
        bigviz.disk_offload(_gpt(2), folder)
    assert mine.name in str(err.value) and "changed" in str(err.value)
    assert snapshot(folder) == files


def test_a_crafted_offload_record_is_refused(tmp_path: Path):
    folder = tmp_path / "off"
    folder.mkdir()
    (folder / "secret.txt").write_text("keep")
    for record in ('{"files": {"../secret.txt": 4}}', "[" * 100_000, '{"files": {"secret.txt": true}}'):
        (folder / "bigviz-offload.json").write_text(record)
        files = snapshot(folder)
        with pytest.raises(ValueError, match="bigviz-offload.json"):
            bigviz.disk_offload(_gpt(1), folder)
        assert snapshot(folder) == files


def test_an_empty_or_new_folder_is_fine_and_a_meta_model_reads_it_back(tmp_path: Path):
    model = bigviz.disk_offload(_gpt(3), tmp_path / "new" / "off")
    with torch.no_grad():
        want = model(_ids())[0]
    bigviz.remove_hooks(model)
    with bigviz.init_empty_weights():
        meta = GPT(GPTConfig.preset("gpt-tiny"))
    bigviz.disk_offload(meta, tmp_path / "new" / "off")
    with torch.no_grad():
        assert torch.equal(meta(_ids())[0], want)
    assert all(p.is_meta for p in meta.parameters())


def test_a_file_of_its_own_edited_to_the_same_size_is_refused_and_kept(tmp_path: Path):
    """The record keeps each file's stamp (inode, size, mtime_ns), not its size alone."""
    folder = tmp_path / "off"
    bigviz.remove_hooks(bigviz.disk_offload(_gpt(1), folder))
    record = json.loads((folder / "bigviz-offload.json").read_text())
    mine = folder / record["index"]
    data = bytearray(mine.read_bytes())
    data[-4:] = b"mine"  # the same size, other bytes: someone's edit
    mine.write_bytes(bytes(data))
    files = snapshot(folder)
    model = _gpt(2)
    before = model_state(model)
    with pytest.raises(ValueError) as err:
        bigviz.disk_offload(model, folder)
    assert mine.name in str(err.value) and "changed" in str(err.value), str(err.value)
    assert snapshot(folder) == files  # never deleted
    assert_same_state(model, before) and not hasattr(model, "_hf_hook")


def test_a_file_of_its_own_replaced_by_another_of_the_same_size_and_time_is_refused(tmp_path: Path):
    folder = tmp_path / "off"
    bigviz.remove_hooks(bigviz.disk_offload(_gpt(1), folder))
    record = json.loads((folder / "bigviz-offload.json").read_text())
    mine = folder / record["index"]
    st = mine.stat()
    other = tmp_path / "other"
    other.write_bytes(mine.read_bytes())
    os.utime(other, ns=(st.st_atime_ns, st.st_mtime_ns))
    os.replace(other, mine)  # same size, same time, another file (inode)
    files = snapshot(folder)
    with pytest.raises(ValueError, match="another file by the same name"):
        bigviz.disk_offload(_gpt(2), folder)
    assert snapshot(folder) == files


def test_a_record_of_sizes_alone_still_reads_and_is_replaced(tmp_path: Path):
    """Records written before stamps (sizes only) keep working."""
    folder = tmp_path / "off"
    model = bigviz.disk_offload(_gpt(1), folder)
    with torch.no_grad():
        want = model(_ids())[0]
    bigviz.remove_hooks(model)
    path = folder / "bigviz-offload.json"
    record = json.loads(path.read_text())
    record["files"] = {name: stamp["size"] for name, stamp in record["files"].items()}
    record["version"] = 1
    path.write_text(json.dumps(record))
    with bigviz.init_empty_weights():
        meta = GPT(GPTConfig.preset("gpt-tiny"))
    bigviz.disk_offload(meta, folder)  # reads the earlier offload
    with torch.no_grad():
        assert torch.equal(meta(_ids())[0], want)
    bigviz.remove_hooks(meta)
    bigviz.remove_hooks(bigviz.disk_offload(_gpt(2), folder))  # and it is bigviz's to replace
    assert {p.name for p in folder.iterdir()} == set(json.loads(path.read_text())["files"]) | {path.name}


def test_a_file_edited_under_a_record_of_sizes_alone_is_refused_and_kept(tmp_path: Path):
    """A record of sizes alone (bigviz 0.2) was written after its files: a listed file modified
    later, to the same size, is no longer bigviz's (the old rule deleted it by its size)."""
    folder = tmp_path / "off"
    bigviz.remove_hooks(bigviz.disk_offload(_gpt(1), folder))
    path = folder / "bigviz-offload.json"
    record = json.loads(path.read_text())
    record["files"] = {name: stamp["size"] for name, stamp in record["files"].items()}
    record["version"] = 1
    path.write_text(json.dumps(record))
    written = path.stat().st_mtime_ns
    mine = folder / record["index"]
    data = bytearray(mine.read_bytes())
    data[-4:] = b"mine"  # the same size, other bytes, after the record
    mine.write_bytes(bytes(data))
    os.utime(mine, ns=(written + 10**9, written + 10**9))  # later, whatever the clock's grain
    files = snapshot(folder)
    with pytest.raises(ValueError) as err:
        bigviz.disk_offload(_gpt(2), folder)
    assert mine.name in str(err.value) and "modified after" in str(err.value), str(err.value)
    with bigviz.init_empty_weights():
        meta = GPT(GPTConfig.preset("gpt-tiny"))
    with pytest.raises(ValueError, match="changed since bigviz wrote them"):
        bigviz.disk_offload(meta, folder)  # not read back as bigviz's weights either
    assert snapshot(folder) == files


SHARED = textwrap.dedent("""
    import json, os, sys, time
    from pathlib import Path
    import torch
    import bigviz
    from bigviz.checkpoint import offload_folder
    from bigviz.models import GPT, GPTConfig

    role, folder, signals = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
    torch.manual_seed({"a": 1, "b": 2}[role])
    model = GPT(GPTConfig.preset("gpt-tiny")).eval()
    x = torch.randint(0, 128, (1, 6), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        want = model(x)[0]


    def blocked_on_a_lock(pid):
        # /proc/locks lists a process waiting for a lock as "N: -> FLOCK ... <pid> ..."
        return any("->" in line and f" {pid} " in line for line in open("/proc/locks"))


    def wait_for(done, pid, limit=120):
        start = time.monotonic()
        while not done.exists() and not (pid and blocked_on_a_lock(pid)):
            if time.monotonic() - start > limit:
                raise SystemExit("the other process neither finished nor waited")
            time.sleep(0.01)


    if role == "a":  # writes its shards, then lets b try a whole offload before it goes on
        original = offload_folder.write_checkpoint_files

        def write_then_wait(*args, **kwargs):
            out = original(*args, **kwargs)
            (signals / "a-wrote").touch()
            while not (signals / "b-pid").exists():
                time.sleep(0.01)
            wait_for(signals / "b-done", int((signals / "b-pid").read_text()))
            return out

        offload_folder.write_checkpoint_files = write_then_wait
    else:
        while not (signals / "a-wrote").exists():
            time.sleep(0.01)
        (signals / "b-pid").write_text(str(os.getpid()))
    result = {"role": role}
    try:
        bigviz.disk_offload(model, folder)
        if role == "b":
            (signals / "b-done").touch()
        else:
            wait_for(signals / "b-done", 0)  # b wrote after a: a still reads what it wrote
        with torch.no_grad():
            result["same"] = torch.equal(model(x)[0], want)
    except Exception as err:
        result["error"] = f"{type(err).__name__}: {err}"
        (signals / f"{role}-done").touch()
    print(json.dumps(result))
""")


@pytest.mark.skipif(not os.path.exists("/proc/locks"), reason="needs Linux's /proc/locks to see a waiting process")
def test_two_processes_sharing_an_offload_folder_each_compute_with_their_own_weights(tmp_path: Path):
    """Process b offloads into the folder while a is between writing its shards and opening
    them: the folder's lock makes b wait, a computes with its weights, b with its own, and
    the folder stays bigviz's (a third offload into it works)."""
    folder, signals = tmp_path / "off", tmp_path / "signals"
    signals.mkdir()
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", SHARED, role, str(folder), str(signals)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for role in ("a", "b")
    ]
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-2000:]
        results.append(json.loads(out.strip().splitlines()[-1]))
    assert all(r.get("same") for r in results), results
    record = json.loads((folder / "bigviz-offload.json").read_text())
    assert {p.name for p in folder.iterdir()} == set(record["files"]) | {"bigviz-offload.json"}
    third = bigviz.disk_offload(_gpt(3), folder)  # never refused for good
    with torch.no_grad():
        assert torch.equal(third(_ids())[0], _gpt(3)(_ids())[0])


def _big_model() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(6)])  # 1.5 MiB


def test_a_full_disk_during_a_bin_load_offload_leaves_the_folder_as_it_was(small_fs: Path, tmp_path: Path):
    """A 1 MiB tmpfs: the offload of a .bin checkpoint's disk part fails for want of space;
    what the write made (a partial shard, the record) is gone, the error names the folder."""
    bigviz.save_sharded(_big_model(), tmp_path / "bin", safe_serialization=False, progress=False)
    with bigviz.init_empty_weights():
        model = _big_model()
    device_map = {str(i): "disk" for i in range(6)}
    for folder in (small_fs / "new", small_fs):  # a folder made by the load, an empty one given
        with pytest.raises(OSError) as err:
            bigviz.load_checkpoint_and_dispatch(model, tmp_path / "bin", device_map, offload_folder=folder)
        assert err.value.errno == errno.ENOSPC and str(folder) in str(err.value), str(err.value)
        assert sorted(p.name for p in small_fs.iterdir()) == [] and all(p.is_meta for p in model.parameters())
        assert not hasattr(model, "_hf_hook")


def test_a_full_disk_keeps_an_earlier_offload_as_it_was(small_fs: Path):
    folder = small_fs / "off"
    small = torch.nn.Sequential(torch.nn.Linear(16, 16))
    bigviz.remove_hooks(bigviz.disk_offload(small, folder))
    files = snapshot(folder)
    model = _big_model()
    before = model_state(model)
    with pytest.raises(OSError) as err:
        bigviz.disk_offload(model, folder)
    assert err.value.errno == errno.ENOSPC and str(folder) in str(err.value)
    assert snapshot(folder) == files
    assert_same_state(model, before) and not hasattr(model, "_hf_hook")
    with bigviz.init_empty_weights():
        again = torch.nn.Sequential(torch.nn.Linear(16, 16))
    bigviz.disk_offload(again, folder)  # the earlier offload still reads
    with torch.no_grad():
        assert torch.equal(again(torch.ones(1, 16)), small(torch.ones(1, 16)))


KILLED = textwrap.dedent("""
    import os, signal, sys
    from pathlib import Path
    import torch
    import bigviz
    from bigviz.checkpoint import offload_folder
    from bigviz.models import GPT, GPTConfig

    folder, when = Path(sys.argv[1]), sys.argv[2]
    torch.manual_seed(1)
    model = GPT(GPTConfig.preset("gpt-tiny"))
    original = offload_folder.write_checkpoint_files

    def killed(*args, **kwargs):
        if when == "before":
            os.kill(os.getpid(), signal.SIGKILL)
        original(*args, **kwargs)
        os.kill(os.getpid(), signal.SIGKILL)  # its files written, the record not switched yet

    offload_folder.write_checkpoint_files = killed
    bigviz.disk_offload(model, folder)
""")


@pytest.mark.parametrize("when", ["before", "after"])
def test_an_offload_killed_mid_write_leaves_a_folder_the_next_offload_takes(tmp_path: Path, when: str):
    folder = tmp_path / "off"
    bigviz.remove_hooks(bigviz.disk_offload(_gpt(3), folder))  # an earlier offload, then one killed
    done = subprocess.run([sys.executable, "-c", KILLED, str(folder), when], capture_output=True, text=True)
    assert done.returncode == -9, done.stderr[-2000:]
    model = bigviz.disk_offload(_gpt(2), folder)  # bigviz's own leftovers: taken, not refused
    with torch.no_grad():
        assert torch.equal(model(_ids())[0], _gpt(2)(_ids())[0])
    record = json.loads((folder / "bigviz-offload.json").read_text())
    assert {p.name for p in folder.iterdir()} == set(record["files"]) | {"bigviz-offload.json"}


def test_a_read_only_offload_folder_is_an_error_naming_it(small_fs: Path):
    from tests.hostile.conftest import remount_read_only

    folder = small_fs / "off"
    bigviz.remove_hooks(bigviz.disk_offload(torch.nn.Sequential(torch.nn.Linear(4, 4)), folder))
    files = snapshot(folder)
    remount_read_only(small_fs)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    before = model_state(model)
    with pytest.raises(OSError) as err:
        bigviz.disk_offload(model, folder)
    assert err.value.errno == errno.EROFS and str(folder) in str(err.value)
    assert snapshot(folder) == files
    assert_same_state(model, before) and not hasattr(model, "_hf_hook")
