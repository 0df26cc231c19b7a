"""Fragments of a block with training-mode BatchNorm, exact.

BatchNorm in training mode normalises with the batch's statistics, so a fragment of the
batch run on its own would use other statistics; and its backward reduces over the whole
batch. Both are kept exact:

- **Forward.** The block runs whole (without saving anything, as checkpointing's
  forward); each BatchNorm call's statistics — the mean and inverse standard deviation its
  kernel normalised with — are kept (a few numbers per channel), and the running
  statistics advance there, once.
- **Recomputation.** Each fragment is recomputed with every training-mode BatchNorm
  replaced by a normalisation with those *frozen* statistics (:class:`_FrozenBN`).
- **Backward.** With ``x̂`` the normalised input and ``M`` the number of values per
  channel, BatchNorm's input gradient is ``γ·invstd·(dy − Σdy/M − x̂·Σ(dy·x̂)/M)``: it needs
  two whole-batch sums of its output gradient. They are gathered in passes over the
  fragments: a BatchNorm's sums can be gathered once the sums of every BatchNorm after it
  (on its way to the block's output) are known, so a pass asks autograd for the output
  gradients of exactly those BatchNorms (nothing further is differentiated). A ResNet
  basic block takes two such passes (``bn2`` and the shortcut's, then ``bn1``) and a last
  one that differentiates everything with all sums known.

Each pass recomputes the fragments, so the block's recomputation runs ``passes + 1``
times (three on a ResNet basic block against plain checkpointing's one): this buys
``1/k`` of a block's internals at a price in time, and ``leangrad.plan`` weighs it.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from .._contract import graph_nodes

__all__ = ["BnStats", "bn_buffers", "capture_stats", "dependencies", "frozen_stats", "gather_sums",
           "is_bn_only", "schedule"]

_BN_SIGNATURE = inspect.signature(F.batch_norm)
_CALL = "leangrad_batchnorm_call"  # a recomputed BatchNorm call's index, in its node's metadata


def is_bn_only(modules: Sequence[nn.Module]) -> bool:
    """Whether the only modules of ``modules`` that couple a batch are BatchNorm layers this
    module can freeze (not ``SyncBatchNorm``, whose statistics span processes)."""
    bns = [m for root in modules for m in root.modules()
           if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.training]  # fmt: skip
    return bool(bns) and not any(isinstance(m, nn.SyncBatchNorm) for m in bns)


def bn_buffers(modules: Sequence[nn.Module]) -> set[int]:
    """Ids of the training-mode BatchNorms' buffers (their running statistics and counters:
    they advance in the forward, as under autograd)."""
    return {id(b) for root in modules for m in root.modules()
            if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.training
            for b in m.buffers(recurse=False)}  # fmt: skip


@dataclasses.dataclass
class BnStats:
    """One training-mode BatchNorm call of a block's forward: its statistics, and the
    whole-batch sums of its output gradient once gathered."""

    mean: torch.Tensor
    invstd: torch.Tensor
    count: int  # values per channel in the whole batch (M)
    sums: tuple[torch.Tensor, torch.Tensor] | None = None  # (Σdy, Σdy·x̂)


def _bound(args: tuple[Any, ...], kwargs: dict[str, Any]) -> inspect.BoundArguments:
    b = _BN_SIGNATURE.bind(*args, **kwargs)
    b.apply_defaults()
    return b


def _channel_shape(x: torch.Tensor) -> tuple[int, ...]:
    return (1, x.shape[1], *([1] * (x.dim() - 2)))


def _reduced(x: torch.Tensor) -> list[int]:
    return [0, *range(2, x.dim())]


class _BatchNormMode(TorchFunctionMode):
    """Hands every training-mode ``F.batch_norm`` call, its arguments bound by name, to
    :meth:`batch_norm`; every other call runs as it is."""

    def __torch_function__(self, func: Callable[..., Any], types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:  # fmt: skip
        kwargs = kwargs or {}
        if func is not F.batch_norm:
            return func(*args, **kwargs)
        b = _bound(args, kwargs).arguments
        if not b["training"]:
            return func(*args, **kwargs)
        return self.batch_norm(b)

    def batch_norm(self, b: dict[str, Any]) -> torch.Tensor:
        raise NotImplementedError


class capture_stats(_BatchNormMode):
    """Run under it, every training-mode ``F.batch_norm`` runs as PyTorch's own kernel
    (``torch.native_batch_norm``: the same output, running statistics updated once) and
    its statistics are appended to :attr:`stats`."""

    def __init__(self) -> None:
        super().__init__()
        self.stats: list[BnStats] = []

    def batch_norm(self, b: dict[str, Any]) -> torch.Tensor:
        x = b["input"]
        out, mean, invstd = torch.native_batch_norm(
            x, b["weight"], b["bias"], b["running_mean"], b["running_var"], True,
            b["momentum"], b["eps"])  # fmt: skip
        self.stats.append(BnStats(mean, invstd, x.numel() // x.shape[1]))
        return out


class frozen_stats(_BatchNormMode):
    """Run under it, the ``i``-th training-mode ``F.batch_norm`` call normalises with
    ``stats[i]`` (:class:`_FrozenBN`) and updates no running statistic; :attr:`seen` keeps
    each call's ``(input, output)`` for :func:`gather_sums`.

    A BatchNorm whose output the block then overwrites in place (``nn.ReLU(inplace=True)``,
    timm's ``BatchNormAct2d``) would leave :attr:`seen` holding the activation's output, and
    the sums would be of the wrong gradient: calls in ``clone`` (found by
    :meth:`written_in_place` on an earlier run) hand the block a copy, so the output kept
    stays BatchNorm's — the same bytes the block holds without ``inplace``."""

    def __init__(self, stats: Sequence[BnStats], *, clone: frozenset[int] = frozenset()) -> None:
        super().__init__()
        self.stats = stats
        self.clone = clone
        self.seen: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._versions: list[int] = []

    def written_in_place(self) -> frozenset[int]:
        """The calls whose output an in-place op has overwritten since it was made."""
        return frozenset(i for i, ((_, out), v) in enumerate(zip(self.seen, self._versions,
                                                                 strict=True))
                         if out._version != v)  # fmt: skip

    def batch_norm(self, b: dict[str, Any]) -> torch.Tensor:
        i = len(self.seen)
        if i >= len(self.stats):
            raise RuntimeError(
                "internal error: a recomputed block called BatchNorm more often than its "
                "forward did; please report this"
            )
        x = b["input"]
        out = _FrozenBN.apply(x, b["weight"], b["bias"], self.stats[i])
        self.seen.append((x, out))
        self._versions.append(out._version)
        return out.clone() if i in self.clone else out


class _FrozenBN(torch.autograd.Function):
    """BatchNorm with the whole batch's statistics given: ``(x − mean)·invstd·γ + β``; its
    backward adds the whole-batch terms from the gathered sums."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor | None,
                bias: torch.Tensor | None, st: BnStats) -> torch.Tensor:  # fmt: skip
        shape = _channel_shape(x)
        xhat = (x - st.mean.view(shape)) * st.invstd.view(shape)
        ctx.save_for_backward(x, weight)
        ctx.st = st
        out = xhat
        if weight is not None:
            out = out * weight.view(shape)
        if bias is not None:
            out = out + bias.view(shape)
        return out

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> Any:
        x, weight = ctx.saved_tensors
        st: BnStats = ctx.st
        if st.sums is None:
            raise RuntimeError(
                "internal error: a BatchNorm's input gradient was needed before its "
                "whole-batch sums were gathered; please report this"
            )
        shape = _channel_shape(x)
        xhat = (x - st.mean.view(shape)) * st.invstd.view(shape)
        dims = _reduced(x)
        s1, s2 = st.sums
        dx = None
        if ctx.needs_input_grad[0]:
            scale = st.invstd if weight is None else st.invstd * weight
            dx = (dy - (s1 / st.count).view(shape) - xhat * (s2 / st.count).view(shape))
            dx = dx * scale.view(shape)
        dw = (dy * xhat).sum(dims) if ctx.needs_input_grad[1] else None
        db = dy.sum(dims) if ctx.needs_input_grad[2] else None
        return dx, dw, db, None


def dependencies(seen: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> list[set[int]]:
    """Per BatchNorm call, the calls after it on its way to the block's output (whose sums
    its own output gradient needs): ``deps[i]`` holds ``j`` when call ``i``'s output feeds
    call ``j``'s input."""
    for i, (_, out) in enumerate(seen):  # marked on the C++ node: wrappers may differ
        if out.grad_fn is not None:
            _metadata(out.grad_fn)[_CALL] = i
    deps: list[set[int]] = [set() for _ in seen]
    for j, (_, out) in enumerate(seen):
        if out.grad_fn is None:
            continue
        for node in graph_nodes(n for n, _ in out.grad_fn.next_functions):
            call = _metadata(node).get(_CALL)
            if call is not None:
                deps[call].add(j)
    return deps


