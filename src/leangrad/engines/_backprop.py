"""``backprop``: plain reverse-mode autograd, the reference every engine is measured against."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from ._base import Engine, LossFn, OnGrad, PlanOffer, PlanOrder, StepResult, forward_loss
from ._catalog import register

__all__ = ["Backprop"]


@register("backprop")
class Backprop(Engine):
    """``loss_fn(model(*inputs)).backward()``.

    Stores every activation autograd saves (memory linear in depth), one
    backward pass (time about 2-3x a forward). ``on_grad`` is served by
    ``Tensor.register_post_accumulate_grad_hook``, so a per-parameter optimizer
    step runs during the backward pass.
    """

    exact = True
    autocast = True
    wrapped_models = True  # loss.backward() is DDP's/FSDP's own backward

    plan_offers = (PlanOffer("backprop", {}, PlanOrder.BACKPROP),)
    """Always: the reference every other candidate is measured against."""

    def __init__(self) -> None:
        super().__init__()

    def _backward(
        self,
        model: nn.Module,
        inputs: tuple[torch.Tensor, ...],
        loss_fn: LossFn,
        params: Mapping[str, nn.Parameter],
        on_grad: OnGrad | None,
    ) -> StepResult:
        loss = forward_loss(self.label, model, inputs, loss_fn)
        with grad_hooks(params, on_grad):
            loss.backward()
        return self._result(loss)


class grad_hooks:
    """Context manager: call ``on_grad(name, p)`` after autograd accumulates ``p.grad``."""

    def __init__(self, params: Mapping[str, nn.Parameter], on_grad: OnGrad | None) -> None:
        self.params = params
        self.on_grad = on_grad
        self.handles: list[torch.utils.hooks.RemovableHandle] = []

    def __enter__(self) -> None:
        if self.on_grad is None:
            return
        callback = self.on_grad
        for name, p in self.params.items():

            def hook(param: torch.Tensor, name: str = name) -> None:
                callback(name, param)  # type: ignore[arg-type]

            self.handles.append(p.register_post_accumulate_grad_hook(hook))

    def __exit__(self, *exc: object) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()
