"""Generate across pipeline stages: each rank keeps the KV cache of its own layers.

Every rank calls :func:`generate` with its stage (from :func:`~bigviz.distributed.build_stage_module`);
rank 0 gives the prompt. The prompt is cut into micro-batches; each micro-batch's prefill and
every decode step go through the stages in order, and the last stage's greedy token goes back
to the first stage (a ring). With as many micro-batches as stages, every stage works on one
micro-batch while the others' tokens travel: the stages stay busy during decode too, not only
in the prefill. Each rank keeps one cache per micro-batch, for its own layers only: bigviz's
``KVCache`` for bigviz's models, transformers' ``DynamicCache`` for transformers models.

Why point-to-point sends and not ``torch.distributed.pipelining``'s schedules: a schedule
moves micro-batches through ``forward(*args)`` with receive buffers sized once, from the first
step's shapes, and passes nothing back from the last stage to the first. Generation needs a
cache held across steps per micro-batch, a prefill of ``T`` tokens followed by steps of one,
and the new token fed back to the first stage. So each message is a small header (what
follows, its shape and dtype) and then the tensor, sent with ``isend`` (a blocking send could
wait on a rank that is itself waiting to send back around the ring); every receive waits at
most the process group's timeout.

Example (on every rank of a group of 2, e.g. under ``torchrun --nproc-per-node 2``)::

    model = empty_model("ckpt/")
    plan = bigviz.plan_pipeline(model, 2)
    built = build_stage_module(model, "ckpt/", plan, dist.get_rank(), split="wrap")
    result = generate(built, ids if dist.get_rank() == 0 else None, 16, microbatches=2)
    result.tokens  # (B, T + 16) on rank 0, None elsewhere
    close_process_group()  # the worker's last step: see close_process_group
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from bigviz.core.pipeline import PipelineError
from bigviz.distributed.adapters import HFStage, cache_nbytes

__all__ = ["GenerateResult", "close_process_group", "generate", "generation_ids", "shared_problems"]

_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.long)
_SKIP, _TENSOR = 0, 1  # header kinds: the micro-batch has finished (nothing follows), or a tensor follows
_HEADER = 6  # kind, dtype code, ndim, up to three sizes


@dataclass
class GenerateResult:
    """What :func:`generate` did on one rank.

    Attributes:
        tokens: the prompt and its new tokens, ``(B, T + new)``, on rank 0 (``None`` on the others).
        cache_bytes: bytes this rank's caches hold at the end, every micro-batch's together.
        busy_s: seconds this rank spent running its stage.
        wall_s: seconds from the start of the first pass to the end of the last.
        passes: passes through the stages (the prefill, then one per new token after the first).
        microbatches: micro-batches in flight.
        stage: this rank's stage index; ``n_stages``: stages in the pipeline.
    """

    tokens: Tensor | None
    cache_bytes: int
    busy_s: float
    wall_s: float
    passes: int
    microbatches: int
    stage: int
    n_stages: int

    @property
    def idle(self) -> float:
        """The fraction of the time this rank did not run its stage (the measured bubble,
        communication included)."""
        return 1.0 - self.busy_s / self.wall_s if self.wall_s > 0 else 0.0


def generation_ids(config: Any) -> dict[str, Any]:
    """``{"eos_token_id": ..., "pad_token_id": ...}`` as transformers' ``generate`` reads them
    from a ``GenerationConfig`` (or a model config): generation stops for a sequence at an
    end-of-sequence token, and later tokens of a finished sequence are padding (the EOS token
    when no pad token is given). Both ``None`` when the config names no EOS token.

    Example:
        >>> from types import SimpleNamespace
        >>> generation_ids(SimpleNamespace(eos_token_id=2, pad_token_id=None))
        {'eos_token_id': [2], 'pad_token_id': 2}
    """
    eos = getattr(config, "eos_token_id", None)
    eos = [eos] if isinstance(eos, int) else list(eos) if eos else None
    pad = getattr(config, "pad_token_id", None)
    return {"eos_token_id": eos, "pad_token_id": pad if pad is not None else (eos[0] if eos else None)}


@dataclass
class _Ring:
    """This rank's place in the pipeline and its peers (global ranks of the group)."""

    rank: int
    size: int
    group: Any
    device: torch.device

    def peer(self, stage: int) -> int:
        import torch.distributed as dist

        return dist.get_global_rank(self.group, stage) if self.group is not None else stage

    @property
    def first(self) -> bool:
        return self.rank == 0

    @property
    def last(self) -> bool:
        return self.rank == self.size - 1


