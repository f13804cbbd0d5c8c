"""``torchrun ... -m bigviz.distributed``: two processes on the CPU with gloo, each loading
only its stage: pipelined greedy generation equal to single-process ``generate`` token for
token (bigviz's GPT and Llama; transformers' Llama, Qwen2 with a tied head, Mixtral, GPT-2),
each rank's KV cache equal to the stage plan's prediction, pipelined logits equal to one
process's; and bad requests refused before any process loads anything, by rank 0, with every
rank exiting.

The torchrun runs are slow (two Python processes importing torch on a 2-core machine): each
has a generous timeout and its whole process group is killed if it overruns. Models are tiny
and few tokens are generated, to keep CI short.
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
from tests.distributed.pipeline_models import build, save, single_process_generate

TIMEOUT_S = 300
IDS = [7, 3, 11, 2, 9]


GENERATED = ("gpt", "llama", "hf-llama", "hf-qwen2", "hf-mixtral", "hf-gpt2")
PROMPT = [5, 3, 17, 2, 9]
NEW = 4


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("pipeline")
    return {name: save(build(name, seed=2), root / name) for name in ("gpt", "hf-llama")}


@pytest.fixture(scope="module")
def generated(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, torch.Tensor]]:
    """Each model's checkpoint, and its own greedy tokens for PROMPT (twice: two micro-batches)."""
    root = tmp_path_factory.mktemp("generate")
    out = {}
    for name in GENERATED:
        model = build(name, seed=3)
        out[name] = (save(model, root / name), single_process_generate(model, torch.tensor([PROMPT] * 2), NEW))
    return out


def _generate_args(folder: Path, stages: int, *extra: str) -> list[str]:
    """The command line's arguments to generate NEW tokens from PROMPT, two micro-batches."""
    prompt = ",".join(map(str, PROMPT))
    return [str(folder), "--stages", str(stages), "--prompt-ids", prompt, "--max-new-tokens", str(NEW), *extra]


