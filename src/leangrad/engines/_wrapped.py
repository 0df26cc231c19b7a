"""Models wrapped by PyTorch's data-parallel engines (issue 32).

``DistributedDataParallel`` averages gradients over processes in hooks that fire while
autograd runs the backward of *its own* forward; FSDP (``fully_shard``, and the older
``FullyShardedDataParallel``) also shards parameters and gathers them around each
forward. An engine that computes gradients some other way — forward-mode, recomputation
of blocks outside DDP's forward, per-layer hand-overs — would leave every process with its
own *local* gradient, silently. So :meth:`Engine.backward` refuses a wrapped model unless
the engine declares ``wrapped_models = True`` (plain backprop, whose backward is DDP's), and
for those it holds every ``on_grad`` call until the backward has returned, when DDP has
averaged the gradients (its post-accumulate hooks fire before the all-reduce finishes).
"""

from __future__ import annotations

from torch import nn

__all__ = ["WRAPPED", "wrapped_by"]

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
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(model, DistributedDataParallel):
        return "DistributedDataParallel", "ddp.module"
    try:
        from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
    except ImportError:  # a build without distributed support: nothing can be wrapped
        return None
    for m in model.modules():
        if isinstance(m, FSDPModule):
            return "FSDP2 (fully_shard)", "the model before fully_shard, on one process"
        if isinstance(m, FullyShardedDataParallel):
            return "FullyShardedDataParallel", "the model before wrapping, on one process"
    return None
