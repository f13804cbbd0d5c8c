"""bigviz.checkpoint: read, write, check and load checkpoints in every common layout.

- `CheckpointIndex` lists a checkpoint's tensors from headers alone;
- `LazyWeights` maps them zero-copy (memory-mapped safetensors);
- `save_sharded` writes transformers-compatible sharded checkpoints, atomically;
- `load_checkpoint_in_model` checks names, shapes and devices first, then loads tensor by
  tensor, leaving disk-mapped weights in place; `load_sharded_checkpoint` is transformers' name;
- `tree_from_checkpoint` builds the planner's size tree with no model code.

Submodules are imported on first use, so ``import bigviz.checkpoint`` stays cheap.
"""

from __future__ import annotations

from bigviz.core.lazy import lazy_exports

_EXPORTS: dict[str, str] = {
    "CheckpointError": "bigviz.checkpoint.errors",
    "OffloadFolderError": "bigviz.checkpoint.offload_folder",
    "CheckpointIndex": "bigviz.checkpoint.index",
    "TensorInfo": "bigviz.checkpoint.index",
    "LazyWeights": "bigviz.checkpoint.lazy",
    "save_sharded": "bigviz.checkpoint.save",
    "LoadResult": "bigviz.checkpoint.load",
    "load_checkpoint_in_model": "bigviz.checkpoint.load",
    "load_sharded_checkpoint": "bigviz.checkpoint.load",
    "tree_from_checkpoint": "bigviz.checkpoint.tree",
    "detect_no_split": "bigviz.checkpoint.tree",
}

__all__ = sorted(_EXPORTS)


__getattr__, __dir__ = lazy_exports("bigviz.checkpoint", _EXPORTS, globals())
