"""``revbackprop``: reversible backpropagation — recompute inputs with ``inverse``.

Gomez et al., "The reversible residual network" (NeurIPS 2017); the RevBackprop
baseline of Moonwalk v1 (section 4, Table 1). The forward pass stores nothing
for the chain; the backward pass walks the chain in reverse, rebuilding each
layer's input from its output with ``layer.inverse`` and running that layer's
vjp (input and parameters) on the spot.

Trade-off: memory O(M_x + M_θ) like forward-mode, time ≈ backprop plus one
inverse per layer. The reconstructed inputs carry rounding error that grows
with depth (invertible layers need not be well conditioned), so gradients
drift from autograd's — which the ``moonwalk-v1-stability`` suite measures.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from ..layers._base import ChainLayer
from ..layers._chain import Chain
from ._base import LossFn, OnGrad, PlanOffer, PlanOrder, StepResult, run_forward
from ._catalog import register
from ._chain_run import (
    ChainEngine,
    GradSink,
    StemRun,
    chain_and_layers,
    head_backward,
    refuse_random_layers,
)

__all__ = ["RevBackprop"]


@register("revbackprop")
class RevBackprop(ChainEngine):
    """Reversible backprop on a :class:`~leangrad.Chain` of invertible layers."""

    exact = True
    plan_offers = (PlanOffer("revbackprop", {}, PlanOrder.CHAIN + 1),)
    """On a :class:`~leangrad.Chain` (after moonwalk's offers)."""

    def __init__(self) -> None:
        super().__init__()

    def _layers(self, model: nn.Module) -> tuple[Chain, list[ChainLayer]]:
        return chain_and_layers(model, self.label, need="invertible")

    def _backward(
        self,
        model: nn.Module,
        inputs: tuple[torch.Tensor, ...],
        loss_fn: LossFn,
        params: Mapping[str, nn.Parameter],
        on_grad: OnGrad | None,
    ) -> StepResult:
        chain, layers = self._layers(model)
        refuse_random_layers(self.label, layers)
        sink = GradSink(params, on_grad)
        stem = StemRun(chain, inputs, self.label)
        x = stem.take()
        with torch.no_grad():
            for layer in layers:
                x = run_forward(self.label, layer, (x,))
        loss, h = head_backward(self.label, chain, x, loss_fn, sink)
        y = x
        for layer in reversed(layers):
            with torch.no_grad():
                x = layer.inverse(y)
            local = sink.trainable(layer)
            with torch.enable_grad():
                xg = x.detach().requires_grad_(True)
                out = layer(xg)
                grads = torch.autograd.grad(out, [xg] + [p for _, p in local], h, allow_unused=True)
            h = grads[0]
            got = {n: g for (n, _), g in zip(local, grads[1:], strict=True) if g is not None}
            sink.deliver(layer, got)
            y = x
        stem.backward(h, sink)
        return self._result(loss)
