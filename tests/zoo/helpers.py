"""What the zoo tests share: build, save sharded, reload with transformers, run, compare."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

import bigviz
from tests.zoo.specs import Spec, build_config, model_class


def quiet_transformers() -> None:
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()


def save_checkpoint(spec: Spec, folder: Path, *, shard: str = "20KB") -> Path:
    """Random weights (seeded), written by ``save_pretrained`` in small shards."""
    quiet_transformers()
    torch.manual_seed(0)
    model = model_class(spec)(build_config(spec))
    model.save_pretrained(folder, max_shard_size=shard)
    return folder


def reference(spec: Spec, folder: Path, dtype: torch.dtype | None = None, **kwargs: Any) -> nn.Module:
    """``from_pretrained``, the reference every bigviz load is compared with."""
    quiet_transformers()
    return model_class(spec).from_pretrained(folder, dtype=dtype or torch.float32, **kwargs).eval()


def meta_model(spec: Spec) -> nn.Module:
    """The model on meta, in eval mode (as ``from_pretrained`` returns it: no dropout)."""
    with bigviz.init_empty_weights():
        return model_class(spec)(build_config(spec)).eval()


def inputs(spec: Spec, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """The spec's inputs, floating ones in ``dtype`` (pixel values, audio features)."""
    return {k: v.to(dtype) if dtype is not None and v.is_floating_point() else v for k, v in spec.inputs().items()}


def forward(model: nn.Module, spec: Spec, dtype: torch.dtype | None = None) -> torch.Tensor:
    with torch.no_grad():
        return getattr(model(**inputs(spec, dtype)), spec.output)
