"""``forward``: the exact gradient by forward-mode AD, one parameter direction at a time.

The "Forward" baseline of Moonwalk v1 (Table 1, section 4): each parameter
coordinate θ_j is a tangent direction e_j, and one jvp gives ∂L/∂θ_j. No
activation is stored, so memory does not grow with depth, but the time grows
with the number of parameters times the cost of a forward pass. Directions are
batched with ``torch.func.vmap`` in chunks so that memory stays bounded.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn
from torch.func import jvp, vmap

from .. import _errors as errors
from ._base import (
    Engine,
    LossFn,
    OnGrad,
    PlanOffer,
    StepResult,
    accumulate_grad,
    run_forward,
)
from ._catalog import register
from ._contract import RngReplay, forward_end, refuse_non_finite, used_parameters
from ._dropout import DropoutTape, replayed
from ._functional import BatchedBuffers, jvp_with_buffers, pure_loss

__all__ = ["Forward"]

BAD_CHUNK = errors.POSITIVE_INT


FORWARD_MAX_PARAMS = 20_000
"""``forward`` costs one jvp per parameter: the planner tries it only below this many
parameters."""


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
    ``on_grad`` is called for each parameter once all directions are done (every
    jvp needs every parameter's value, so none may be stepped earlier).
    """

    exact = True
    input_gradients = False
    forward_mode = True

    def __init__(self, *, chunk_size: int = 16, chunk_bytes: int = 32 * 2**20) -> None:
        super().__init__(chunk_size=chunk_size, chunk_bytes=chunk_bytes)
        self.chunk_size = self._positive_int("chunk_size", chunk_size)
        self.chunk_bytes = self._positive_int("chunk_bytes", chunk_bytes)

    @classmethod
    def plan_last_resorts(cls, model: nn.Module) -> list[PlanOffer]:
        """Tried only when nothing else fits, below :data:`FORWARD_MAX_PARAMS`
        parameters: it keeps nothing for a backward pass but costs one jvp per parameter,
        so it is never the fastest of engines that fit."""
        if sum(p.numel() for p in model.parameters()) <= FORWARD_MAX_PARAMS:
            return [PlanOffer("forward", {})]
        return []

    def _backward(
        self,
        model: nn.Module,
        inputs: tuple[torch.Tensor, ...],
        loss_fn: LossFn,
        params: Mapping[str, nn.Parameter],
        on_grad: OnGrad | None,
    ) -> StepResult:
        refuse_non_finite(self.label, inputs)
        # Parameters the loss does not use keep .grad None, as under autograd.
        # The real forward records autograd's dropout masks; every chunk replays them.
        tape = DropoutTape(self.label)
        params = used_parameters(
            model, inputs, loss_fn, params, tape.recording(self._run), real=True
        )
        f = replayed(tape, pure_loss(self.label, model, inputs, loss_fn, params))
        primals = {n: p.detach() for n, p in params.items()}
        bufs = BatchedBuffers(model)
        rng = RngReplay(inputs)  # every chunk draws autograd's dropout masks
        forward_end()  # nothing is kept for a backward phase
        loss: torch.Tensor | None = None
        n_jvps = 0
        grads: dict[str, torch.Tensor] = {}
        for name, theta in primals.items():
            numel = theta.numel()
            per_direction = max(1, numel * theta.element_size())
            k_max = max(1, min(self.chunk_size, self.chunk_bytes // per_direction))
            grad = torch.empty(numel, dtype=theta.dtype, device=theta.device)

            def loss_along(
                v: torch.Tensor, b: dict[str, torch.Tensor], name: str = name
            ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
                def g(t: torch.Tensor, bb: dict[str, torch.Tensor]) -> torch.Tensor:
                    return f({**primals, name: t}, bb)

                if not b:  # no buffers to carry: a plain jvp (no aux, no clones)
                    out = jvp(lambda t: g(t, b), (primals[name],), (v,))
                    return out[0], out[1], b
                return jvp_with_buffers(g, primals[name], v, b)

            batched = vmap(loss_along, randomness="same")
            for start in range(0, numel, k_max):
                k = min(k_max, numel - start)
                tangents = torch.zeros(k, numel, dtype=theta.dtype, device=theta.device)
                tangents[torch.arange(k), torch.arange(start, start + k)] = 1
                b = bufs.batched(k)
                rng.before_run()
                value, dloss, updated = batched(tangents.view(k, *theta.shape), b)
                rng.after_run()
                bufs.commit(updated)
                if loss is None:
                    loss = value[0]
                grad[start : start + k] = dloss
                n_jvps += k
                del tangents, value, dloss, b, updated
            grads[name] = grad
        rng.finish()
        # Every direction needs every parameter's current value, so gradients are
        # written (and on_grad called) only once all directions are done: an
        # optimizer step inside on_grad must not move the point of evaluation.
        for name, p in params.items():
            accumulate_grad(p, grads.pop(name))
            if on_grad is not None:
                on_grad(name, p)
        assert loss is not None
        return self._result(loss, jvps=n_jvps)

    def rerun_modules(self, model: nn.Module) -> list[tuple[str, nn.Module]]:
        return list(model.named_modules())  # one forward per chunk of directions

    def _run(self, fn: object, xs: tuple[torch.Tensor, ...]) -> object:
        return run_forward(self.label, fn, xs)  # type: ignore[arg-type]
