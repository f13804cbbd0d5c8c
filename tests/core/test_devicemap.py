"""Device-map checks, cleaning and JSON round trips (pure: no torch needed)."""

from __future__ import annotations

import json

import pytest

from bigviz.core.devicemap import clean_device_map, device_of, validate_device_map
from bigviz.core.names import ancestors, is_prefix, owner
from bigviz.core.serialize import load_device_map, load_max_memory, save_device_map, save_max_memory
from bigviz.core.tree import SizeTree, TensorSpec


def _seed_tree() -> SizeTree:
    # The seed's example: block1 and block2, each with linear1..3 (weight + bias).
    return SizeTree.build(
        [
            TensorSpec(f"block{b}.linear{l}.{p}", 4, "float32")
            for b in (1, 2)
            for l in (1, 2, 3)
            for p in ("weight", "bias")
        ]
    )


def test_prefix_rules_respect_dot_boundaries():
    assert is_prefix("h.1", "h.1.attn") and not is_prefix("h.1", "h.10.attn")
    assert owner("h.10.w", {"h.1": 0, "h.10": 1}) == "h.10"
    assert owner("x", {"h": 0}) is None
    assert list(ancestors("a.b")) == ["a.b", "a", ""]


def test_seed_valid_maps_pass():
    tree = _seed_tree()
    assert validate_device_map(tree, {"block1": 0, "block2": 1}) == {"block1": 0, "block2": 1}
    validate_device_map(tree, {"block1": 0, "block2.linear1": 0, "block2.linear2": 1, "block2.linear3": 1})


def test_seed_invalid_map_names_the_uncovered_module():
    with pytest.raises(ValueError) as err:
        validate_device_map(_seed_tree(), {"block1": 0, "block2.linear1": 1, "block2.linear2": 1})
    assert "block2.linear3" in str(err.value)
    assert "block2.linear3.weight" not in str(err.value)  # the module is named, not each tensor


def test_every_problem_is_reported_at_once():
    bad = {"block1": "gpu", "block2.linear1": 1, "block2.linaer2": 1, "nothing": "cpu"}
    with pytest.raises(ValueError) as err:
        validate_device_map(_seed_tree(), bad, devices=[0, "cpu"])
    text = str(err.value)
    assert "'gpu'" in text  # unknown device
    assert "'block2.linaer2'" in text and "did you mean 'block2.linear2'" in text
    assert "'nothing'" in text
    assert "GPU 1" in text and "does not have" in text  # device the machine lacks
    assert "block2.linear2" in text and "block2.linear3" in text  # not covered


def test_partially_covered_module_lists_tensors():
    with pytest.raises(ValueError) as err:
        validate_device_map(
            _seed_tree(), {"block1": 0, "block2.linear1": 0, "block2.linear2": 0, "block2.linear3.weight": 0}
        )
    assert "block2.linear3.bias" in str(err.value)


def test_device_of_longest_prefix():
    assert device_of("block2.linear3.weight", {"": "cpu", "block2": 0}) == 0
    assert device_of("block1.linear1.bias", {"": "cpu", "block2": 0}) == "cpu"


def test_clean_with_tree_collapses_only_full_coverage():
    tree = _seed_tree()
    units = {f"block{b}.linear{l}": d for b, d in ((1, 0), (2, 1)) for l in (1, 2, 3)}
    assert clean_device_map(units, tree) == {"block1": 0, "block2": 1}
    same = {k: 0 for k in units}
    assert clean_device_map(same, tree) == {"": 0}


def test_clean_without_tree_keeps_order():
    assert clean_device_map({"a.x": 0, "a.y": 0, "b": "cpu"}) == {"a": 0, "b": "cpu"}
    assert clean_device_map({"h.0": 0, "h.1": 1}) == {"h.0": 0, "h.1": 1}


def test_device_map_json_round_trip_keeps_ints(tmp_path):
    path = tmp_path / "map.json"
    save_device_map({"h.0": 0, "h.1": "cuda:1", "lm_head": "cpu", "x": "disk"}, path)
    assert json.loads(path.read_text())["h.0"] == 0  # a JSON number, as transformers expects
    assert load_device_map(path) == {"h.0": 0, "h.1": 1, "lm_head": "cpu", "x": "disk"}


def test_load_device_map_reports_bad_entries(tmp_path):
    path = tmp_path / "map.json"
    path.write_text(json.dumps({"a": "gpu0", "b": 1}))
    with pytest.raises(ValueError, match="'a'.*gpu0"):
        load_device_map(path)
    path.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_device_map(path)


def test_max_memory_json_round_trip_restores_int_keys(tmp_path):
    path = tmp_path / "mm.json"
    save_max_memory({0: "10GiB", 1: 123, "cpu": "30GB"}, path)
    assert json.loads(path.read_text()) == {"0": "10GiB", "1": 123, "cpu": "30GB"}
    assert load_max_memory(path) == {0: "10GiB", 1: 123, "cpu": "30GB"}


def test_save_max_memory_refuses_bad_values(tmp_path):
    with pytest.raises(ValueError):
        save_max_memory({0: "ten"}, tmp_path / "mm.json")
    assert not (tmp_path / "mm.json").exists()
