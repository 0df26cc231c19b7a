"""Gradients averaged over processes in buckets, while the engine's backward runs.

An engine that is not autograd's own backward (forward-mode, Moonwalk, recomputation
outside DDP's forward, per-layer optimizer steps) cannot use DDP's reducer. It hands each
gradient to ``on_grad`` the moment it is final instead; :class:`GradBuckets` packs those
into buckets of about :data:`BUCKET_BYTES` (DDP's default ``bucket_cap_mb``) and starts
one asynchronous all-reduce per full bucket, so the communication overlaps the rest of the
backward, as DDP's reducer does (Li et al., "PyTorch Distributed: Experiences on
Accelerating Data Parallel Training", VLDB 2020, section 3.2.3) — never one blocking
all-reduce per parameter after the fact.

Each bucket is flattened into one buffer (one collective for many small tensors), summed,
divided by the number of processes and copied back into the ``.grad`` it came from; then
``then(name, p)`` runs for each of its parameters (the per-layer optimizer step, which
frees the gradient). With ``then`` at most two buckets are in flight, so per-layer
stepping keeps its saving up to two buckets of gradients.

Every process runs the same engine on the same model, so the hand-over order, the
buckets and hence the collectives are the same on all of them. A parameter that has no
gradient on a step is left ``None`` (as one process leaves it); the set of parameters with
gradients must be the same on every process, as DDP requires without
``find_unused_parameters``.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn

from ..engines._base import OnGrad
from ._distributed import DistContext

__all__ = ["BUCKET_BYTES", "GradBuckets", "average_gradients"]

BUCKET_BYTES = 25 * 2**20
"""Bytes of gradient per all-reduce (DDP's default ``bucket_cap_mb=25``)."""

_Item = tuple[str, nn.Parameter]


class GradBuckets:
    """An ``on_grad`` that averages gradients over processes in overlapping buckets.

    Use :meth:`on_grad` as the engine's ``on_grad``, then call :meth:`finish` once the
    backward has returned: it hands over what the engine did not, sends the last bucket
    and waits for every one, after which every ``.grad`` is the average over processes.
    """

    def __init__(self, ctx: DistContext, *, then: OnGrad | None = None,
                 bucket_bytes: int = BUCKET_BYTES) -> None:  # fmt: skip
        self.ctx, self.then, self.cap = ctx, then, bucket_bytes
        self._open: list[_Item] = []
        self._bytes = 0
        self._flight: deque[tuple[tuple[dist.Work, torch.Tensor] | None, list[_Item]]] = deque()
        self._seen: set[int] = set()

    def on_grad(self, name: str, p: nn.Parameter) -> None:
        """Take ``p``'s final gradient for this step; start its bucket's all-reduce when
        the bucket is full."""
        if p.grad is None or id(p) in self._seen:
            return
        self._seen.add(id(p))
        if self._open and not _same_kind(self._open[0][1].grad, p.grad):  # type: ignore[arg-type]
            self._send()  # one dtype and device per buffer
        self._open.append((name, p))
        self._bytes += p.grad.numel() * p.grad.element_size()
        if self._bytes >= self.cap:
            self._send()

    def finish(self, params: Iterable[_Item] = ()) -> None:
        """Hand over the gradients in ``params`` the engine did not (in name order), send
        the last bucket and wait for all; ready for the next step."""
        for name, p in sorted(params, key=lambda item: item[0]):
            self.on_grad(name, p)
        self._send()
        while self._flight:
            self._complete()
        self._seen.clear()

    def _send(self) -> None:
        if not self._open:
            return
        items, self._open, self._bytes = self._open, [], 0
        sent = None
        if self.ctx.enabled:  # one process: nothing to average, nothing to copy
            flat = torch.cat([p.grad.reshape(-1) for _, p in items])  # type: ignore[union-attr]
            sent = (dist.all_reduce(flat, op=dist.ReduceOp.SUM, async_op=True), flat)
        self._flight.append((sent, items))
        if self.then is not None:
            while len(self._flight) > 2:  # per-layer steps: bounded gradients in flight
                self._complete()

    def _complete(self) -> None:
        sent, items = self._flight.popleft()
        if sent is not None:
            work, flat = sent
            work.wait()
            flat.div_(self.ctx.world_size)
            at = 0
            for _, p in items:
                g = p.grad
                assert g is not None
                g.copy_(flat[at : at + g.numel()].view_as(g))
                at += g.numel()
        if self.then is not None:
            for name, p in items:
                self.then(name, p)


def _same_kind(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.device == b.device


def average_gradients(params: Iterable[_Item], ctx: DistContext) -> None:
    """All-reduce and average every ``p.grad`` after the fact (a missing one counts as
    zeros, so processes that disagree on which parameters have gradients still match), in
    buckets of :data:`BUCKET_BYTES` in name order: the recipe for a model given to an
    engine unwrapped. Inside a step, :class:`GradBuckets` overlaps the same with the
    engine's backward."""
    if not ctx.enabled:
        return
    items = list(params)
    for _, p in items:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    GradBuckets(ctx).finish(items)
