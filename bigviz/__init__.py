"""bigviz: plan, see and run PyTorch models that do not fit in one device's memory.

Public names follow Hugging Face Accelerate and Transformers (``init_empty_weights``,
``infer_auto_device_map``, ``load_checkpoint_and_dispatch``, ``cpu_offload``, ...), so their
examples run with ``import bigviz`` in place of ``import accelerate``.

Everything is imported lazily: ``import bigviz`` loads neither torch, plotly nor ipywidgets
until a name that needs them is used.

Example:
    >>> import bigviz
    >>> bigviz.parse_size("1.5GiB")
    1610612736
"""

from __future__ import annotations

from bigviz.core.lazy import lazy_exports

__version__ = "0.1.0"

# public name -> module that defines it
_EXPORTS: dict[str, str] = {
    # core: pure planning, no torch
    "parse_size": "bigviz.core.sizes",
    "format_size": "bigviz.core.sizes",
    "parse_max_memory": "bigviz.core.sizes",
    "TensorSpec": "bigviz.core.tree",
    "SizeTree": "bigviz.core.tree",
    "Placement": "bigviz.core.plan",
    "DevicePlan": "bigviz.core.plan",
    "PlanOptions": "bigviz.core.plan",
    "make_plan": "bigviz.core.planner",
    "PlanError": "bigviz.core.errors",
    "BigvizError": "bigviz.core.errors",
    "DeviceMapError": "bigviz.core.errors",
    "FetchError": "bigviz.core.errors",
    "StateError": "bigviz.core.errors",
    "ArgumentTypeError": "bigviz.core.errors",
    "UsageError": "bigviz.core.errors",
    "DispatchPlan": "bigviz.core.dispatch_plan",
    "clean_device_map": "bigviz.core.devicemap",
    "save_device_map": "bigviz.core.serialize",
    "load_device_map": "bigviz.core.serialize",
    "save_max_memory": "bigviz.core.serialize",
    "load_max_memory": "bigviz.core.serialize",
    "preset_budgets": "bigviz.core.hardware",
    "MachineFacts": "bigviz.core.stream_plan",
    "StreamPlan": "bigviz.core.stream_plan",
    "ForwardEstimate": "bigviz.core.cost",
    "QuantConfig": "bigviz.core.quant",
    "PipelinePlan": "bigviz.core.pipeline",
    "PipelineError": "bigviz.core.pipeline",
    "PipelineRun": "bigviz.core.pipeline",
    "pipeline_bubble": "bigviz.core.pipeline",
    # modeling: the bridge from nn.Module
    "init_empty_weights": "bigviz.modeling.meta",
    "init_on_device": "bigviz.modeling.meta",
    "compute_module_sizes": "bigviz.modeling.sizes",
    "size_table": "bigviz.modeling.sizes",
    "module_tree": "bigviz.modeling.sizes",
    "find_tied_parameters": "bigviz.modeling.sizes",
    "get_max_memory": "bigviz.modeling.budgets",
    "plan": "bigviz.planning",
    "max_context": "bigviz.planning",
    "resolve_model": "bigviz.planning",
    "kv_cache_bytes": "bigviz.modeling.workload",
    "model_from_config": "bigviz.modeling.configs",
    "config_path": "bigviz.modeling.configs",
    "shipped_configs": "bigviz.modeling.configs",
    "Workload": "bigviz.core.workload",
    "measure_generate": "bigviz.modeling.memory",
    "TensorTracker": "bigviz.modeling.memory",
    "infer_auto_device_map": "bigviz.planning",
    "get_balanced_memory": "bigviz.planning",
    "check_device_map": "bigviz.planning",
    "plan_pipeline": "bigviz.planning",
    "load_plan": "bigviz.planning",
    "dispatch_plan": "bigviz.planning",
    "plan_chain": "bigviz.planning",
    # checkpoint
    "CheckpointIndex": "bigviz.checkpoint.index",
    "TensorInfo": "bigviz.checkpoint.index",
    "LazyWeights": "bigviz.checkpoint.lazy",
    "save_sharded": "bigviz.checkpoint.save",
    "load_checkpoint_in_model": "bigviz.checkpoint.load",
    "load_sharded_checkpoint": "bigviz.checkpoint.load",
    "tree_from_checkpoint": "bigviz.checkpoint.tree",
    "detect_no_split": "bigviz.checkpoint.tree",
    "CheckpointError": "bigviz.checkpoint.errors",
    "OffloadFolderError": "bigviz.checkpoint.offload_folder",
    "LoadResult": "bigviz.checkpoint.load",
    "LoadPlan": "bigviz.checkpoint.load_plan",
    # engine
    "ModelHook": "bigviz.engine.hooks",
    "SequentialHook": "bigviz.engine.hooks",
    "add_hook_to_module": "bigviz.engine.hooks",
    "remove_hook_from_module": "bigviz.engine.hooks",
    "remove_hooks": "bigviz.engine.hooks",
    "dispatch_model": "bigviz.engine.dispatch",
    "load_checkpoint_and_dispatch": "bigviz.engine.big_modeling",
    "cpu_offload": "bigviz.engine.big_modeling",
    "cpu_offload_with_hook": "bigviz.engine.big_modeling",
    "disk_offload": "bigviz.engine.big_modeling",
    "residency": "bigviz.engine.resident",
    "timeline": "bigviz.engine.timeline",
    "Timeline": "bigviz.engine.timeline",
    # ui (plotly / ipywidgets imported on first use)
    "Planner": "bigviz.ui.planner",
    "treemap": "bigviz.ui.treemap",
    "save_html": "bigviz.ui.report",
}

__all__ = sorted(_EXPORTS) + ["__version__"]


__getattr__, __dir__ = lazy_exports("bigviz", _EXPORTS, globals())
