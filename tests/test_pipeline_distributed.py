"""``torchrun ... -m bigviz.distributed``: two processes on the CPU with gloo, each loading
only its stage, pipelined logits equal to one process's; and bad requests refused by the
command line before any process loads anything.

The torchrun runs are slow (two Python processes importing torch on a 2-core machine): each
has a generous timeout and its whole process group is killed if it overruns.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import bigviz
from bigviz.distributed import cli, empty_model
from bigviz.models import GPT, GPTConfig

TIMEOUT_S = 300
IDS = [7, 3, 11, 2, 9]


def _hf_llama_folder(folder: Path) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(1)
    model = LlamaForCausalLM(
        LlamaConfig(
            hidden_size=64,
            intermediate_size=172,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=256,
            max_position_embeddings=128,
        )
    )
    model.save_pretrained(folder, max_shard_size="40KB")
    return folder


def _gpt_folder(folder: Path) -> Path:
    torch.manual_seed(2)
    model = GPT(GPTConfig.preset("gpt-tiny", n_layer=4))
    return bigviz.save_sharded(model, folder, max_shard_size="40KB", config=model.config, progress=False)


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("pipeline")
    return {"gpt": _gpt_folder(root / "gpt"), "hf-llama": _hf_llama_folder(root / "llama")}


def _torchrun(cwd: Path, *args: str, nproc: int = 2) -> str:
    """Run the entry point under torchrun with ``nproc`` processes; its output, or a failure."""
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(nproc),
        "-m",
        "bigviz.distributed",
        *args,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.Popen(
        command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        out, _ = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # torchrun and both workers
        out, _ = proc.communicate()
        pytest.fail(f"torchrun did not finish in {TIMEOUT_S} s:\n{out[-4000:]}")
    assert proc.returncode == 0, f"torchrun failed ({proc.returncode}):\n{out[-4000:]}"
    return out


def _single_process_logits(folder: Path) -> torch.Tensor:
    """The whole model's last-position logits, on one thread as torchrun's workers run
    (OMP_NUM_THREADS=1): a matmul's sums may be ordered differently on two threads."""
    model = empty_model(folder)
    bigviz.load_checkpoint_in_model(model, folder, progress=False)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.no_grad():
            out = model(torch.tensor([IDS]))
    finally:
        torch.set_num_threads(threads)
    return (out[0] if isinstance(out, tuple) else out.logits)[0, -1]  # (vocab,)


def _expected_loads(folder: Path, report: dict, rank: int) -> set[str]:
    plan = bigviz.PipelinePlan.from_dict(report["plan"])
    keys = set(bigviz.CheckpointIndex.open(folder).keys())
    return {t for t in plan.tensors_of(rank, bigviz.module_tree(empty_model(folder))) if t in keys}


