"""A loss whose ``.backward()`` hands over gradients an engine has already computed.

Training stacks own the backward call: Hugging Face's ``Trainer`` divides the loss for
gradient accumulation and calls ``accelerator.backward(loss)``, which scales it for mixed
precision; Lightning calls ``loss.backward()`` through its precision plugin; DDP averages
the gradients in hooks on each parameter's gradient accumulation. An engine computes the
gradients in its own way, inside ``engine.backward``. :func:`surrogate_loss` joins the
two: it runs the engine at once, holds the gradients it made aside (``.grad`` is left as
it was), and returns the loss as a tensor whose backward passes ``g × gradient`` to each
parameter through autograd, ``g`` being whatever the stack multiplied the loss by. So
every scaling the stack applies to the loss applies to the gradients, they accumulate into
``.grad`` as autograd's own do (``None`` stays ``None`` for a parameter the engine gave no
gradient), and DDP's hooks see them: under DDP the surrogate is made inside DDP's forward
(:func:`~leangrad.engines._wrapped.through_ddp`), so its reducer averages them as it would
a plain step's. The engine runs on the module DDP wraps.

Cost: the gradients live aside from the engine's return to the backward call — the same
bytes ``.grad`` would hold — and one in-place multiplication each.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from .. import _errors as errors
from ._wrapped import DDP, through_ddp, wrapped_by

__all__ = ["held_step", "surrogate_loss"]

HANDED_TWICE = (
    "this surrogate loss handed its gradients over already: call backward on it once "
    "(make a new one each step with leangrad.surrogate_loss)"
)


NOT_UNDER = (
    "surrogate_loss runs under DDP or on one process; a model wrapped by {wrapper} steps "
    "with engine.backward on the wrapped model instead"
)
NO_RESULT = (
    "surrogate_loss needs the step's loss: {kind}.backward returned nothing (give the "
    "engine itself, or a plan's .engine)"
)


class _Held:
    """The gradients one engine step made, until a backward takes them."""

    def __init__(self, grads: list[torch.Tensor | None]) -> None:
        self.grads: list[torch.Tensor | None] | None = grads

    def take(self) -> list[torch.Tensor | None]:
        if self.grads is None:
            raise errors.EngineInputError(HANDED_TWICE)
        grads, self.grads = self.grads, None
        return grads


class _HandOver(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, loss: torch.Tensor, held: _Held, *params: torch.Tensor) -> torch.Tensor:
        del params  # inputs only so that autograd routes a gradient to each
        ctx.held = held
        return loss.detach().clone()

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        out: list[torch.Tensor | None] = []
        for grad in ctx.held.take():
            out.append(None if grad is None else grad.mul_(g.to(grad.dtype)))
        return (None, None, *out)


def surrogate_loss(
    engine: Any,
    model: nn.Module,
    inputs: torch.Tensor | Sequence[torch.Tensor] | Mapping[str, Any],
    loss_fn: Callable[[Any], torch.Tensor],
) -> torch.Tensor:
    """Run ``engine`` on one step now; return its loss as a tensor whose ``backward()``
    adds the step's gradients to ``.grad`` (times what the loss was scaled by on the way).

    Args:
        engine: a leangrad engine (or a plan's ``engine``).
        model: the model, or the model wrapped by DDP.
        inputs, loss_fn: as for ``engine.backward`` (inputs may be a mapping).

    Returns:
        A 0-d tensor equal to the loss, which requires grad. Call backward on it once.
    """
    return held_step(engine, model, inputs, loss_fn)[0]


def held_step(
    engine: Any,
    model: nn.Module,
    inputs: torch.Tensor | Sequence[torch.Tensor] | Mapping[str, Any],
    loss_fn: Callable[[Any], torch.Tensor],
) -> tuple[torch.Tensor, Any]:
    """:func:`surrogate_loss` and the engine's :class:`~leangrad.StepResult`."""

    wrapper = wrapped_by(model)
    if wrapper is not None and wrapper[0] != DDP:
        raise errors.EngineInputError(NOT_UNDER.format(wrapper=wrapper[0]))
    inner = model.get_submodule("module") if wrapper is not None else model
    params = [p for p in inner.parameters() if p.requires_grad]
    aside = [p.grad for p in params]
    for p in params:
        p.grad = None
    try:
        result = engine.backward(inner, inputs, loss_fn)
        made = [p.grad for p in params]
    finally:
        for p, g in zip(params, aside, strict=True):
            p.grad = g
    if result is None:
        raise errors.EngineInputError(NO_RESULT.format(kind=type(engine).__name__))
    held = _Held(made)

    def hand_over(*_: Any) -> torch.Tensor:
        out: torch.Tensor = _HandOver.apply(result.loss, held, *params)
        return out

    if wrapper is not None:
        return through_ddp(model, hand_over)(), result
    return hand_over(), result