def _metadata(node: Any) -> dict[str, Any]:
    """A graph node's metadata dict, kept on the C++ node (torch's stubs call it a method; it
    is a property)."""
    meta: dict[str, Any] = node.metadata
    return meta


def gather_sums(stats: Sequence[BnStats], wanted: Sequence[int],
                seen: Sequence[tuple[torch.Tensor, torch.Tensor]],
                outs: Sequence[torch.Tensor], grads: Sequence[torch.Tensor]) -> None:  # fmt: skip
    """Add one fragment's ``Σdy`` and ``Σdy·x̂`` to ``stats[i].sums`` for each ``i`` in
    ``wanted``, differentiating only as far as those calls' outputs."""
    live = [i for i in wanted if seen[i][1].requires_grad]
    got: Sequence[torch.Tensor | None] = ()
    if live and outs:
        got = torch.autograd.grad(list(outs), [seen[i][1] for i in live], list(grads),
                                  allow_unused=True)  # fmt: skip
    by_call = dict(zip(live, got, strict=True))
    for i in wanted:
        x, _ = seen[i]
        st = stats[i]
        dy = by_call.get(i)
        if dy is None:  # nothing flows from this call to the output
            zero = torch.zeros_like(st.mean)
            st.sums = st.sums or (zero, zero.clone())
            continue
        shape = _channel_shape(x)
        xhat = (x.detach() - st.mean.view(shape)) * st.invstd.view(shape)
        dims = _reduced(x)
        s1, s2 = dy.sum(dims), (dy * xhat).sum(dims)
        st.sums = (s1, s2) if st.sums is None else (st.sums[0] + s1, st.sums[1] + s2)


def schedule(deps: Sequence[set[int]]) -> list[list[int]]:
    """The BatchNorm calls to gather per pass: each call once every call it depends on has
    its sums (:func:`dependencies`)."""
    known: set[int] = set()
    out: list[list[int]] = []
    while len(known) < len(deps):
        ready = [i for i in range(len(deps)) if i not in known and deps[i] <= known]
        if not ready:  # a cycle cannot happen in a graph; refuse rather than loop
            raise RuntimeError("internal error: BatchNorm calls depend on each other in a cycle")
        out.append(ready)
        known.update(ready)
    return out