@pytest.mark.slow
@pytest.mark.parametrize(
    "name, extra, method",
    [
        ("gpt", [], "trace"),  # torch's tracer splits bigviz's GPT
        ("hf-llama", ["--schedule", "1f1b"], "wrap"),  # it cannot capture transformers' Llama: the adapter runs it
    ],
)
def test_two_processes_give_single_process_logits(folders, tmp_path, name, extra, method):
    folder = folders[name]
    out = _torchrun(
        tmp_path,
        str(folder),
        "--stages",
        "2",
        "--input-ids",
        ",".join(map(str, IDS)),
        "--microbatches",
        "2",
        "--out",
        "logits.pt",
        "--report",
        "report.json",
        *extra,
    )
    logits = torch.load(tmp_path / "logits.pt")
    want = _single_process_logits(folder)
    assert logits.shape == (2, want.shape[0])
    assert torch.equal(logits[0], want) and torch.equal(logits[1], want)  # both micro-batches, exactly
    report = json.loads((tmp_path / "report.json").read_text())
    ranks = report["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1] and all(r["method"] == method for r in ranks)
    loads = [set(r["loaded"]) for r in ranks]
    for rank in (0, 1):
        assert loads[rank] == _expected_loads(folder, report, rank)
    assert loads[0] | loads[1] == set(bigviz.CheckpointIndex.open(folder).keys())
    tied = {s["leader"] for s in report["plan"]["shared"]}
    assert loads[0] & loads[1] == tied
    assert tied == ({"transformer.wte.weight"} if name == "gpt" else set())
    assert "wrote logits.pt" in out and "cut before" in out


@pytest.mark.gpu
@pytest.mark.slow
def test_nccl_stages_on_gpus(folders, tmp_path):
    """One stage per GPU with NCCL (two stages with two GPUs, one with one GPU)."""
    n = min(torch.cuda.device_count(), 2)
    folder = folders["hf-llama"]
    out = _torchrun(
        tmp_path,
        str(folder),
        "--stages",
        str(n),
        "--input-ids",
        ",".join(map(str, IDS)),
        "--microbatches",
        "2",
        "--out",
        "logits.pt",
        "--report",
        "report.json",
        nproc=n,
    )
    report = json.loads((tmp_path / "report.json").read_text())
    assert [r["device"] for r in report["ranks"]] == [f"cuda:{i}" for i in range(n)], out
    logits = torch.load(tmp_path / "logits.pt")
    want = _single_process_logits(folder)
    torch.testing.assert_close(logits[0], want, rtol=1e-4, atol=1e-5)  # GPU kernels sum in their own order
    assert torch.equal(logits[0], logits[1])


# ---- refused before anything loads (the command line, in this process) -----------------
@pytest.fixture
def no_loading(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail the test if the command line gets as far as joining a group or loading."""

    def forbidden(*args: object, **kwargs: object) -> None:
        raise AssertionError("the request was not refused before running")

    monkeypatch.setattr(cli, "_run", forbidden)
    monkeypatch.setattr("bigviz.distributed.stage.execute_load_plan", forbidden)


def _refused(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    assert cli.main(argv) == 2
    return capsys.readouterr().err


@pytest.mark.parametrize(
    "stages, world, message",
    [
        ("0", "2", "stages=0: give 1 or more stages"),
        ("5", "2", "5 stages but only 4 no-split units to cut between"),
        ("3", "2", "2 processes for a 3-stage plan: launch one per stage (torchrun --nproc-per-node 3)"),
        ("2", None, "not launched by torchrun (no WORLD_SIZE)"),
    ],
)
def test_bad_requests_are_refused_before_loading(
    folders, tmp_path, monkeypatch, capsys, no_loading, stages, world, message
):
    if world is None:
        monkeypatch.delenv("WORLD_SIZE", raising=False)
    else:
        monkeypatch.setenv("WORLD_SIZE", world)
    err = _refused(
        capsys, [str(folders["gpt"]), "--stages", stages, "--input-ids", "1,2,3", "--out", str(tmp_path / "logits.pt")]
    )
    assert message in err, err
    assert not (tmp_path / "logits.pt").exists()


def test_budget_too_small_says_by_how_much(folders, tmp_path, monkeypatch, capsys, no_loading):
    monkeypatch.setenv("WORLD_SIZE", "2")
    err = _refused(
        capsys, [str(folders["gpt"]), "--stages", "150KB,50KB", "--input-ids", "1", "--out", str(tmp_path / "x.pt")]
    )
    assert "cannot cut GPT (222.8 KiB) into 2 stages within the budgets" in err
    assert "stage 1 (transformer.h.3 .. lm_head) needs 65.9 KiB with a budget of 48.8 KiB: 17.0 KiB over" in err


def test_ids_outputs_and_plans_are_checked(folders, tmp_path, monkeypatch, capsys, no_loading):
    monkeypatch.setenv("WORLD_SIZE", "2")
    gpt = str(folders["gpt"])
    err = _refused(capsys, [gpt, "--stages", "2", "--input-ids", "1,128,500", "--out", str(tmp_path / "x.pt")])
    assert "--input-ids [128, 500] are outside the vocabulary (0 .. 127)" in err
    taken = tmp_path / "taken.pt"
    taken.write_text("not ours")
    err = _refused(capsys, [gpt, "--stages", "2", "--input-ids", "1", "--out", str(taken), "--microbatches", "0"])
    assert "exists: bigviz does not overwrite it unless you pass --overwrite" in err and "--microbatches 0" in err
    assert taken.read_text() == "not ours"
    with torch.device("meta"):
        other = GPT(GPTConfig.preset("gpt-tiny", n_layer=6))
    bigviz.plan_pipeline(other, 2).save_json(tmp_path / "plan.json")
    err = _refused(
        capsys, [gpt, "--plan", str(tmp_path / "plan.json"), "--input-ids", "1", "--out", str(tmp_path / "x.pt")]
    )
    assert "stage 1: the plan has blocks transformer.h.3 .. transformer.h.5 (3), this model transformer.h.3" in err
    assert "the plan names 2 module(s) this model lacks: transformer.h.4, transformer.h.5" in err
    err = _refused(capsys, [str(tmp_path), "--stages", "2", "--input-ids", "1", "--out", str(tmp_path / "x.pt")])
    assert "config.json does not exist" in err
