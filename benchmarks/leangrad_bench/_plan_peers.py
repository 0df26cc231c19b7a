"""What a PyTorch user can do by hand to fit a training step into less memory: the peers
of the ``plan`` suite, each a whole training step (backward and SGD step).

- ``checkpoint_sequential(s)`` over the model's blocks, ``torch.utils.checkpoint`` around
  every block, selective checkpointing of every block (matmuls and convolutions saved,
  the rest recomputed);
- each of those, and plain backprop, also with the optimizer stepped inside the backward
  pass by ``Tensor.register_post_accumulate_grad_hook`` (PyTorch's "optimizer step in
  backward" recipe: each gradient freed once used);
- ``torch.compile`` with ``torch._functorch.config.activation_memory_budget`` — run in a
  fresh process by :mod:`leangrad_bench._worker`, since inductor's buffers are
  invisible to the tracker and need the resident-set measurement.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    checkpoint_sequential,
    create_selective_checkpoint_contexts,
)

from ._models import LossFn, Parts, build

__all__ = [
    "HOOKED",
    "SUITE_MODELS",
    "Step",
    "make_sgd",
    "optimizer_in_backward",
    "peers",
    "workload",
]

Step = Callable[[], None]
HOOKED = " + optimizer in backward"
"""Suffix of a peer whose optimizer steps inside the backward pass (gradient hooks)."""
SUITE_MODELS = {"resnet": "blocks_resnet", "gpt": "blocks_gpt", "mlp": "dropout_mlp"}
"""The ``blocks`` and ``plan`` suites' model keys (their suite files' tables, their
records' series) -> registry names (:data:`leangrad_bench._models.MODELS`)."""
_SAVE = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,
         torch.ops.aten.convolution.default}  # fmt: skip


def make_sgd(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    """The suite's optimizer: SGD with momentum (state made by the warm-up step)."""
    return torch.optim.SGD(params, lr=1e-3, momentum=0.9)


def workload(kind: str, size: dict[str, Any]) -> tuple[nn.Module, torch.Tensor, LossFn, Parts]:
    """The ``blocks`` and ``plan`` suites' model ``kind`` (:data:`SUITE_MODELS`) at
    ``size``: ``(model, inputs, loss_fn, (stem, blocks, head))``, the same for the same
    size (:func:`leangrad_bench._models.build`)."""
    wl = build(SUITE_MODELS.get(kind, kind), size)
    assert isinstance(wl.inputs, torch.Tensor) and wl.parts is not None
    return wl.model, wl.inputs, wl.loss_fn, wl.parts


def optimizer_in_backward(model: nn.Module) -> None:
    """Step each parameter's own SGD as soon as autograd has accumulated its gradient, then
    drop the gradient (``register_post_accumulate_grad_hook``; the hooks stay)."""
    opts = {p: make_sgd([p]) for p in model.parameters() if p.requires_grad}

    def hook(p: torch.Tensor) -> None:
        opts[p].step()  # type: ignore[index]
        p.grad = None

    for p in opts:
        p.register_post_accumulate_grad_hook(hook)


def _policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    del ctx, args, kwargs
    return CheckpointPolicy.MUST_SAVE if op in _SAVE else CheckpointPolicy.PREFER_RECOMPUTE


def _sequential(seq: nn.Sequential, segments: int, stem: Any, head: Any) -> torch.Tensor:
    """``torch.utils.checkpoint.checkpoint_sequential`` over the blocks, stem and head plain."""
    return head(checkpoint_sequential(seq, segments, stem(), use_reentrant=False))


def peers(
    parts: Any,
    loss_fn: Callable[..., torch.Tensor],
    segments: list[int],
    *,
    optimizer: torch.optim.Optimizer | None,
    suffix: str = "",
) -> dict[str, Step]:
    """Training steps by hand over ``parts``; ``optimizer`` is stepped after backward
    (``None``: the model's own hooks step it, see :func:`optimizer_in_backward`)."""
    stem, blocks, head = parts
    seq = nn.Sequential(*blocks)
    selective = functools.partial(create_selective_checkpoint_contexts, _policy)

    def train(forward: Callable[[], torch.Tensor]) -> Step:
        def step() -> None:
            loss_fn(forward()).backward()
            if optimizer is not None:
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)

        return step

    def wrapped(wrap: Callable[[nn.Module, torch.Tensor], torch.Tensor]) -> Step:
        def forward() -> torch.Tensor:
            h = stem()
            for i, b in enumerate(blocks):
                h = b(h) if i == len(blocks) - 1 else wrap(b, h)
            return head(h)

        return train(forward)

    out: dict[str, Step] = {
        "backprop": wrapped(lambda b, h: b(h)),
        "torch per-block": wrapped(lambda b, h: checkpoint(b, h, use_reentrant=False)),
        "torch selective": wrapped(lambda b, h: checkpoint(
            b, h, use_reentrant=False, context_fn=selective)),
    }  # fmt: skip
    for s in segments:
        if s < len(blocks):
            run = functools.partial(_sequential, seq, s, stem, head)
            out[f"checkpoint_sequential({s})"] = train(run)
    return {name + suffix: step for name, step in out.items()}