def _torchrun(cwd: Path, *args: str, nproc: int = 2, script: str | None = None, code: int = 0) -> str:
    """Run the entry point (or ``script``) under torchrun with ``nproc`` processes; its
    output, or a failure when it does not exit with ``code``."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)]
    command += [script] if script is not None else ["-m", "bigviz.distributed"]
    command += list(args)
    root = str(Path(__file__).resolve().parents[2])  # the workers import this checkout (and tests.*)
    path = os.pathsep.join([root, *filter(None, [os.environ.get("PYTHONPATH")])])
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONWARNINGS": "ignore", "PYTHONPATH": path}
    proc = subprocess.Popen(
        command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        out, _ = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # torchrun and both workers
        out, _ = proc.communicate()
        pytest.fail(f"torchrun did not finish in {TIMEOUT_S} s:\n{out[-4000:]}")
    assert (proc.returncode == 0) == (code == 0), f"torchrun exited with {proc.returncode}:\n{out[-4000:]}"
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


@pytest.mark.slow
def test_two_processes_generate_the_models_own_tokens(generated, tmp_path):
    """One torchrun for every model (bigviz's Python API in tests/distributed/pipeline_worker.py): two
    micro-batches in flight, each rank with the KV cache of its own layers."""
    worker = str(Path(__file__).with_name("pipeline_worker.py"))
    folders = [str(generated[name][0]) for name in GENERATED]
    _torchrun(tmp_path, str(tmp_path / "out.pt"), str(NEW), "2", ",".join(map(str, PROMPT)), *folders, script=worker)
    results = torch.load(tmp_path / "out.pt", weights_only=False)
    for name in GENERATED:
        folder, want = generated[name]
        got = results[str(folder)]
        assert torch.equal(got["tokens"], want), f"{name}: {got['tokens'].tolist()} != {want.tolist()}"
        for rank, r in enumerate(got["ranks"]):
            assert r["cache_bytes"] == r["planned_kv"] > 0, f"{name} rank {rank}: {r}"
            assert not r["strays"], f"{name} rank {rank} materialised other stages' tensors: {r['strays']}"


@pytest.mark.slow
def test_two_processes_generate_a_left_padded_batch_as_transformers_does(tmp_path):
    """Prompts of 5, 2 and 3 tokens, left padded, with their mask, in two micro-batches: the
    mask travels with each micro-batch's prefill to the next rank, which extends it per token;
    the tokens are transformers' generate with the same mask (GPT-2's learned positions too)."""
    prompts = [PROMPT, [4, 1], [7, 7, 7]]
    ids = torch.tensor([[0] * (5 - len(p)) + p for p in prompts])
    mask = (torch.arange(5) >= torch.tensor([5 - len(p) for p in prompts])[:, None]).long()
    names = ("hf-llama", "hf-gpt2")
    want, folders = {}, []
    for name in names:
        model = build(name, seed=4)
        folders.append(str(save(model, tmp_path / name)))  # no EOS: NEW tokens each
        want[folders[-1]] = single_process_generate(model, ids, NEW, mask)
    worker = str(Path(__file__).with_name("pipeline_worker.py"))
    text = ";".join(",".join(map(str, p)) for p in prompts)
    _torchrun(tmp_path, str(tmp_path / "out.pt"), str(NEW), "2", text, *folders, script=worker)
    results = torch.load(tmp_path / "out.pt", weights_only=False)
    for name, folder in zip(names, folders):
        got = results[folder]["tokens"]
        assert torch.equal(got, want[folder]), f"{name}: {got.tolist()} != {want[folder].tolist()}"


@pytest.mark.slow
def test_the_command_line_generates_prompts_of_different_lengths(tmp_path):
    """--prompt-ids repeated: the batch is those prompts, left padded with the generation
    config's pad token (none here: 0) and given their mask; tokens as transformers' generate."""
    prompts = [PROMPT, [4, 1], [7, 7, 7]]
    ids = torch.tensor([[0] * (5 - len(p)) + p for p in prompts])
    mask = (torch.arange(5) >= torch.tensor([5 - len(p) for p in prompts])[:, None]).long()
    model = build("hf-gpt2", seed=5)
    folder = save(model, tmp_path / "ckpt")
    want = single_process_generate(model, ids, NEW, mask)
    flags = [x for p in prompts for x in ("--prompt-ids", ",".join(map(str, p)))]
    argv = [str(folder), "--stages", "2", *flags, "--max-new-tokens", str(NEW), "--microbatches", "2"]
    _torchrun(tmp_path, *argv, "--out", "tokens.pt", "--report", "report.json")
    assert torch.equal(torch.load(tmp_path / "tokens.pt"), want)
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["ids"] == prompts and report["batch_size"] == 3
    assert bigviz.PipelinePlan.from_dict(report["plan"]).run.context_length == 5 + NEW - 1


@pytest.mark.slow
def test_the_command_line_generates_and_reports_each_ranks_cache(generated, tmp_path):
    folder, want = generated["hf-mixtral"]
    out = _torchrun(
        tmp_path, *_generate_args(folder, 2, "--microbatches", "2", "--out", "tokens.pt", "--report", "report.json")
    )
    assert torch.equal(torch.load(tmp_path / "tokens.pt"), want)
    report = json.loads((tmp_path / "report.json").read_text())
    plan = bigviz.PipelinePlan.from_dict(report["plan"])
    assert plan.run.batch_size == 2 and plan.run.context_length == len(PROMPT) + NEW - 1
    for r in report["ranks"]:
        assert r["method"] == "wrap" and r["cache_bytes"] == r["planned_kv_bytes"] == plan.stage_kv[r["rank"]]
        assert r["peak_anon_above_bytes"] >= 0 and 0 < r["busy_s"] <= r["wall_s"]
    assert 0 < report["predicted_bubble"] < 1
    assert "wrote tokens.pt: token ids" in out and "KV cache" in out and "run: batch 2" in out


@pytest.mark.slow
def test_a_bad_request_under_torchrun_is_said_once_and_every_rank_exits(generated, tmp_path):
    """Only rank 0 writes, so only rank 0 checks the output folder: the ranks share what they
    found after joining the group, before loading, and all exit."""
    folder, _ = generated["gpt"]
    out = _torchrun(
        tmp_path,
        *_generate_args(folder, 2, "--out", str(tmp_path / "missing" / "tokens.pt"), "--timeout", "60"),
        code=2,
    )
    assert out.count("the folder") == 1 and "does not exist: create it first" in out, out[-3000:]
    assert " tensors, " not in out and not (tmp_path / "missing").exists()  # no rank loaded its stage


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


@pytest.mark.gpu
@pytest.mark.slow
def test_nccl_generation_on_gpus(generated, tmp_path):
    """Generation with one stage per GPU and NCCL: each rank's cache as planned, and the greedy
    tokens of the single process on the CPU (GPU kernels sum in their own order; a near tie
    between two tokens would show here)."""
    n = min(torch.cuda.device_count(), 2)
    folder, want = generated["hf-llama"]
    extra = ["--microbatches", "2", "--backend", "nccl", "--out", "tokens.pt", "--report", "report.json"]
    _torchrun(tmp_path, *_generate_args(folder, n, *extra), nproc=n)
    report = json.loads((tmp_path / "report.json").read_text())
    assert [r["device"] for r in report["ranks"]] == [f"cuda:{i}" for i in range(n)]
    assert all(r["cache_bytes"] == r["planned_kv_bytes"] for r in report["ranks"])
    assert torch.equal(torch.load(tmp_path / "tokens.pt"), want)


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
    err = capsys.readouterr().err
    assert err.startswith("bigviz.distributed: cannot run the pipeline; nothing was loaded")
    return err


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
    assert "stage 1 (transformer.h.3 .. lm_head) needs 65.9 KiB weights + 0 B KV cache + " in err
    assert "with a budget of 48.8 KiB: " in err


def test_a_budget_that_holds_the_weights_but_not_the_run_is_refused(folders, tmp_path, monkeypatch, capsys, no_loading):
    """140 kB per rank holds each stage's weights (the forward fits), not the KV cache of 8
    sequences of 60 tokens."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    gpt, out = str(folders["gpt"]), str(tmp_path / "x.pt")
    forward = [gpt, "--stages", "140KB,140KB", "--input-ids", "1,2,3", "--out", out]
    err = _refused(capsys, forward)  # in this process the launch is missing, and nothing else
    assert "(1 problem)" in err and "MASTER_ADDR" in err
    run = [gpt, "--stages", "140KB,140KB", "--prompt-ids", "1,2,3", "--max-new-tokens", "58", "--batch-size", "8"]
    err = _refused(capsys, [*run, "--microbatches", "2", "--out", out])
    assert "KV cache + " in err and " over" in err and "within the budgets" in err


