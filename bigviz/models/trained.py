"""A tiny trained GPT shipped with bigviz, so that generated text is readable.

A model with random weights writes one token again and again; a model that learned something
writes text a person can check at a glance. bigviz ships one: a byte-level GPT (4 blocks,
64 wide, 225K parameters, 877.5 KiB in float32) that learned the sentences of
``tiny/corpus.txt`` by heart (``python -m bigviz.models.train_tiny`` made it). Its checkpoint
folder (``model.safetensors`` + ``config.json``) loads like any other: with
``bigviz.load_checkpoint_and_dispatch``, or planned from its headers with ``bigviz.plan``.

Byte-level: token ids are the bytes of UTF-8 text (vocabulary 256), so no tokenizer is needed.

Example:
    >>> model = tiny_gpt()
    >>> decode_bytes(model.generate(encode_bytes("A plan says "), 30)[0])
    'A plan says where each module lives: on a '
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import torch
from torch import Tensor

from bigviz.models.gpt import GPT, GPTConfig

__all__ = ["TINY_DIR", "tiny_gpt", "tiny_gpt_folder", "tiny_corpus", "encode_bytes", "decode_bytes"]

TINY_DIR = Path(__file__).resolve().parent / "tiny"


def tiny_gpt_folder() -> Path:
    """The shipped checkpoint folder: ``model.safetensors`` and ``config.json``.

    Example:
        >>> sorted(p.name for p in tiny_gpt_folder().iterdir() if p.suffix != ".txt")
        ['config.json', 'model.safetensors']
    """
    return TINY_DIR


def tiny_corpus() -> str:
    """The text the tiny GPT learned (about 4 KB of sentences on loading big models)."""
    return (TINY_DIR / "corpus.txt").read_text(encoding="utf-8")


def tiny_gpt() -> GPT:
    """The shipped byte-level GPT, trained, in eval mode, in float32 on the CPU.

    Example:
        >>> model = tiny_gpt()
        >>> model.config.vocab_size, model.config.n_layer, model.training
        (256, 4, False)
    """
    import json

    from safetensors.torch import load_file

    config = GPTConfig(
        **{k: v for k, v in json.loads((TINY_DIR / "config.json").read_text()).items() if k != "model_type"}
    )
    with torch.device("meta"):
        model = GPT(config)
    state = load_file(str(TINY_DIR / "model.safetensors"))
    model.load_state_dict(state, strict=False, assign=True)  # the tied head is stored once
    model.tie_weights()  # assign=True replaced wte's Parameter: tie the head to the new one
    missing = [n for n, p in model.named_parameters() if p.is_meta]
    if missing:
        raise ValueError(
            f"{TINY_DIR / 'model.safetensors'} lacks {missing}: retrain it with python -m bigviz.models.train_tiny"
        )
    return model.eval()


def encode_bytes(text: str) -> Tensor:
    """UTF-8 bytes of ``text`` as token ids, shape ``(1, len)``: a batch of one prompt.

    Example:
        >>> encode_bytes("Hi").tolist()
        [[72, 105]]
    """
    return torch.tensor([list(text.encode("utf-8"))], dtype=torch.long)


def decode_bytes(ids: Tensor | Iterable[int]) -> str:
    """Token ids (one sequence) back to text; bytes that are not valid UTF-8 become U+FFFD.

    Example:
        >>> decode_bytes(torch.tensor([72, 105]))
        'Hi'
    """
    values = ids.tolist() if isinstance(ids, Tensor) else list(ids)
    return bytes(values).decode("utf-8", errors="replace")
