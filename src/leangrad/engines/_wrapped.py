"""Models wrapped by PyTorch's data-parallel engines.

``DistributedDataParallel`` averages gradients over processes in hooks that fire while
autograd runs the backward of *its own* forward; FSDP (``fully_shard``, and the older
``FullyShardedDataParallel``) also shards parameters and gathers them around each
forward. An engine that computes gradients some other way — forward-mode, recomputation
of blocks outside DDP's forward, per-layer hand-overs — would leave every process with its
own *local* gradient, silently. So :meth:`Engine.backward` refuses a wrapped model unless
the engine declares ``wrapped_models = True`` (plain backprop, whose backward is DDP's;
``checkpoint``, whose recomputation runs inside the wrapper's backward), and for those it
holds every ``on_grad`` call until the backward has returned, when DDP has averaged the
gradients (its post-accumulate hooks fire before the all-reduce finishes).

An engine that runs the model some other way than ``model(*inputs)`` (a prepared copy, a
sequence of segments) runs it *through* DDP's forward with :func:`through_ddp`, so DDP
prepares its reducer and its hooks average the gradients; on an FSDP2 model it calls the
root itself, and replaces a block's ``forward`` for one forward pass at most
(:func:`forward_replaced`), so FSDP's hooks on the block still run around it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any, cast

from torch import nn

from .._keywords import underlying

__all__ = ["DDP", "FSDP1", "FSDP2", "WRAPPED", "forward_replaced", "through_ddp", "wrapped_by"]

DDP = "DistributedDataParallel"
FSDP2 = "FSDP2 (fully_shard)"
FSDP1 = "FullyShardedDataParallel"

WRAPPED = (
    "{engine} on a {wrapper} model: {wrapper} averages gradients in hooks on autograd's "
    "backward of its own forward, which {engine} does not run, so each process would keep its "
    "own local gradient, silently; give the engine the unwrapped model ({unwrap}) and average "
    "after the step with leangrad.train.average_gradients(model.named_parameters(), ctx), or "
    "train through DDP with engine 'backprop' (leangrad train under torchrun does the former)"
)


def wrapped_by(model: nn.Module) -> tuple[str, str] | None:
    """``(wrapper, how to unwrap)`` when ``model`` is, or holds, a module wrapped by DDP or
    FSDP; ``None`` otherwise (at once when no process group exists, as every wrapper needs
    one: the module scan stays off a single process's hot path)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):  # no process group: no wrapper
        return None
    model = underlying(model)
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(model, DistributedDataParallel):
        return DDP, "ddp.module"
    try:
        from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
    except ImportError:  # a build without distributed support: nothing can be wrapped
        return None
    for m in model.modules():
        if isinstance(m, FSDPModule):
            return FSDP2, "the model before fully_shard, on one process"
        if isinstance(m, FullyShardedDataParallel):
            return FSDP1, "the model before wrapping, on one process"
    return None


@contextlib.contextmanager
def forward_replaced(module: nn.Module, forward: Callable[..., Any]) -> Iterator[None]:
    """``module.forward`` is ``forward`` inside the block, as it was after it (an instance
    attribute: ``module(...)`` still runs the module's hooks around it, and its class is
    left alone)."""
    d = module.__dict__
    had, old = "forward" in d, d.get("forward")
    d["forward"] = forward
    try:
        yield
    finally:
        if had:
            d["forward"] = old
        else:
            del d["forward"]


def through_ddp(ddp: nn.Module, forward: Callable[..., Any]) -> Callable[..., Any]:
    """A function of the inputs that runs ``forward`` as the forward of ``ddp.module``
    inside DDP's own ``ddp(*inputs)``: DDP syncs its buffers and prepares its reducer for
    the backward as for its module, whose hooks run around ``forward``."""

    inner = ddp.get_submodule("module")

    def run(*args: Any, **kwargs: Any) -> Any:
        with forward_replaced(inner, forward):
            return ddp(*args, **kwargs)

    return run


@contextlib.contextmanager
def gradient_sync(model: nn.Module, sync: bool) -> Iterator[None]:
    """Inside the block, a wrapped ``model`` reduces its gradients across processes only
    if ``sync`` (the last micro-batch of a step): DDP's ``no_sync()`` otherwise, FSDP2's
    ``set_requires_gradient_sync(False)`` (restored after). Gradients accumulate locally
    until the one reduction. A model nothing wraps: nothing changes."""
    wrapper = wrapped_by(model)
    if sync or wrapper is None:
        yield
        return
    inner = underlying(model)
    if wrapper[0] == DDP:
        with cast(Any, inner).no_sync():
            yield
        return
    if wrapper[0] == FSDP2 and hasattr(inner, "set_requires_gradient_sync"):
        cast(Any, inner).set_requires_gradient_sync(False)
        try:
            yield
        finally:
            cast(Any, inner).set_requires_gradient_sync(True)
        return
    yield
