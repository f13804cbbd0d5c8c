"""Train the shipped byte-level GPT (``bigviz/models/tiny``): run ``python -m bigviz.models.train_tiny``.

The notebooks and ``bigviz demo`` need a model whose output a person can read: a random
model writes one token again and again, so "the offloaded model wrote the same text" shows
nothing. This script trains a small GPT (4 blocks, 64 wide, 256 byte values, 128 positions)
on ``tiny/corpus.txt`` until it knows the sentences by heart, and writes
``tiny/model.safetensors`` and ``tiny/config.json``, which bigviz ships as package data
(see :func:`bigviz.models.tiny_gpt`). It took 15 minutes on two busy CPU cores (2500 steps) and is
deterministic on one machine (seeded, one thread); it is not run by the tests.

Example:
    $ python -m bigviz.models.train_tiny            # rewrites bigviz/models/tiny/
    $ python -m bigviz.models.train_tiny --steps 50 --out /tmp/tiny   # a quick try elsewhere
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch

from bigviz.models.gpt import GPT, GPTConfig
from bigviz.models.trained import TINY_DIR, decode_bytes, encode_bytes

__all__ = ["TINY_CONFIG", "train", "main"]

TINY_CONFIG = GPTConfig(n_layer=4, n_head=4, n_embd=64, vocab_size=256, block_size=128)
BATCH = 16
LR = 3e-3


def _batch(data: torch.Tensor, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """``BATCH`` random windows of the corpus, each as long as the context, and their next bytes."""
    T = TINY_CONFIG.block_size
    starts = torch.randint(0, len(data) - T - 1, (BATCH,), generator=generator)
    x = torch.stack([data[s : s + T] for s in starts])  # (B, T)
    y = torch.stack([data[s + 1 : s + T + 1] for s in starts])  # (B, T): shifted by one
    return x, y


def train(text: str, steps: int, *, seed: int = 0, log_every: int = 250) -> GPT:
    """Train a fresh ``TINY_CONFIG`` GPT on ``text`` (bytes) with AdamW and a cosine schedule."""
    torch.manual_seed(seed)
    generator = torch.Generator().manual_seed(seed)
    model = GPT(TINY_CONFIG)
    data = torch.tensor(list(text.encode()), dtype=torch.long)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    start = time.perf_counter()
    for step in range(steps):
        for group in optimizer.param_groups:  # warm up for 100 steps, then cosine down to 10%
            warm = min(1.0, (step + 1) / 100)
            group["lr"] = LR * warm * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / steps)))
        x, y = _batch(data, generator)
        _, loss = model(x, y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if step % log_every == 0 or step == steps - 1:
            print(f"step {step:5d}  loss {loss.item():.4f}  {time.perf_counter() - start:6.1f} s", flush=True)
    return model.eval()


def save(model: GPT, out: Path) -> None:
    """Write ``model.safetensors`` (the tied head stored once, as ``transformer.wte.weight``) and
    ``config.json``."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(model.config.to_dict(), indent=2) + "\n")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Train the byte-level GPT that bigviz ships.")
    parser.add_argument("--steps", type=int, default=2500)
    parser.add_argument("--out", type=Path, default=TINY_DIR)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # one thread: the same sums in the same order, the same weights
    text = (TINY_DIR / "corpus.txt").read_text(encoding="utf-8")
    model = train(text, args.steps)
    save(model, args.out)
    prompt = encode_bytes("Big models ")
    print(repr(decode_bytes(model.generate(prompt, 100)[0])))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