class _Sender:
    """``isend`` that keeps each tensor alive until it is sent."""

    def __init__(self) -> None:
        self.works: list[tuple[Any, Tensor]] = []

    def send(self, tensor: Tensor, dst: int, group: Any) -> None:
        import torch.distributed as dist

        tensor = tensor.contiguous()
        self.works.append((dist.isend(tensor, dst, group=group), tensor))
        self.works = [(w, t) for w, t in self.works if not w.is_completed()]

    def wait(self) -> None:
        for work, _ in self.works:
            work.wait()
        self.works.clear()


def _send_tensor(sender: _Sender, tensor: Tensor | None, dst: int, ring: _Ring) -> None:
    """A header, then the tensor (``None``: a header saying the micro-batch has finished)."""
    header = torch.zeros(_HEADER, dtype=torch.long)
    if tensor is not None:
        if tensor.dim() > _HEADER - 3 or tensor.dtype not in _DTYPES:
            raise PipelineError(f"cannot send a {tensor.dtype} tensor of shape {tuple(tensor.shape)} between stages")
        header[:3] = torch.tensor([_TENSOR, _DTYPES.index(tensor.dtype), tensor.dim()])
        header[3 : 3 + tensor.dim()] = torch.tensor(tensor.shape)
    sender.send(header.to(ring.device), dst, ring.group)
    if tensor is not None:
        sender.send(tensor, dst, ring.group)


def _recv_tensor(src: int, ring: _Ring) -> Tensor | None:
    import torch.distributed as dist

    header = torch.empty(_HEADER, dtype=torch.long, device=ring.device)
    dist.recv(header, src, group=ring.group)
    kind, code, ndim, *sizes = header.tolist()
    if kind == _SKIP:
        return None
    out = torch.empty(sizes[:ndim], dtype=_DTYPES[code], device=ring.device)
    dist.recv(out, src, group=ring.group)
    return out


def _check_mask(prompt_ids: Tensor, mask: Any) -> list[str]:
    """Rank 0's attention mask: the prompt's shape, 0 and 1 only, padding on the left."""
    if not isinstance(mask, Tensor) or mask.dim() != 2 or mask.is_floating_point() or mask.is_complex():
        return ["attention_mask: give an integer or boolean tensor (batch, tokens), 1 for a token and 0 for padding"]
    if tuple(mask.shape) != tuple(prompt_ids.shape):
        return [
            f"attention_mask of shape {tuple(mask.shape)} for a prompt of shape {tuple(prompt_ids.shape)}: give one"
            " value per prompt token"
        ]
    if not bool(((mask == 0) | (mask == 1)).all()):
        return ["attention_mask holds values other than 0 and 1: give 1 for a token and 0 for padding"]
    mask = mask.long()
    right = [i for i in range(mask.shape[0]) if mask[i, -1] == 0 or bool((mask[i, 1:] < mask[i, :-1]).any())]
    if right:
        return [
            f"attention_mask rows {right[:5]}{' ...' if len(right) > 5 else ''} are not padded on the left (a decoder "
            "generates after a prompt's last token, so padding goes first): set tokenizer.padding_side = 'left'"
        ]
    return []


def _check(
    rank: int, prompt_ids: Tensor | None, max_new_tokens: int, microbatches: int, attention_mask: Any = None
) -> list[str]:
    problems = []
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        problems.append(f"max_new_tokens={max_new_tokens!r}: give 1 or more")
    if isinstance(microbatches, bool) or not isinstance(microbatches, int) or microbatches < 1:
        problems.append(f"microbatches={microbatches!r}: give 1 or more")
    if rank == 0:
        if not isinstance(prompt_ids, Tensor) or prompt_ids.dim() != 2 or prompt_ids.is_floating_point():
            problems.append("rank 0 gives the prompt: token ids as an integer tensor (batch, tokens)")
        elif prompt_ids.shape[1] < 1 or prompt_ids.shape[0] < (microbatches if isinstance(microbatches, int) else 1):
            problems.append(
                f"a prompt of shape {tuple(prompt_ids.shape)} for {microbatches} micro-batches: give at least one "
                f"token and at least one sequence per micro-batch"
            )
        elif attention_mask is not None:
            problems += _check_mask(prompt_ids, attention_mask)
    return problems


