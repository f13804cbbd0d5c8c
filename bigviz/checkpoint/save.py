"""`save_sharded`: write a model or state dict as a sharded checkpoint, atomically.

The output is exactly what transformers writes (and reads back with ``from_pretrained``):
``model-00001-of-00003.safetensors`` ... plus ``model.safetensors.index.json`` =
``{"metadata": {"total_parameters": N, "total_size": BYTES}, "weight_map": {name: file}}``
with sorted keys; a single shard is a plain ``model.safetensors`` with no index; with
``safe_serialization=False``, ``pytorch_model-0000k-of-0000N.bin`` and
``pytorch_model.bin.index.json``.

Everything is written into a hidden, locked stage inside the folder, then committed (see
`bigviz.checkpoint.commit`): a loader finds a complete checkpoint, the old one or the new one,
at every instant and after a kill at any step; ``overwrite=True`` replaces only the
checkpoint's own files, and ``config.json``, tokenizer files and everything else stay.

Example:
    >>> import tempfile, torch, pathlib
    >>> folder = save_sharded(torch.nn.Linear(4, 4), pathlib.Path(tempfile.mkdtemp()) / "ckpt",
    ...                       max_shard_size=64, progress=False)
    >>> sorted(p.name for p in folder.iterdir())
    ['model-00001-of-00002.safetensors', 'model-00002-of-00002.safetensors', 'model.safetensors.index.json']
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from bigviz.checkpoint.commit import CONFIG, Stage, clean_stale_stages, commit, folder_checkpoint
from bigviz.checkpoint.progress import byte_bar
from bigviz.checkpoint.safetensors_io import write_safetensors
from bigviz.checkpoint.sharding import parse_size, plan_shards, unique_tensors
from bigviz.core.errors import ArgumentTypeError, UsageError
from bigviz.core.quant import quantization_role_keys

__all__ = ["save_sharded", "write_checkpoint_files"]


def save_sharded(
    model_or_state_dict: torch.nn.Module | Mapping[str, torch.Tensor],
    folder: str | Path,
    *,
    max_shard_size: int | str = "10GB",
    safe_serialization: bool = True,
    overwrite: bool = False,
    metadata: Mapping[str, str] | None = None,
    progress: bool = True,
    config: Any = None,
) -> Path:
    """Save a model's state dict (or a state dict) as a sharded checkpoint in ``folder``.

    Tensors are assigned to shards greedily in key order; a tensor larger than
    ``max_shard_size`` gets a shard of its own. Tensors that are the same storage view (tied
    weights such as ``lm_head.weight`` / ``wte.weight``) are saved once, under the first name.

    The folder may hold other files (``config.json``, tokenizer files, ...): they are kept.
    With ``overwrite=True`` the folder's checkpoint is replaced: every weights and index file
    in transformers' naming, both formats and every variant (``model*.safetensors``,
    ``model.safetensors.index*.json``, ``pytorch_model*.bin``, ``pytorch_model.bin.index*.json``),
    so no stale shard or other-format file can shadow the new checkpoint.

    Args:
        model_or_state_dict: an ``nn.Module`` (its ``state_dict()``) or ``{name: tensor}``.
        folder: the output folder; created if needed.
        max_shard_size: the largest shard, in bytes or as a string (``"10GB"`` = 10e9,
            ``"500MiB"`` = 500 * 2**20).
        safe_serialization: write safetensors (default) or torch ``.bin`` pickles.
        overwrite: replace the checkpoint ``folder`` holds.
        metadata: extra string pairs for every safetensors shard header (next to
            ``{"format": "pt"}``).
        progress: show a progress bar over bytes once the work has run for a second.
        config: written as ``config.json`` beside the shards, so the model can be rebuilt
            from the folder alone (``python -m bigviz.distributed``, transformers'
            ``AutoConfig``): a bigviz config (``model.config``), a transformers config, or a dict.

    Returns:
        The folder, as a ``Path``.

    Raises:
        FileExistsError: ``folder`` holds a checkpoint (or one appeared while saving) and
            ``overwrite`` is False, or ``folder`` is a file.
        ValueError: some tensors are on the meta device (they have no data to save).
        OSError: a full disk, a read-only folder...: named, with the folder holding a complete
            checkpoint (the one it had) and all its other files.

    Example:
        >>> import tempfile, torch, pathlib
        >>> out = save_sharded({"w": torch.zeros(3)}, pathlib.Path(tempfile.mkdtemp()) / "m",
        ...                    progress=False)
        >>> [p.name for p in out.iterdir()]
        ['model.safetensors']
    """
    folder = Path(folder)
    state = _state_dict(model_or_state_dict)
    _check_names(state, metadata, safe_serialization)  # before anything is written or replaced
    _check_quantized(state, config)
    tensors, _dropped = unique_tensors(state)
    limit = parse_size(max_shard_size)
    if folder.is_dir():
        _tidy(folder)  # what a killed save left (never a live save's stage), before looking for a checkpoint
    created = _prepare_folder(folder, overwrite)
    try:
        config_text = _config_text(folder, config, overwrite=overwrite)
        with Stage.create(folder) as stage:
            written = write_checkpoint_files(
                tensors,
                stage.path,
                max_shard_size=limit,
                safe_serialization=safe_serialization,
                metadata=metadata,
                progress=progress,
            )
            names = [p.name for p in written]
            index = names[-1] if names[-1].endswith(".json") else None
            if config_text is not None:  # staged with the shards, committed with them
                (stage.path / CONFIG).write_text(config_text)
            commit(stage, names, index, overwrite=overwrite, config=config_text is not None)
        _tidy(folder)
    except BaseException as err:
        _remove_created(created)
        if isinstance(err, OSError) and err.errno is not None:
            raise _named(err, folder) from None
        raise
    return folder


def write_checkpoint_files(
    tensors: Mapping[str, torch.Tensor],
    folder: Path,
    *,
    max_shard_size: int,
    safe_serialization: bool = True,
    metadata: Mapping[str, str] | None = None,
    progress: bool = False,
    align: int = 64,
    stem: str | None = None,
) -> list[Path]:
    """Write shards (and an index when there are several) into an existing ``folder``.

    The building block of `save_sharded` (which adds the atomic commit); also used to write
    disk-offloaded weights once (with a ``stem`` of their own instead of ``model``). Tensors
    start 64-byte aligned where their sizes allow (see `write_safetensors`): a memory-mapped
    tensor then computes exactly as one in fresh memory, even in kernels that take another
    path on unaligned data. Returns the files written, index last.
    """
    shards = plan_shards(tensors, max_shard_size)
    ext = "safetensors" if safe_serialization else "bin"
    stem = stem or ("model" if safe_serialization else "pytorch_model")
    names = _shard_names(stem, ext, len(shards))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    written: list[Path] = []
    with byte_bar(total, "saving", enabled=progress) as bar:
        for name, shard in zip(names, shards):
            part = {k: tensors[k] for k in shard}
            if safe_serialization:
                header = {"format": "pt", **(metadata or {})}
                write_safetensors(folder / name, part, metadata=header, on_bytes=bar.update, align=align)
            else:
                _torch_save({k: _own_storage(t) for k, t in part.items()}, folder / name)
                bar.update(sum(t.numel() * t.element_size() for t in part.values()))
            written.append(folder / name)
    if len(shards) > 1:
        written.append(_write_index(folder, f"{stem}.{ext}.index.json", tensors, shards, names))
    return written


def _torch_save(obj: object, path: Path) -> None:
    """``torch.save`` into ``path``; a failed write (a full disk) is the ``OSError`` it was.

    Why not ``torch.save(obj, path)``: torch's own writer reports ENOSPC as a bare
    ``RuntimeError`` ("unexpected pos ..."), and even through a Python file the error of its
    zip writer's end can replace the ``OSError`` of the write that failed.
    """
    failed: list[OSError] = []

    class _Writes:  # what torch.save needs of a file: write and flush, each failure kept
        def __init__(self, file: Any) -> None:
            self.file = file

        def write(self, data: Any) -> int:
            try:
                return self.file.write(data)
            except OSError as err:
                failed.append(err)
                raise

        def flush(self) -> None:
            self.file.flush()

    try:
        with open(path, "wb") as file:
            torch.save(obj, _Writes(file))
    except (OSError, RuntimeError) as err:
        if failed and failed[0] is not err:
            raise failed[0] from None
        raise


def _config_text(folder: Path, config: Any, *, overwrite: bool) -> str | None:
    """The ``config.json`` text to commit with the shards (None without a config, or when the
    folder's says the same already: nothing to change).

    Raises:
        FileExistsError: the folder's ``config.json`` says something else and ``overwrite``
            is False (bigviz does not replace a file it was not asked to replace).
    """
    if config is None:
        return None
    data = _config_data(config)
    text = json.dumps(data, indent=2, sort_keys=True) + "\n"
    existing = folder / CONFIG
    if os.path.lexists(existing) and not stat.S_ISREG(os.lstat(existing).st_mode):
        kind = "a symbolic link" if existing.is_symlink() else "a folder" if existing.is_dir() else "not a file"
        raise FileExistsError(
            f"{existing} is {kind}, not a config file bigviz could have written; it is never replaced, "
            "overwrite=True or not: move it away, or leave config= out to keep it"
        )
    if existing.is_file() and _same_config(existing, config, data):
        return None
    if not overwrite and os.path.lexists(existing):
        raise FileExistsError(
            f"{existing} exists and differs from the config given; pass "
            "overwrite=True to replace it, or leave config= out to keep it"
        )
    return text


def _same_config(path: Path, config: Any, data: dict[str, Any]) -> bool:
    """Whether the ``config.json`` at ``path`` says what ``config`` says: the same JSON data,
    or, for a transformers config (``save_pretrained`` writes only what differs from the
    class's defaults, and the version that wrote it), the same config once read by its class."""
    try:
        current = json.loads(path.read_bytes())
    except (OSError, ValueError):
        return False
    if current == data:
        return True
    from_dict = getattr(type(config), "from_dict", None)
    if not isinstance(current, dict) or from_dict is None or isinstance(config, Mapping):
        return False
    try:
        read = from_dict(current).to_dict()
    except Exception:  # a config its class cannot read is not the same config
        return False
    unversioned = {"transformers_version", "_name_or_path"}
    return {k: v for k, v in read.items() if k not in unversioned} == {
        k: v for k, v in data.items() if k not in unversioned
    }


def _config_data(config: Any) -> dict[str, Any]:
    """A config as JSON data: a mapping, or anything with ``to_dict()`` (bigviz and
    transformers configs)."""
    data = dict(config) if isinstance(config, Mapping) else getattr(config, "to_dict", lambda: None)()
    if not isinstance(data, dict):
        raise ArgumentTypeError(
            f"config must be a dict or have to_dict() (a bigviz or transformers config), not {type(config).__name__}"
        )
    return data


def _shard_names(stem: str, ext: str, count: int) -> list[str]:
    if count <= 1:
        return [f"{stem}.{ext}"]
    return [f"{stem}-{i:05d}-of-{count:05d}.{ext}" for i in range(1, count + 1)]


def _write_index(
    folder: Path, name: str, tensors: Mapping[str, torch.Tensor], shards: list[list[str]], files: list[str]
) -> Path:
    weight_map = {key: file for file, shard in zip(files, shards) for key in shard}
    doc = {
        "metadata": {
            "total_parameters": sum(t.numel() for t in tensors.values()),
            "total_size": sum(t.numel() * t.element_size() for t in tensors.values()),
        },
        "weight_map": dict(sorted(weight_map.items())),
    }
    path = folder / name
    path.write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")
    return path


def _own_storage(t: torch.Tensor) -> torch.Tensor:
    """``t`` on the CPU, cloned when it is a view into a larger storage (torch.save would
    otherwise write the whole storage)."""
    t = t.detach().to("cpu")
    if t.untyped_storage().nbytes() != t.numel() * t.element_size() or not t.is_contiguous():
        t = t.contiguous().clone()
    return t


def _state_dict(obj: torch.nn.Module | Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    state = obj.state_dict() if isinstance(obj, torch.nn.Module) else dict(obj)
    bad = [k for k, v in state.items() if not isinstance(v, torch.Tensor)]
    if bad:
        raise ArgumentTypeError(f"not tensors, cannot save: {bad[:10]}")
    meta = [k for k, v in state.items() if v.is_meta]
    if meta:
        raise UsageError(
            f"{len(meta)} tensors are on the meta device and have no data to save "
            f"(first: {meta[:5]}): weights never loaded, or offloaded by a dispatch (they stream from the "
            "checkpoint or offload folder they were loaded from, which already holds them). Load weights into "
            "the model first (bigviz.load_checkpoint_in_model, with no device map) or materialise it with "
            "model.to_empty(device='cpu') and initialise it"
        )
    if isinstance(obj, torch.nn.Module):
        state = _stored_names(obj, state)
    return state


def _stored_names(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A transformers model's state dict in the names and layout its checkpoints are stored in,
    as ``save_pretrained`` writes it: transformers renames and fuses some weights when it loads
    them (GPT-NeoX's ``embed_out`` is ``lm_head`` in memory, Mixtral's experts one fused tensor)
    and reverts that when it saves, with its own ``revert_weight_conversion``, used here. Other
    models, and transformers versions without that function, keep their in-memory names."""
    from bigviz.modeling.twin import is_transformers_model

    if not is_transformers_model(model):
        return state
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:  # transformers before 5: loads and saves the same names
        return state
    return dict(revert_weight_conversion(model, state))


def _check_quantized(state: Mapping[str, torch.Tensor], config: Any) -> None:
    """Refuse to write quantized weights nothing could read back: torchao's tensor subclasses
    (``quantization="int8"``: their values and scales are inner tensors, not one storage a
    file holds), and quantized parts (bitsandbytes' ``weight.absmax``, ``SCB``, ...) under a
    ``config`` without the ``quantization_config`` that says how to read them."""
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    wrapped = [k for k, v in state.items() if is_traceable_wrapper_subclass(v)]
    if wrapped:
        raise UsageError(
            f"{len(wrapped)} weights are {type(state[wrapped[0]]).__name__} tensor subclasses (first: "
            f"{wrapped[:3]}), quantized while loading (quantization='int8'); save_sharded writes plain tensors "
            "and cannot save them. Save the float checkpoint instead and quantize at each load "
            "(quantization='int8'), or use transformers' from_pretrained(..., quantization_config=TorchAoConfig(...)) "
            "and its save_pretrained; nothing was written"
        )
    repacked = [k for k, v in state.items() if k.endswith(".absmax") and v.dtype not in (torch.float32, torch.uint8)]
    if repacked:
        raise UsageError(
            f"{len(repacked)} bitsandbytes 4-bit weights were repacked for its CPU kernel at the model's first "
            f"forward (first: {repacked[:3]}, absmax in {state[repacked[0]].dtype}): a checkpoint of them is not "
            "in bitsandbytes' stored format, and nothing could read it back. Save the model before its first "
            "forward (load it again), or save the float checkpoint and quantize at each load; nothing was written"
        )
    parts = quantization_role_keys(state)
    if parts and config is not None and not _config_data(config).get("quantization_config"):
        raise UsageError(
            f"the model holds {len(parts)} quantized parts (first: {parts[:3]}), but the config to write has no "
            "quantization_config, so neither bigviz nor transformers could read the checkpoint back (a model "
            "quantized while loading, quantization='int4', has none). Save the float checkpoint instead and "
            "quantize at each load, or pass a config with its quantization_config (e.g. config.quantization_config "
            "= BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type='nf4').to_dict()); nothing was written"
        )


def _check_names(state: Mapping[Any, torch.Tensor], metadata: Any, safe: bool) -> None:
    """Refuse what would write a checkpoint no loader reads: names that are not strings (a
    safetensors header is a JSON object: ``1`` and ``"1"`` would collide), a tensor named as
    the header's own ``__metadata__`` entry, metadata that is not string pairs (the format's
    rule; safetensors refuses the file otherwise), tensors not stored dense (no file format
    here holds a sparse or other layout)."""
    names = [k for k in state if not isinstance(k, str) or not k]
    if names:
        raise ArgumentTypeError(
            f"tensor names must be non-empty strings; got {[repr(k) for k in names[:5]]}: rename them "
            "(a checkpoint's names are the strings load_state_dict matches)"
        )
    if safe and "__metadata__" in state:
        raise UsageError(
            "a tensor is named '__metadata__', the name safetensors keeps for its header's metadata; "
            "rename it, or save with safe_serialization=False"
        )
    if metadata is not None:
        if not isinstance(metadata, Mapping):
            raise ArgumentTypeError(f"metadata must be a dict of strings, not {type(metadata).__name__}")
        bad = {k: v for k, v in metadata.items() if not isinstance(k, str) or not isinstance(v, str)}
        if bad:
            shown = ", ".join(f"{k!r}: {type(v).__name__}" for k, v in list(bad.items())[:5])
            raise ArgumentTypeError(
                f"metadata must map strings to strings (safetensors' header rule); not: {shown}. "
                "Convert the values with str() (or json.dumps) first"
            )
    layouts = [k for k, v in state.items() if v.layout != torch.strided]
    if layouts:
        raise ArgumentTypeError(
            f"{len(layouts)} tensors are not dense ({state[layouts[0]].layout}; first: {layouts[:5]}): a "
            "checkpoint holds dense tensors; save tensor.to_dense() under that name instead"
        )


def _tidy(folder: Path) -> None:
    try:
        clean_stale_stages(folder)
    except OSError:
        pass  # tidying is a courtesy: a folder we cannot list is reported by the save itself


def _prepare_folder(folder: Path, overwrite: bool) -> list[Path]:
    """Check ``folder`` can take the checkpoint and create it (and missing parents).

    Returns the folders created here, outermost first (removed again if the save fails,
    when still empty: never a folder another process created or filled meanwhile).
    """
    if folder.exists() and not folder.is_dir():
        raise FileExistsError(f"{folder} exists and is a file; choose a folder path")
    if not overwrite and folder.is_dir():
        found = folder_checkpoint(folder)
        if found:
            shown = ", ".join(found[:4]) + (", ..." if len(found) > 4 else "")
            raise FileExistsError(
                f"{folder} already holds a checkpoint ({shown}); pass overwrite=True to replace it "
                "(config.json and your other files are kept), or choose another folder"
            )
    missing = [p for p in (folder, *folder.parents) if not p.exists()][::-1]
    created = []
    for path in missing:
        try:
            path.mkdir()
        except FileExistsError:
            continue  # made meanwhile by someone else: theirs, never removed
        except OSError as err:
            _remove_created(created)
            raise _named(err, folder) from None
        created.append(path)
    return created


def _remove_created(created: list[Path]) -> None:
    for path in reversed(created):
        try:
            path.rmdir()  # only if empty: what another process put there stays
        except OSError:
            return


def _named(err: OSError, folder: Path) -> OSError:
    """The same kind of error, saying which save failed and what the folder holds now."""
    where = f" ({err.filename})" if err.filename else ""
    message = (
        f"save_sharded could not write {folder}: {err.strerror or err}{where}; the folder still "
        "holds a complete checkpoint (the old one unless the error came after the new one "
        "was in place) and all its other files"
    )
    return type(err)(err.errno, message)
