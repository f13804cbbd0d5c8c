"""The pipeline planner, pure: units and roles, exact balancing (checked against brute force),
budgets, ties, compute balance, errors, JSON. Size trees are made from tensor specs: no torch
model, no files (except the JSON round trip)."""

from __future__ import annotations

import itertools
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bigviz.core import stages as stages_module
from bigviz.core.pipeline import PipelineError, PipelinePlan
from bigviz.core.stages import cut_pipeline, make_pipeline_plan, pipeline_units, unit_flops
from bigviz.core.tree import SizeTree, TensorSpec
from bigviz.core.sizes import format_size


def lm(n_blocks: int, *, block: int = 100, emb: int = 300, head: int | None = None, tied: bool = True) -> SizeTree:
    """A decoder LM's tree: embeddings, ``n_blocks`` blocks of ``block`` floats (a 10-row
    matrix), a final norm, a head (tied to the embeddings, or its own ``head`` floats)."""
    specs = [
        TensorSpec("model.embed.weight", emb, "float32", (emb // 10, 10)),
        TensorSpec("model.pos.weight", 20, "float32", (2, 10)),
    ]
    modules = {
        "": "LM",
        "model": "Base",
        "model.embed": "Embedding",
        "model.pos": "Embedding",
        "model.layers": "ModuleList",
    }
    for i in range(n_blocks):
        specs.append(TensorSpec(f"model.layers.{i}.fc.weight", block, "float32", (10, block // 10)))
        modules[f"model.layers.{i}"] = "Layer"
        modules[f"model.layers.{i}.fc"] = "Linear"
    specs.append(TensorSpec("model.norm.weight", 10, "float32", (10,)))
    specs.append(TensorSpec("lm_head.weight", emb if tied else head or emb, "float32", (emb // 10, 10)))
    modules.update({"model.norm": "Norm", "lm_head": "Linear"})
    ties = [("model.embed.weight", "lm_head.weight")] if tied else []
    return SizeTree.build(specs, modules, ties)


def chain_tree(weights: list[int]) -> SizeTree:
    """Blocks of the given element counts and nothing else."""
    return SizeTree.build([TensorSpec(f"h.{i}.w", w, "float32", (w, 1)) for i, w in enumerate(weights)])


# ---- units, roles and cuts ------------------------------------------------------------
def test_units_follow_definition_order_with_roles():
    tree = lm(3)
    units = pipeline_units(tree, ["Layer"])
    assert units == [
        ("model.embed", "first"),
        ("model.pos", "first"),
        ("model.layers.0", "block"),
        ("model.layers.1", "block"),
        ("model.layers.2", "block"),
        ("model.norm", "last"),
        ("lm_head", "last"),
    ]
    # without no-split classes every leaf is a unit and a possible cut
    assert all(role == "block" for _, role in pipeline_units(tree, []))


def test_a_module_between_blocks_stays_with_the_block_before_it():
    names = ["enc.0.w", "enc.1.w", "mid_norm.w", "dec.0.w", "dec.1.w"]
    tree = SizeTree.build([TensorSpec(n, 10, "float32", (10,)) for n in names])
    units = pipeline_units(tree, ["enc.*", "dec.*"])
    assert ("mid_norm", "between") in units
    for k in (2, 3, 4):
        plan = make_pipeline_plan(tree, k, no_split=["enc.*", "dec.*"])
        assert plan.stage_of("mid_norm") == plan.stage_of("enc.1") and "mid_norm" not in plan.split_points


def test_cuts_fall_only_before_blocks_and_every_stage_has_one():
    tree = lm(7)
    for k in range(1, 8):
        plan = make_pipeline_plan(tree, k, no_split=["Layer"])
        assert plan.n_stages == k and len(plan.split_points) == k - 1
        assert all(p.startswith("model.layers.") and tree.nodes[p].class_name == "Layer" for p in plan.split_points)
        assert all(plan.blocks(s) for s in range(k))
        assert plan.stages[0][:2] == ("model.embed", "model.pos") and plan.stages[-1][-2:] == ("model.norm", "lm_head")
        flat = [n for stage in plan.stages for n in stage]
        assert flat == [u for u, _ in pipeline_units(tree, ["Layer"])]  # contiguous, in order


def test_glob_no_split_patterns_from_checkpoint_trees():
    plan = make_pipeline_plan(lm(4), 2, no_split=["model.layers.*"])
    assert plan.split_points == ("model.layers.2",)


# ---- balance: exact against brute force ------------------------------------------------
def _brute(metric: list[int], nbytes: list[int], k: int, budgets: list[int] | None, proportional: bool) -> float:
    best = float("inf")
    for cuts in itertools.combinations(range(1, len(metric)), k - 1):
        b = [0, *cuts, len(metric)]
        spans = [(sum(metric[b[i] : b[i + 1]]), sum(nbytes[b[i] : b[i + 1]])) for i in range(k)]
        if budgets and any(nb > cap for (_, nb), cap in zip(spans, budgets)):
            continue
        if proportional:
            best = min(best, max(m / cap for (m, _), cap in zip(spans, budgets)))  # type: ignore[arg-type]
        else:
            best = min(best, max(m for m, _ in spans))
    return best


@settings(max_examples=150, deadline=None)
@given(st.lists(st.sampled_from([0, 1, 2, 3, 5, 8, 20, 50]), min_size=1, max_size=8), st.data())
def test_bytes_balance_is_the_smallest_bottleneck(weights, data):
    k = data.draw(st.integers(1, len(weights)))
    tree = chain_tree(weights)
    plan = make_pipeline_plan(tree, k, no_split=["h.*"])
    got = max(plan.stage_bytes)
    assert got == _brute([4 * w for w in weights], [4 * w for w in weights], k, None, False)
    assert sum(plan.stage_bytes) == tree.total("")


@settings(max_examples=150, deadline=None)
@given(st.lists(st.sampled_from([1, 2, 3, 5, 8, 20]), min_size=1, max_size=7), st.data())
def test_budgets_are_never_exceeded_and_fill_is_balanced(weights, data):
    k = data.draw(st.integers(1, len(weights)))
    budgets = data.draw(st.lists(st.sampled_from([8, 20, 40, 80, 200]), min_size=k, max_size=k))
    tree = chain_tree(weights)
    nbytes = [4 * w for w in weights]
    best = _brute(nbytes, nbytes, k, budgets, True)
    if best == float("inf"):
        with pytest.raises(PipelineError, match="within the budgets"):
            make_pipeline_plan(tree, budgets, no_split=["h.*"])
        return
    plan = make_pipeline_plan(tree, budgets, no_split=["h.*"])
    assert all(b <= cap for b, cap in zip(plan.stage_bytes, budgets))
    fill = max(b / cap for b, cap in zip(plan.stage_bytes, budgets))
    assert fill <= best + 1 / max(budgets)  # caps are whole bytes: within one byte of the optimum


@settings(max_examples=100, deadline=None)
@given(
    st.lists(st.tuples(st.sampled_from([1, 2, 5, 9]), st.sampled_from([1, 3, 8])), min_size=1, max_size=7), st.data()
)
def test_compute_balance_minimises_flops_within_byte_budgets(blocks, data):
    k = data.draw(st.integers(1, len(blocks)))
    budgets = data.draw(st.one_of(st.none(), st.lists(st.sampled_from([40, 100, 400]), min_size=k, max_size=k)))
    # rows x cols matrices: flops = 2 * rows * cols, bytes = 4 * rows * cols + a 4-byte-per-row vector
    specs = []
    for i, (rows, cols) in enumerate(blocks):
        specs += [
            TensorSpec(f"h.{i}.w", rows * cols, "float32", (rows, cols)),
            TensorSpec(f"h.{i}.v", rows, "float32", (rows,)),
        ]
    tree = SizeTree.build(specs)
    flops = [2 * r * c for r, c in blocks]
    nbytes = [4 * r * c + 4 * r for r, c in blocks]
    best = _brute(flops, nbytes, k, budgets, False)
    if best == float("inf"):
        with pytest.raises(PipelineError):
            make_pipeline_plan(tree, budgets, no_split=["h.*"], balance="compute")  # type: ignore[arg-type]
        return
    plan = make_pipeline_plan(tree, budgets or k, no_split=["h.*"], balance="compute")
    assert max(plan.stage_flops) == best
    assert budgets is None or all(b <= cap for b, cap in zip(plan.stage_bytes, budgets))


def test_among_optimal_cuts_the_stages_are_even():
    plan = make_pipeline_plan(chain_tree([10] * 7), 3, no_split=["h.*"])
    assert sorted(plan.stage_bytes) == [80, 80, 120]  # 3+2+2 blocks of 40 bytes, not 3+3+1


def test_work_grows_with_log_of_size_not_with_blocks(monkeypatch):
    """Count feasibility checks and per-stage steps: a binary search over the bottleneck with
    bisect inside, so 80x more blocks cost a few more checks, not 80x the work."""
    from bigviz.core import partition

    counts = {"checks": 0, "far": 0}
    reachable, far = partition.reachable, partition.Chain.far

    def counted_reachable(*args):
        counts["checks"] += 1
        return reachable(*args)

    def counted_far(self, *args):
        counts["far"] += 1
        return far(self, *args)

    monkeypatch.setattr(partition, "reachable", counted_reachable)  # the search's own calls
    monkeypatch.setattr(stages_module, "reachable", counted_reachable)  # and the cut's
    monkeypatch.setattr(partition.Chain, "far", counted_far)
    work = {}
    for n in (100, 8000):
        counts.update(checks=0, far=0)
        make_pipeline_plan(chain_tree([1000 + i % 7 for i in range(n)]), 8, no_split=["h.*"])
        work[n] = dict(counts)
    assert work[8000]["checks"] <= work[100]["checks"] + 8  # log2(80) more at most, plus slack
    assert work[8000]["far"] <= 8 * work[8000]["checks"] + 8  # one bisect per stage per check
    assert work[8000]["checks"] <= 64


# ---- budgets, ties, compute ------------------------------------------------------------
def test_budgets_proportional_fill():
    plan = make_pipeline_plan(chain_tree([10] * 9), [4000, 2000], no_split=["h.*"])
    assert plan.stage_bytes == (240, 120) and plan.budgets == (4000, 2000)


def test_budget_too_small_says_which_stage_and_by_how_much():
    tree = lm(4, block=100, emb=300)  # 1200 + 80 + 4 x 400 + 40 bytes
    total = tree.total("")
    with pytest.raises(PipelineError) as info:
        make_pipeline_plan(tree, [1500, 1000], no_split=["Layer"])
    text = str(info.value)
    over = [p for p in info.value.problems if p.startswith("stage ")]
    assert over, text
    for line in over:  # "stage 1 (a .. b) needs X with a budget of Y: Z over"
        assert "needs" in line and "over" in line
    assert (
        f"the stages' weights ({format_size(total + 1200)}, tied tensors counted in each stage that loads "
        f"them) exceed the 2 budgets together ({format_size(2500)})"
    ) in text
    assert text.endswith("or plan for a smaller dtype (dtype=torch.float16 halves float32 bytes)")
    with pytest.raises(PipelineError) as info:
        make_pipeline_plan(tree.with_dtype("float16"), [600, 500], no_split=["Layer"])
    assert str(info.value).endswith("Fix: give the stages more memory or use more stages")
    with pytest.raises(
        PipelineError, match=r"stage 1 \(model.layers.1\) needs 400 B with a budget of 300 B: 100 B over"
    ):
        make_pipeline_plan(lm(3), [10**6, 300, 10**6], no_split=["Layer"])
    with pytest.raises(PipelineError, match=r"h.1 alone needs 800 B, more than the largest budget \(700 B\)"):
        make_pipeline_plan(chain_tree([10, 200, 10]), [700, 500, 700], no_split=["h.*"])


@pytest.mark.parametrize(
    "stages, message",
    [
        (0, "stages=0: give 1 or more stages"),
        (-2, "stages=-2"),
        (True, "stages=True"),
        ("2", "stages='2'"),
        ([], "at least one per-stage budget"),
        (["1GB", "2Gb"], "budget of stage 1"),
        (5, "5 stages but only 4 no-split units to cut between (model.layers.0, model.layers.1"),
    ],
)
def test_bad_stage_counts(stages, message):
    with pytest.raises(PipelineError) as info:
        make_pipeline_plan(lm(4), stages, no_split=["Layer"])
    assert message in str(info.value)


def test_every_problem_is_reported_at_once():
    with pytest.raises(PipelineError) as info:
        make_pipeline_plan(lm(2), 3, no_split=["Layer"], balance="speed")
    assert len(info.value.problems) == 2


def test_tied_head_is_loaded_by_the_last_stage_and_said_so():
    tree = lm(4, emb=300)
    plan = make_pipeline_plan(tree, 2, no_split=["Layer"])
    (shared,) = plan.shared
    assert (shared.name, shared.leader, shared.stages, shared.nbytes) == (
        "lm_head.weight",
        "model.embed.weight",
        (0, 1),
        1200,
    )
    assert plan.stage_bytes[1] == sum(tree.total(n) for n in plan.stages[1]) + 1200
    assert "model.embed.weight" in plan.tensors_of(1, tree) and "lm_head.weight" in plan.tensors_of(1, tree)
    assert "lm_head.weight is tied to model.embed.weight (stage 0): stage 1 loads that tensor too" in plan.notes[0]
    one = make_pipeline_plan(tree, 1, no_split=["Layer"])
    assert one.shared == () and one.stage_bytes == (tree.total(""),)


def test_compute_counts_the_tied_head_and_not_the_lookups():
    tree = lm(6, block=100, emb=4000)
    assert unit_flops(tree, "model.embed") == 0 and unit_flops(tree, "lm_head") == 2 * 4000
    assert unit_flops(tree, "model.layers.0") == 200 and unit_flops(tree, "model.norm") == 0
    by_bytes = make_pipeline_plan(tree, 2, no_split=["Layer"])
    by_compute = make_pipeline_plan(tree, 2, no_split=["Layer"], balance="compute")
    # bytes: both ends hold the embedding matrix (the last stage for its tied head), so the
    # blocks split evenly; compute: the head's matmul is heavy and lookups are free, so the
    # last stage keeps one block
    assert (len(by_bytes.blocks(0)), len(by_bytes.blocks(1))) == (3, 3)
    assert (len(by_compute.blocks(0)), len(by_compute.blocks(1))) == (5, 1)
    assert by_compute.stage_flops == (1000, 8200) and "GFLOP/token" in by_compute.cuts[0].reason


# ---- reading, JSON, re-deriving --------------------------------------------------------
def test_reasons_summary_and_frame():
    plan = make_pipeline_plan(lm(6), 3, no_split=["Layer"])
    cut = plan.cuts[0]
    assert cut.before == plan.split_points[0] and "one block later stage 0 would be" in cut.reason
    assert next(u for u in plan.units if u.name == cut.before).reason == cut.reason
    assert plan.stage_of(f"{cut.before}.fc.weight") == 1 and plan.stage_of("lm_head") == 2
    text = plan.summary()
    assert text.splitlines()[0] == f"PipelinePlan: 3 stages of LM ({format_size(3720)}), balanced by bytes"
    assert all(f"stage {i}:" in text for i in range(3))
    frame = plan.to_frame()
    assert list(frame["module"]) == [u.name for u in plan.units]
    assert frame.groupby("stage")["bytes"].sum().tolist() == [
        sum(u.nbytes for u in plan.units if u.stage == s) for s in range(3)
    ]
    assert "<b>PipelinePlan</b>" in plan._repr_html_()


def test_json_round_trip_and_bad_files(tmp_path):
    tree = lm(5)
    plan = make_pipeline_plan(tree, [3000, "2KiB"], no_split=["Layer"], dtype="float16")
    path = tmp_path / "plan.json"
    plan.save_json(path)
    back = PipelinePlan.load_json(path, tree=tree)
    assert back == plan and back.tree is tree and back.split_points == plan.split_points
    data = json.loads(path.read_text())
    data["units"][0]["stage"] = 7
    del data["stages"][0]
    path.write_text(json.dumps(data))
    with pytest.raises(PipelineError) as info:
        PipelinePlan.load_json(path)
    assert "units[0] ('model.embed'): stage 7" in str(info.value) and "1 cuts for 1 stages" in str(info.value)
    path.write_text("{not json")
    with pytest.raises(PipelineError, match="not valid JSON"):
        PipelinePlan.load_json(path)
    path.write_text("[" * 100_000)  # Python's parser gives up: a PipelineError, not a RecursionError
    with pytest.raises(PipelineError, match="nested too deeply"):
        PipelinePlan.load_json(path)
    path.write_bytes(b'{"stages": "\xff"}')
    with pytest.raises(PipelineError, match="not valid JSON"):
        PipelinePlan.load_json(path)


def test_cut_pipeline_rederives_and_refuses_foreign_points():
    tree = lm(6)
    plan = make_pipeline_plan(tree, 3, no_split=["Layer"])
    again = cut_pipeline(tree, plan.split_points, no_split=["Layer"])
    assert again.stages == plan.stages and again.stage_bytes == plan.stage_bytes
    with pytest.raises(PipelineError) as info:
        cut_pipeline(lm(3), ["model.layers.4", "model.norm"], no_split=["Layer"])
    assert len(info.value.problems) == 2 and "'model.layers.4' is not a no-split block" in str(info.value)
    with pytest.raises(PipelineError, match="in execution order"):
        cut_pipeline(tree, ["model.layers.3", "model.layers.2"], no_split=["Layer"])


# ---- the run: KV cache and activations per stage -----------------------------------------
def _run_tree(blocks: list[tuple[int, int]], head_act: int) -> tuple[SizeTree, dict, dict]:
    """Blocks of (weights, KV cache) and one activation step per block (the same for every
    block, as for a model's layers) and a larger one for the last (the head's logits)."""
    tree = chain_tree([w for w, _ in blocks])
    kv = {f"h.{i}": c for i, (_, c) in enumerate(blocks)}
    act = {f"h.{i}": 6 for i in range(len(blocks))}
    act[f"h.{len(blocks) - 1}"] = head_act
    return tree, kv, act


def _brute_run(held: list[int], act: list[int], k: int, budgets: list[int] | None) -> float:
    """The smallest bottleneck over every cut: (weights + KV cache + largest step) per stage,
    divided by its budget when budgets are given."""
    best = float("inf")
    for cuts in itertools.combinations(range(1, len(held)), k - 1):
        b = [0, *cuts, len(held)]
        totals = [sum(held[b[i] : b[i + 1]]) + max(act[b[i] : b[i + 1]]) for i in range(k)]
        if budgets and any(t > cap for t, cap in zip(totals, budgets)):
            continue
        best = min(best, max(t / cap for t, cap in zip(totals, budgets)) if budgets else max(totals))
    return best


@settings(max_examples=150, deadline=None)
@given(
    st.lists(st.tuples(st.sampled_from([1, 2, 5, 10]), st.sampled_from([0, 4, 16])), min_size=1, max_size=7),
    st.sampled_from([6, 30, 100]),
    st.data(),
)
def test_run_balance_is_the_smallest_bottleneck_of_weights_kv_and_activations(blocks, head_act, data):
    k = data.draw(st.integers(1, len(blocks)))
    budgets = data.draw(st.one_of(st.none(), st.lists(st.sampled_from([30, 60, 120, 400]), min_size=k, max_size=k)))
    tree, kv, act = _run_tree(blocks, head_act)
    held = [4 * w + c for w, c in blocks]
    acts = [act[f"h.{i}"] for i in range(len(blocks))]
    best = _brute_run(held, acts, k, budgets)
    if best == float("inf"):
        with pytest.raises(PipelineError, match="within the budgets"):
            make_pipeline_plan(tree, budgets, no_split=["h.*"], kv_cache=kv, activations=act)  # type: ignore[arg-type]
        return
    plan = make_pipeline_plan(tree, budgets or k, no_split=["h.*"], kv_cache=kv, activations=act)
    assert sum(plan.stage_kv) == sum(kv.values())
    assert plan.stage_totals == tuple(
        b + c + a for b, c, a in zip(plan.stage_bytes, plan.stage_kv, plan.stage_activations)
    )
    if budgets:
        assert all(t <= cap for t, cap in zip(plan.stage_totals, budgets))
        assert max(t / cap for t, cap in zip(plan.stage_totals, budgets)) <= best + 1 / max(budgets)
    else:
        assert max(plan.stage_totals) == best


def test_the_run_moves_the_cuts_and_each_stage_counts_its_layers():
    """A long context makes the layers' caches outweigh the embeddings: without the run the
    first stage (embeddings) gets fewer blocks; with it, the blocks spread evenly."""
    tree = lm(8, block=100, emb=4000, tied=False, head=10)  # a large embedding matrix, a tiny head
    kv = {f"model.layers.{i}": 8000 for i in range(8)}
    act = {f"model.layers.{i}": 300 for i in range(8)} | {"lm_head": 900}
    weights_only = make_pipeline_plan(tree, 2, no_split=["Layer"])
    with_run = make_pipeline_plan(tree, 2, no_split=["Layer"], kv_cache=kv, activations=act)
    assert len(weights_only.blocks(0)) < len(with_run.blocks(0))
    assert with_run.stage_kv == tuple(8000 * len(with_run.blocks(s)) for s in range(2))
    assert with_run.stage_activations == (300, 900)  # the head's logits in the last stage
    assert "balanced by weights + KV cache + activations" in with_run.cuts[0].reason
    frame = with_run.stage_frame()
    assert frame["kv_cache"].tolist() == list(with_run.stage_kv) and frame["total"].tolist() == list(
        with_run.stage_totals
    )
    text = with_run.summary()
    assert "weights +" in text and "KV cache +" in text and "activations =" in text
    assert "<th>KV cache</th>" in with_run._repr_html_()


def test_a_run_that_does_not_fit_says_so_per_stage():
    tree = lm(4, block=100, emb=300)
    kv = {f"model.layers.{i}": 500 for i in range(4)}
    act = {f"model.layers.{i}": 100 for i in range(4)} | {"lm_head": 200}
    make_pipeline_plan(tree, [2400, 2400], no_split=["Layer"])  # the weights alone fit
    with pytest.raises(PipelineError) as info:
        make_pipeline_plan(tree, [2400, 2400], no_split=["Layer"], kv_cache=kv, activations=act)
    over = [p for p in info.value.problems if p.startswith("stage ")]
    assert over and all("weights +" in p and "KV cache +" in p and "activations =" in p for p in over), info.value
    assert "and KV cache (2.0 KiB) exceed the 2 budgets" in str(info.value)


def test_a_kv_cache_on_a_split_layer_goes_with_its_first_part():
    """No-split classes finer than a layer: the layer's cache is charged once, to its first
    part; its step to every part."""
    specs = [TensorSpec(f"layers.{i}.{p}.w", 10, "float32", (10,)) for i in range(2) for p in ("attn", "mlp")]
    tree = SizeTree.build(specs)
    kv = {"layers.0": 100, "layers.1": 100}
    act = {"layers.0": 7, "layers.1": 7}
    plan = make_pipeline_plan(tree, 4, no_split=["layers.*.*"], kv_cache=kv, activations=act)
    assert plan.stage_kv == (100, 0, 100, 0) and plan.stage_activations == (7, 7, 7, 7)
    with pytest.raises(PipelineError, match="'nope' is no module"):
        make_pipeline_plan(tree, 2, no_split=["layers.*.*"], kv_cache={"nope": 1}, activations={})


def test_run_json_round_trip_and_bubble(tmp_path):
    from bigviz.core.pipeline import PipelineRun, pipeline_bubble

    tree = lm(4)
    run = PipelineRun(batch_size=4, context_length=64, kv_dtype="fp16", microbatches=2)
    kv = {f"model.layers.{i}": 64 for i in range(4)}
    plan = make_pipeline_plan(tree, 2, no_split=["Layer"], kv_cache=kv, activations={"lm_head": 8}, run=run)
    assert plan.run.kv_dtype == "float16" and plan.run.microbatch_size == 2
    plan.save_json(tmp_path / "p.json")
    back = PipelinePlan.load_json(tmp_path / "p.json", tree=tree)
    assert back == plan and back.stage_kv == (128, 128) and back.stage_activations == (0, 8)
    assert plan.bubble() == pipeline_bubble(2, 2) == 1 / 3
    assert pipeline_bubble(3, 6, passes=10) == pytest.approx(1 - 60 / 62)
    with pytest.raises(PipelineError, match="every micro-batch holds at least one sequence"):
        PipelineRun(batch_size=2, microbatches=4)
    data = json.loads((tmp_path / "p.json").read_text())
    data["run"] = {"batch_size": 0, "color": 1}
    (tmp_path / "p.json").write_text(json.dumps(data))
    with pytest.raises(PipelineError, match="'run' must be an object"):
        PipelinePlan.load_json(tmp_path / "p.json")
