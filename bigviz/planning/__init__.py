"""The planning entry points users call, for an ``nn.Module``, its inventory, a size tree, a
checkpoint path or a ``config.json``: the chain of plans, each printable before anything moves.

- :func:`plan` / :func:`infer_auto_device_map`: the device plan (module -> device, reasons);
- :func:`load_plan`: the load plan (tensor -> file, bytes, dtype conversion, target device);
- :func:`dispatch_plan`: the dispatch plan (offload units, storage, fetch order, resident, and
  how each unit lives at run time: mapped, resident copy or streamed);
- :func:`plan_chain`: all three at once, validated once (what ``load_checkpoint_and_dispatch``
  carries out);
- :func:`check_device_map`, :func:`max_context`, :func:`plan_pipeline`.

This layer sits above ``modeling`` (trees from modules) and ``checkpoint`` (trees from
headers) so that one call takes either; ``engine``, ``distributed`` and ``ui`` build on it.
The submodules load torch; ``import bigviz`` imports this package only when a name is used.

Example:
    >>> import torch.nn as nn
    >>> model = nn.Sequential(*[nn.Linear(100, 100) for _ in range(4)])  # 40,400 bytes each
    >>> infer_auto_device_map(model, {0: "150KB", "cpu": "1GB"})  # accelerate's default: in order
    {'0': 0, '1': 'cpu', '2': 'cpu', '3': 'cpu'}
"""

from __future__ import annotations

from bigviz.planning.chain import PlanChain, dispatch_plan, load_plan, plan_chain
from bigviz.planning.context import max_context, position_limit
from bigviz.planning.device_plan import check_device_map, get_balanced_memory, infer_auto_device_map, plan
from bigviz.planning.inputs import PlannerInputs, place, planner_inputs
from bigviz.planning.models import ModelLike, as_tree, default_no_split, resolve_model
from bigviz.planning.pipeline import plan_pipeline
from bigviz.planning.workload import model_run_spec, workload_bytes

__all__ = [
    "ModelLike",
    "as_tree",
    "check_device_map",
    "default_no_split",
    "dispatch_plan",
    "plan_chain",
    "PlanChain",
    "planner_inputs",
    "PlannerInputs",
    "place",
    "infer_auto_device_map",
    "get_balanced_memory",
    "load_plan",
    "max_context",
    "model_run_spec",
    "plan",
    "plan_pipeline",
    "position_limit",
    "resolve_model",
    "workload_bytes",
]