def shared_problems(problems: Sequence[str], group: Any = None) -> list[str]:
    """Every rank's problems, on every rank of ``group`` (one collective): a problem every rank
    found is listed once, the others with the rank that found them. A rank that stopped alone
    would leave the others waiting for it; after this, all stop or none does.
    """
    import torch.distributed as dist

    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, list(problems), group=group)
    common = [p for p in gathered[0] if all(p in found for found in gathered)]
    own = [f"rank {r}: {p}" for r, found in enumerate(gathered) for p in found if p not in common]
    return common + own


def close_process_group(group: Any = None) -> None:
    """Wait for every rank of ``group``, then ``torch.distributed.destroy_process_group(group)``:
    call it as a torchrun worker's last step, instead of ``destroy_process_group`` alone.

    Why: once ``torch._dynamo`` has been imported (building a transformers model does it), torch
    keeps references to the process group that ``destroy_process_group`` does not drop, so
    gloo's worker threads outlive it. A worker thread frees a finished collective's tensors
    (``all_gather_object``'s, say) only when it gets the GIL; a process that returns from the
    collective and exits at once finalizes Python first, and that thread then aborts the
    process ("terminate called without an active exception", SIGABRT: one torchrun in a dozen
    on a 2-core machine). The barrier releases the GIL while it waits for the other ranks,
    which lets those threads finish first.
    """
    import torch.distributed as dist

    if not dist.is_initialized():
        return
    dist.barrier(group=group)
    dist.destroy_process_group(group)


def generate(
    stage: Any,
    prompt_ids: Tensor | None,
    max_new_tokens: int,
    *,
    microbatches: int = 1,
    attention_mask: Tensor | None = None,
    eos_token_id: int | Sequence[int] | None = None,
    pad_token_id: int | None = None,
    group: Any = None,
) -> GenerateResult:
    """Greedy generation through the pipeline; call it on every rank of the group.

    The prompt ``(B, T)`` (rank 0's; the other ranks pass ``None``) is cut into
    ``microbatches`` micro-batches of consecutive rows; each is prefilled through the stages,
    then every new token is run through them again, with each rank's cache of its own layers.
    The tokens equal single-process greedy ``generate`` (bigviz's, or transformers' with
    ``do_sample=False`` and the same ``eos_token_id``/``pad_token_id``: see
    :func:`generation_ids`). Every rank passes the same ``max_new_tokens``, ``microbatches``
    and EOS settings.

    Prompts of different lengths go in one batch as transformers' ``generate`` takes them:
    padded on the left with ``attention_mask`` (rank 0's, 0 for padding), as a tokenizer with
    ``padding_side="left"`` gives them; the mask travels with each micro-batch's prefill, every
    stage extends it by one per new token, and positions count tokens only. bigviz's own
    models (GPT, Llama) take no mask: their rows must be whole prompts of one length.

    Args:
        stage: this rank's :class:`~bigviz.distributed.StageBuild` (cut with ``split="wrap"``),
            or its stage module (``DecoderStage`` / ``HFStage``).
        prompt_ids: token ids ``(B, T)`` on rank 0, ``None`` elsewhere.
        max_new_tokens: tokens to add to each sequence.
        microbatches: micro-batches in flight (at most ``B``); as many as stages keeps every
            stage busy.
        attention_mask: ``(B, T)`` on rank 0, 1 for a token and 0 for left padding (``None``
            elsewhere, and where no row is padded).
        eos_token_id: a sequence that emits one of these stops: its later tokens are
            ``pad_token_id``, and a micro-batch whose sequences have all stopped leaves the
            ring (the output is as long as the longest micro-batch's). ``None``: exactly
            ``max_new_tokens`` new tokens.
        pad_token_id: what follows EOS (default: the first EOS token).
        group: the process group (default: the whole world), one rank per stage.

    Returns:
        A :class:`GenerateResult` (the tokens on rank 0).

    Raises:
        PipelineError: on every rank, before any tensor travels, when any rank's arguments
            are wrong (the prompt, counts, a stage that cannot keep a cache).
    """
    import torch.distributed as dist

    module = getattr(stage, "module", stage)
    ring = _Ring(dist.get_rank(group), dist.get_world_size(group), group, _device(module))
    problems = _check(ring.rank, prompt_ids, max_new_tokens, microbatches, attention_mask)
    if not hasattr(module, "step") or not hasattr(module, "new_cache"):
        problems.append(f"{type(module).__name__} keeps no cache: build the stage with split='wrap'")
    elif (module.first, module.last) != (ring.rank == 0, ring.rank == ring.size - 1):
        problems.append(
            f"rank {ring.rank} of {ring.size} holds a stage that is {'' if module.first else 'not '}the first and "
            f"{'' if module.last else 'not '}the last: give each rank its own stage (build_stage_module(..., rank))"
        )
    padded = ring.first and attention_mask is not None and not problems and not bool(attention_mask.all())
    if padded and not isinstance(module, HFStage):
        problems.append(
            f"{type(module).__name__} (bigviz's own model) takes no attention mask: give prompts of one length, "
            "without padding (run other lengths in separate calls), or a transformers checkpoint"
        )
    PipelineError.check(shared_problems(problems, group), "cannot generate across the stages; nothing was run")
    flag: list[Any] = [padded]
    dist.broadcast_object_list(flag, src=ring.peer(0), group=group)  # every rank: does a mask travel?
    eos = [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id or [])
    pad = pad_token_id if pad_token_id is not None else (eos[0] if eos else 0)
    loop = _Loop(module, ring, microbatches, eos, pad, masked=bool(flag[0]))
    with torch.no_grad():
        return loop.run(prompt_ids, max_new_tokens, attention_mask if padded else None)


