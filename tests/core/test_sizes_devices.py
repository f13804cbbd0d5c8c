"""Sizes, devices and max_memory parsing (bigviz.core.sizes, bigviz.core.devices)."""

from __future__ import annotations

import pytest

from bigviz.core.devices import device_sort_key, normalize_device
from bigviz.core.sizes import UNLIMITED, format_size, parse_max_memory, parse_size


@pytest.mark.parametrize(
    "text, expected",
    [
        ("10GiB", 10 * 2**30),
        ("10GB", 10 * 10**9),
        ("500MB", 500 * 10**6),
        ("1.5GiB", 3 * 2**29),
        ("30GIB", 30 * 2**30),
        ("2 KiB", 2048),
        ("123", 123),
        (4096, 4096),
        (1.5e3, 1500),
        ("1e3", 1000),
    ],
)
def test_parse_size_units(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("bad", ["10Gb", "5mb", "lots", "10 XB", "-3GB", -1, float("nan"), True, None])
def test_parse_size_rejects_and_quotes(bad):
    with pytest.raises(ValueError) as err:
        parse_size(bad)
    assert repr(bad) in str(err.value)


def test_bits_are_flagged_with_the_fix():
    with pytest.raises(ValueError, match="ambiguous.*10GB.*10GiB"):
        parse_size("10Gb")


@pytest.mark.parametrize(
    "device, expected", [(0, 0), ("1", 1), ("cuda", 0), ("cuda:3", 3), ("cpu", "cpu"), ("disk", "disk"), ("mps", "mps")]
)
def test_normalize_device(device, expected):
    assert normalize_device(device) == expected


def test_normalize_device_accepts_torch_device():
    torch = pytest.importorskip("torch")
    assert normalize_device(torch.device("cuda:2")) == 2


@pytest.mark.parametrize("bad", ["gpu", "cuda:x", -1, "tpu:0"])
def test_normalize_device_rejects(bad):
    with pytest.raises(ValueError, match="unknown device"):
        normalize_device(bad)


def test_parse_max_memory_orders_and_converts_json_keys():
    got = parse_max_memory({"disk": "1TB", "cpu": "30GiB", "1": "10GiB", 0: 100})
    assert list(got) == [0, 1, "cpu", "disk"]
    assert got[1] == 10 * 2**30 and got[0] == 100


def test_parse_max_memory_reports_every_problem():
    with pytest.raises(ValueError) as err:
        parse_max_memory({"gpu0": "1GB", 0: "ten gigs", "cpu": "1Gb"})
    message = str(err.value)
    assert "'gpu0'" in message and "'ten gigs'" in message and "'1Gb'" in message


def test_format_size():
    assert format_size(0) == "0 B"
    assert format_size(1536) == "1.5 KiB"
    assert format_size(UNLIMITED) == "unlimited"


def test_device_order():
    assert sorted(["disk", "cpu", "mps", 2, 0], key=device_sort_key) == [0, 2, "mps", "cpu", "disk"]


def test_a_negative_size_string_is_called_negative():
    with pytest.raises(ValueError, match="'-5GiB' is negative"):
        parse_size("-5GiB")
