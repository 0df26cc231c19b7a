"""Data-parallel training with ``torch.distributed``.

Under ``torchrun --nproc-per-node N`` (or any launcher that sets ``RANK``,
``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT``) every process holds the same
model (rank 0's initial weights are broadcast), takes its own shard of each
global batch, and gradients are averaged over processes before the optimizer
uses them — so the update equals one process's update on the combined batch.

- An engine whose backward is autograd's own (``wrapped_models``: backprop) trains
  through PyTorch's ``DistributedDataParallel`` (:func:`data_parallel`): bucketed
  all-reduces overlapping the backward.
- Every other engine computes its gradients outside DDP's hooks and hands each to
  ``on_grad`` when it is final: :class:`~leangrad.train._buckets.GradBuckets` averages
  them in buckets whose all-reduces overlap the rest of the backward, and with
  ``--step-per-layer`` steps each parameter once its bucket is averaged. Every process
  runs the same engine on the same model, so the hand-over order, and hence the order
  of the collectives, is the same on all of them.

Each rank draws its own random numbers (:func:`seed_per_rank`); ``--budget`` is planned
on rank 0 alone and broadcast (:func:`broadcast_object`).

Backend: NCCL when the model is on CUDA, gloo on CPU.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..engines._base import OnGrad

__all__ = [
    "DistContext",
    "any_process",
    "averaging_on_grad",
    "broadcast_object",
    "broadcast_parameters",
    "data_parallel",
    "gather_object",
    "init_distributed",
    "mean_and_any",
    "seed_per_rank",
]


@dataclasses.dataclass(frozen=True)
class DistContext:
    """Where this process stands in a data-parallel run.

    Attributes:
        rank: this process's index (0 on a single process).
        world_size: number of processes (1 on a single process).
        local_rank: index on this machine (``LOCAL_RANK``), for the CUDA device.
        backend: ``"gloo"``, ``"nccl"`` or ``None`` (single process).
    """

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    backend: str | None = None

    @property
    def enabled(self) -> bool:
        return self.world_size > 1


def init_distributed(device: torch.device) -> DistContext:
    """Join the process group described by the environment (torchrun's variables).

    A single process (no ``WORLD_SIZE`` or ``WORLD_SIZE=1``) gets a context with
    ``enabled == False`` and no process group. An existing process group is reused.
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1 and not dist.is_initialized():
        return DistContext()
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)  # NCCL collectives run on the current device
    if not dist.is_initialized():
        dist.init_process_group(backend=backend)
    return DistContext(
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        local_rank=int(os.environ.get("LOCAL_RANK", "0")),
        backend=dist.get_backend(),
    )


RANK_SEED_STRIDE = 1_000_003
"""Rank r > 0 draws from torch's generator seeded ``seed + r * RANK_SEED_STRIDE`` (rank 0
keeps ``seed``'s stream, so one process is unchanged): dropout masks and estimator samples
(RAD without its own ``seed``) then differ per rank, and averaging over ranks reduces the
estimator's variance as it should, reproducibly from ``seed``."""


def seed_per_rank(seed: int, ctx: DistContext) -> None:
    """Give this rank its own torch random stream (:data:`RANK_SEED_STRIDE`)."""
    if ctx.rank > 0:
        torch.manual_seed(seed + RANK_SEED_STRIDE * ctx.rank)


def gather_object(value: Any, ctx: DistContext) -> list[Any]:
    """Every rank's ``value``, in rank order, on every rank (``[value]`` on one process)."""
    if not ctx.enabled:
        return [value]
    out: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(out, value)
    return out


def broadcast_object(values: list[Any], ctx: DistContext) -> None:
    """Replace ``values``' items on every process by rank 0's (picklable objects)."""
    if ctx.enabled:
        dist.broadcast_object_list(values, src=0)


def data_parallel(model: nn.Module, ctx: DistContext) -> nn.Module:
    """``model`` wrapped in PyTorch's ``DistributedDataParallel`` for this process group
    (gradients all-reduced in buckets while the backward runs; rank 0's weights and
    buffers broadcast at construction)."""
    from torch.nn.parallel import DistributedDataParallel

    device = next(model.parameters()).device
    ids = [device.index if device.index is not None else ctx.local_rank] \
        if device.type == "cuda" else None  # fmt: skip
    return DistributedDataParallel(model, device_ids=ids)


def broadcast_parameters(model: nn.Module, ctx: DistContext) -> None:
    """Copy rank 0's parameters and buffers to every process (as DDP does at start)."""
    if not ctx.enabled:
        return
    with torch.no_grad():
        for t in [*model.parameters(), *model.buffers()]:
            dist.broadcast(t.data, src=0)


def averaging_on_grad(ctx: DistContext, then: OnGrad | None) -> OnGrad:
    """An ``on_grad`` that averages the handed-over gradient (one blocking all-reduce),
    then calls ``then``. :class:`GradBuckets` does the same in overlapping buckets."""

    def on_grad(name: str, p: nn.Parameter) -> None:
        if ctx.enabled and p.grad is not None:
            dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)
            p.grad.div_(ctx.world_size)
        if then is not None:
            then(name, p)

    return on_grad


def mean_and_any(values: torch.Tensor, flag: bool,
                 ctx: DistContext) -> tuple[torch.Tensor, bool]:  # fmt: skip
    """The means over processes of ``values`` (each process's losses of the same steps) and
    :func:`any_process` of ``flag`` (a stop request), in one all-reduce."""
    if not ctx.enabled:
        return values.detach(), flag
    v = torch.cat([values.detach().reshape(-1).to(torch.float64),
                   torch.tensor([float(flag)], dtype=torch.float64, device=values.device)])
    dist.all_reduce(v, op=dist.ReduceOp.SUM)
    return (v[:-1] / ctx.world_size).to(values.dtype), bool(v[-1].item() > 0)


def any_process(flag: bool, ctx: DistContext) -> bool:
    """True on every process when ``flag`` is true on any (e.g. one received SIGINT), so
    all stop at the same step and no collective is left waiting."""
    if not ctx.enabled:
        return flag
    t = torch.tensor([float(flag)], device="cuda" if ctx.backend == "nccl" else "cpu")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def barrier(ctx: DistContext) -> None:
    """Wait for every process (no-op on one)."""
    if ctx.enabled:
        dist.barrier()