def _device(module: torch.nn.Module) -> torch.device:
    tensor = next(iter([*module.parameters(), *module.buffers()]), None)
    return tensor.device if tensor is not None else torch.device("cpu")


class _Loop:
    """One rank's part of the ring: for each pass, for each micro-batch, receive, run, send."""

    def __init__(self, module: Any, ring: _Ring, microbatches: int, eos: list[int], pad: int, *, masked: bool) -> None:
        self.module, self.ring, self.m = module, ring, microbatches
        self.masks: list[Tensor | None] = [None] * microbatches  # each micro-batch's attention mask, when masked
        self.masked = masked
        self.eos, self.pad = torch.tensor(eos, dtype=torch.long, device=ring.device), pad
        self.caches = [module.new_cache() for _ in range(microbatches)]
        self.starts = [0] * microbatches  # positions each micro-batch's cache holds
        self.live = [True] * microbatches  # some sequence of the micro-batch has not stopped
        self.done: list[Tensor] = []  # rank 0: the sequences of each micro-batch that have stopped
        self.out: list[list[Tensor]] = []  # rank 0: each micro-batch's prompt, then its tokens
        self.sender = _Sender()
        self.busy = 0.0

    def run(
        self, prompt_ids: Tensor | None, max_new_tokens: int, attention_mask: Tensor | None = None
    ) -> GenerateResult:
        ring = self.ring
        if ring.first:
            assert prompt_ids is not None
            chunks = torch.tensor_split(prompt_ids.to(ring.device), self.m)  # (B_m, T) each
            self.out = [[c] for c in chunks]
            self.done = [torch.zeros(c.shape[0], dtype=torch.bool, device=ring.device) for c in chunks]
            if attention_mask is not None:
                self.masks = list(torch.tensor_split(attention_mask.to(ring.device, torch.long), self.m))
        start = time.perf_counter()
        for step in range(max_new_tokens):
            for mb in range(self.m):
                x = self._input(step, mb) if ring.first else _recv_tensor(ring.peer(ring.rank - 1), ring)
                if x is None or not self.live[mb]:  # a finished micro-batch: pass the news on
                    self._finish(mb)
                    continue
                if self.masked:
                    self._extend_mask(step, mb)
                y = self._run(x, mb)
                if not ring.last:
                    _send_tensor(self.sender, y, ring.peer(ring.rank + 1), ring)
                    if self.masked and step == 0:  # the mask follows the prefill's hidden states
                        _send_tensor(self.sender, self.masks[mb], ring.peer(ring.rank + 1), ring)
                    continue
                token = y[:, -1].argmax(dim=-1, keepdim=True)  # (B_m, 1): greedy
                if ring.first:
                    self._take(token, mb)
                else:
                    self.sender.send(token, ring.peer(0), ring.group)
        if ring.first and not ring.last:  # the last pass's tokens come back around the ring
            for mb in range(self.m):
                if self.live[mb]:
                    self._take(self._recv_token(mb), mb)
        self.sender.wait()
        wall = time.perf_counter() - start
        tokens = _join(self.out, self.pad) if ring.first else None
        nbytes = sum(cache_nbytes(c) for c in self.caches)
        return GenerateResult(tokens, nbytes, self.busy, wall, max_new_tokens, self.m, ring.rank, ring.size)

    def _input(self, step: int, mb: int) -> Tensor | None:
        """Rank 0: the prompt first, then the micro-batch's last token (back around the ring);
        ``None`` once its sequences have all stopped."""
        if step == 0:
            return self.out[mb][0]
        if not self.ring.last and self.live[mb]:
            self._take(self._recv_token(mb), mb)
        return self.out[mb][-1] if self.live[mb] else None

    def _extend_mask(self, step: int, mb: int) -> None:
        """The micro-batch's mask for this pass: the prompt's (from the previous stage, at the
        prefill), then one more token per step, as ``generate`` extends it."""
        if step == 0 and not self.ring.first:
            self.masks[mb] = _recv_tensor(self.ring.peer(self.ring.rank - 1), self.ring)
        elif step > 0:
            mask = self.masks[mb]
            assert mask is not None
            self.masks[mb] = torch.cat((mask, mask.new_ones(mask.shape[0], 1)), dim=1)

    def _recv_token(self, mb: int) -> Tensor:
        import torch.distributed as dist

        token = torch.empty(self.done[mb].shape[0], 1, dtype=torch.long, device=self.ring.device)
        dist.recv(token, self.ring.peer(self.ring.size - 1), group=self.ring.group)
        return token

    def _take(self, token: Tensor, mb: int) -> None:
        """Rank 0 keeps a micro-batch's new token (B_m, 1): after EOS a sequence gets padding,
        and a micro-batch whose sequences have all stopped leaves the ring (transformers' rule)."""
        if self.eos.numel():
            token = torch.where(self.done[mb][:, None], torch.full_like(token, self.pad), token)
            self.done[mb] |= torch.isin(token[:, 0], self.eos)
            self.live[mb] = not bool(self.done[mb].all())
        self.out[mb].append(token)

    def _run(self, x: Tensor, mb: int) -> Tensor:
        t0 = time.perf_counter()
        kwargs = {"attention_mask": self.masks[mb]} if self.masked else {}
        y = self.module.step(x, cache=self.caches[mb], start=self.starts[mb], **kwargs)
        self.starts[mb] += x.shape[1]
        self.busy += time.perf_counter() - t0
        return y

    def _finish(self, mb: int) -> None:
        """This micro-batch has left the ring: tell the next stage, once per pass."""
        self.live[mb] = False
        if not self.ring.last:
            _send_tensor(self.sender, None, self.ring.peer(self.ring.rank + 1), self.ring)


def _join(out: list[list[Tensor]], pad: int) -> Tensor:
    """Every micro-batch's prompt and tokens, as one ``(B, T + new)`` tensor; a micro-batch
    that stopped early is padded to the longest."""
    rows = [torch.cat(parts, dim=1) for parts in out]
    width = max(r.shape[1] for r in rows)
    rows = [torch.nn.functional.pad(r, (0, width - r.shape[1]), value=pad) for r in rows]
    return torch.cat(rows, dim=0)
