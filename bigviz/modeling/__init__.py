"""The bridge from ``nn.Module`` into the pure planner: meta init, sizes, ties, budgets."""

from __future__ import annotations

from bigviz.modeling.budgets import available_devices, get_max_memory
from bigviz.modeling.meta import init_empty_weights, init_on_device
from bigviz.modeling.sizes import compute_module_sizes, find_tied_parameters, module_tree, size_table

__all__ = [
    "available_devices",
    "compute_module_sizes",
    "find_tied_parameters",
    "get_max_memory",
    "init_empty_weights",
    "init_on_device",
    "module_tree",
    "size_table",
]
