"""``forward``: the exact gradient by forward-mode AD, one parameter direction at a time.

The "Forward" baseline of Moonwalk v1 (Table 1, section 4): each parameter
coordinate θ_j is a tangent direction e_j, and one jvp gives ∂L/∂θ_j. No
activation is stored, so memory does not grow with depth, but the time grows
with the number of parameters times the cost of a forward pass. Directions are
batched with ``torch.func.vmap`` in chunks so that memory stays bounded.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.func import jvp, vmap

from ..measure._memory import FORWARD_END, mark
from ._base import Engine, LossFn, OnGrad, StepResult, accumulate_grad
from ._functional import BatchedBuffers, pure_loss
from ._registry import register

__all__ = ["Forward"]

BAD_CHUNK = "{name} must be a positive int, got {value!r}"


@register("forward")
class Forward(Engine):
    """Exact gradients from forward-mode AD: one jvp per parameter coordinate.

    Args:
        chunk_size: most tangent directions pushed through the model at once
            (``vmap``). Peak memory grows about linearly with it (each direction
            carries its own tangent activations); on one CPU thread, 8 to 256
            ran within 25% of each other in time, so the default is small.
        chunk_bytes: cap on the bytes of one chunk's tangents; the chunk shrinks
            for large parameters so memory stays bounded whatever the layer size.

    Trade-off: memory O(1) in depth (nothing is stored for a backward pass);
    time O(P) forward passes for P parameters — the slow exact baseline.
    ``on_grad`` is called for each parameter as soon as all its coordinates are done.
    """

    exact = True

    def __init__(self, *, chunk_size: int = 16, chunk_bytes: int = 32 * 2**20) -> None:
        for name, value in (("chunk_size", chunk_size), ("chunk_bytes", chunk_bytes)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(BAD_CHUNK.format(name=name, value=value))
        super().__init__()
        self.chunk_size = chunk_size
        self.chunk_bytes = chunk_bytes

    def _backward(
        self,
        model: nn.Module,
        inputs: tuple[torch.Tensor, ...],
        loss_fn: LossFn,
        params: dict[str, nn.Parameter],
        on_grad: OnGrad | None,
    ) -> StepResult:
        f = pure_loss(self.label, model, inputs, loss_fn, params)
        primals = {n: p.detach() for n, p in params.items()}
        bufs = BatchedBuffers(model)
        mark(FORWARD_END)  # nothing is kept for a backward phase
        loss: torch.Tensor | None = None
        n_jvps = 0
        for name, p in params.items():
            theta = primals[name]
            numel = theta.numel()
            per_direction = max(1, numel * theta.element_size())
            k_max = max(1, min(self.chunk_size, self.chunk_bytes // per_direction))
            grad = torch.empty(numel, dtype=theta.dtype, device=theta.device)

            def loss_along(
                v: torch.Tensor, b: dict[str, torch.Tensor], name: str = name
            ) -> tuple[torch.Tensor, torch.Tensor]:
                def g(t: torch.Tensor) -> torch.Tensor:
                    return f({**primals, name: t}, b)

                return jvp(g, (primals[name],), (v,))

            batched = vmap(loss_along, randomness="same")
            for start in range(0, numel, k_max):
                k = min(k_max, numel - start)
                tangents = torch.zeros(k, numel, dtype=theta.dtype, device=theta.device)
                tangents[torch.arange(k), torch.arange(start, start + k)] = 1
                b = bufs.batched(k)
                value, dloss = batched(tangents.view(k, *theta.shape), b)
                bufs.commit(b)
                if loss is None:
                    loss = value[0]
                grad[start : start + k] = dloss
                n_jvps += k
                del tangents, value, dloss, b
            accumulate_grad(p, grad)
            if on_grad is not None:
                on_grad(name, p)
        assert loss is not None
        return self._result(loss, jvps=n_jvps)