def test_generation_requests_are_checked(folders, tmp_path, monkeypatch, capsys, no_loading):
    monkeypatch.setenv("WORLD_SIZE", "2")
    gpt, llama, out = str(folders["gpt"]), str(folders["hf-llama"]), str(tmp_path / "t.pt")
    err = _refused(capsys, [gpt, "--stages", "2", "--prompt-ids", "1,300", "--max-new-tokens", "2", "--out", out])
    assert "--prompt-ids [300] are outside the vocabulary (0 .. 127)" in err
    err = _refused(capsys, [gpt, "--stages", "2", "--prompt-ids", "1,2,3", "--max-new-tokens", "63", "--out", out])
    assert "--prompt-ids: 3 prompt tokens + 63 new need 65 positions and GPT has 64" in err
    err = _refused(capsys, [llama, "--stages", "2", "--prompt-ids", "1,2", "--out", out, "--schedule", "1f1b"])
    assert "give --max-new-tokens N" in err and "--schedule is for --input-ids" in err
    err = _refused(capsys, [gpt, "--stages", "2", "--prompt-ids", "1", "--max-new-tokens", "1", "--out", "/nope/t.pt"])
    assert "--out /nope/t.pt: the folder '/nope' does not exist: create it first" in err
    err = _refused(capsys, [gpt, "--stages", "5", "--prompt-ids", "1", "--max-new-tokens", "1", "--out", out])
    assert "5 stages but only 4 no-split units to cut between" in err
    several = ["--prompt-ids", "1,2,3", "--prompt-ids", "4", "--max-new-tokens", "1", "--out", out]
    err = _refused(capsys, [gpt, "--stages", "2", *several, "--batch-size", "4", "--microbatches", "3"])
    assert "--batch-size 4 repeats one prompt; with 2 --prompt-ids the batch is those prompts" in err
    assert "--microbatches 3 for 2 prompts: give at least one prompt per micro-batch" in err
    err = _refused(capsys, [gpt, "--stages", "2", *several])
    assert "(bigviz's own model) takes no attention mask: give prompts of one length" in err
    err = _refused(capsys, [llama, "--stages", "2", *several[:2], "--prompt-ids", "4,300", *several[4:]])
    assert "--prompt-ids [300] are outside the vocabulary" in err


def test_1f1b_with_fewer_microbatches_than_stages_is_refused_up_front(
    folders, tmp_path, monkeypatch, capsys, no_loading
):
    monkeypatch.setenv("WORLD_SIZE", "2")
    argv = [str(folders["hf-llama"]), "--stages", "2", "--input-ids", "1,2", "--out", str(tmp_path / "x.pt")]
    err = _refused(capsys, [*argv, "--schedule", "1f1b", "--microbatches", "1"])
    assert "--schedule 1f1b needs at least as many micro-batches as stages (1 < 2)" in err
    err = _refused(capsys, [*argv, "--schedule", "1f1b", "--microbatches", "2"])
    assert "(1 problem)" in err and "MASTER_ADDR" in err  # only the launch is missing


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
