"""Shared plumbing of the forward-mode engines: the loss as a pure function of parameters."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import torch
from torch import nn
from torch.func import functional_call, jvp

from ._base import LossFn, check_loss, run_forward

__all__ = ["BatchedBuffers", "jvp_with_buffers", "pure_loss"]


class BatchedBuffers:
    """Per-direction copies of the module's buffers, so in-place updates (BatchNorm
    running statistics) work under ``vmap`` and are committed to the module once."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.buffers = dict(model.named_buffers())
        self.committed = False

    def batched(self, k: int) -> dict[str, torch.Tensor]:
        return {n: b.unsqueeze(0).expand(k, *b.shape).clone() for n, b in self.buffers.items()}

    def commit(self, batched: dict[str, torch.Tensor]) -> None:
        """Copy the first direction's buffer values into the module, once per step."""
        if self.committed:
            return
        with torch.no_grad():
            for n, b in self.buffers.items():
                b.copy_(batched[n][0])
        self.committed = True


def pure_loss(
    engine: str,
    model: nn.Module,
    inputs: tuple[torch.Tensor, ...],
    loss_fn: LossFn,
    params: dict[str, nn.Parameter],
) -> Callable[[dict[str, torch.Tensor], dict[str, torch.Tensor]], torch.Tensor]:
    """``f(param_values, buffer_values) -> loss``, a pure function for ``torch.func``."""
    frozen = {n: p.detach() for n, p in model.named_parameters() if n not in params}

    def f(values: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor]) -> torch.Tensor:
        state = {**frozen, **values, **buffers}
        out = run_forward(engine, lambda *xs: functional_call(model, state, xs), inputs)
        return check_loss(loss_fn(out), needs_graph=False)

    return f


def jvp_with_buffers(
    fn: Callable[[Any, dict[str, torch.Tensor]], torch.Tensor],
    primal: Any,
    tangent: Any,
    buffers: dict[str, torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """``jvp`` of ``fn(primal, buffers)`` along ``tangent``; also returns the updated buffers.

    The buffers are cloned *inside* the transformed function: a module that
    updates them in place (BatchNorm's running statistics in training mode)
    may not mutate a tensor captured from outside ``torch.func.jvp``. The
    updated copies come back as the third result, for :meth:`BatchedBuffers.commit`.
    """

    def g(p: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        local = {n: b.clone() for n, b in buffers.items()}
        loss = fn(p, local)
        return loss, {n: b.detach() for n, b in local.items()}

    value, dloss, updated = cast(Any, jvp(g, (primal,), (tangent,), has_aux=True))  # 3 with aux
    return value, dloss, updated
