"""``projforward``: the forward gradient, an unbiased estimate from random directional derivatives.

Baydin et al., "Gradients without backpropagation" (2022); the ProjForward
baseline of Moonwalk v1 (section 4, Table 1). For a random tangent v with
E[v vᵀ] = I (standard Gaussian or Rademacher entries), one jvp gives the
directional derivative ∇L·v, and g = (∇L·v) v satisfies E[g] = ∇L. The mean of
``samples`` independent draws is returned; its variance falls as 1/samples.
(Moonwalk v1 writes the projection with a unit-length u, which is biased by a
factor 1/d; leangrad keeps the unbiased scaling.)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

import torch
from torch import nn
from torch.func import vmap

from ._base import Engine, LossFn, OnGrad, StepResult, accumulate_grad, run_forward
from ._catalog import register
from ._contract import RngReplay, forward_end, refuse_non_finite, used_parameters
from ._dropout import DropoutTape, replayed
from ._functional import BatchedBuffers, jvp_with_buffers, pure_loss

__all__ = ["ProjForward"]

BAD_DISTRIBUTION = "distribution must be 'gaussian' or 'rademacher', got {value!r}"


@register("projforward")
class ProjForward(Engine):
    """Forward-gradient estimator: mean of ``samples`` draws of (∇L·v) v.

    Args:
        samples: number of random tangents averaged (variance ∝ 1/samples).
        distribution: ``"gaussian"`` (v ~ N(0, I); per-coordinate variance
            ‖∇L‖² + ∂_j L²) or ``"rademacher"`` (v_j = ±1; variance ‖∇L‖² − ∂_j L²).
        seed: seeds this engine's own generator, so a sequence of steps is
            reproducible; ``None`` draws from PyTorch's global generator.
        chunk_size: most tangents pushed through the model at once (``vmap``).

    Trade-off: time about one forward pass with tangents per chunk and memory of
    one forward pass (nothing stored for a backward); the estimate is unbiased
    but noisy, with variance growing with the number of parameters.
    """

    exact = False
    forward_mode = True
    input_gradients = False

    def __init__(
        self,
        *,
        samples: int = 1,
        distribution: Literal["gaussian", "rademacher"] = "gaussian",
        seed: int | None = None,
        chunk_size: int = 64,
    ) -> None:
        if distribution not in ("gaussian", "rademacher"):
            raise ValueError(BAD_DISTRIBUTION.format(value=distribution))
        super().__init__(
            samples=samples, distribution=distribution, seed=seed, chunk_size=chunk_size
        )
        self._positive_int("samples", samples)
        self._positive_int("chunk_size", chunk_size)
        self.samples = samples
        self.distribution = distribution
        self.seed = seed
        self.chunk_size = chunk_size
        self._generators: dict[torch.device, torch.Generator] = {}

    def _generator(self, device: torch.device) -> torch.Generator:
        """This engine's generator on ``device``. Without a seed, a fresh one per step,
        seeded by one draw from PyTorch's global stream: the tangents never share a
        stream with the model's own random draws (dropout masks), which each chunk
        replays from the step's starting state."""
        if device not in self._generators:
            seed = self.seed
            if seed is None:
                seed = int(torch.randint(0, 2**62, (), device=device).item())
            self._generators[device] = torch.Generator(device=device).manual_seed(seed)
        return self._generators[device]

    def state_dict(self) -> dict[str, Any]:
        """The states of the tangent generators, one per device used so far."""
        return {"generators": {str(d): g.get_state() for d, g in self._generators.items()}}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        for device, st in state.get("generators", {}).items():
            gen = torch.Generator(device=device)
            gen.set_state(st)
            self._generators[torch.device(device)] = gen

    def _draw(self, k: int, like: torch.Tensor) -> torch.Tensor:
        gen = self._generator(like.device)
        shape = (k, *like.shape)
        if self.distribution == "gaussian":
            return torch.randn(shape, generator=gen, dtype=like.dtype, device=like.device)
        bits = torch.randint(0, 2, shape, generator=gen, device=like.device)
        return bits.to(like.dtype).mul_(2).sub_(1)

    def _backward(
        self,
        model: nn.Module,
        inputs: tuple[torch.Tensor, ...],
        loss_fn: LossFn,
        params: Mapping[str, nn.Parameter],
        on_grad: OnGrad | None,
    ) -> StepResult:
        if self.seed is None:
            self._generators.clear()  # a new per-step generator, drawn before the forward
        for t in params.values():
            self._generator(t.device)
        refuse_non_finite(self.label, inputs)
        # Parameters the loss does not use keep .grad None, as under autograd. The real
        # forward also records autograd's dropout masks, which every chunk replays.
        tape = DropoutTape(self.label)
        run = tape.recording(lambda fn, xs: run_forward(self.label, fn, xs))
        params = used_parameters(model, inputs, loss_fn, params, run, real=True)
        f = replayed(tape, pure_loss(self.label, model, inputs, loss_fn, params))
        primals = {n: p.detach() for n, p in params.items()}
        bufs = BatchedBuffers(model)
        rng = RngReplay(inputs)  # every chunk draws autograd's dropout masks
        forward_end()

        def directional(
            v: dict[str, torch.Tensor], b: dict[str, torch.Tensor]
        ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
            return jvp_with_buffers(f, primals, v, b)

        batched = vmap(directional, randomness="same")
        total = {n: torch.zeros_like(t) for n, t in primals.items()}
        loss: torch.Tensor | None = None
        for start in range(0, self.samples, self.chunk_size):
            k = min(self.chunk_size, self.samples - start)
            tangents = {n: self._draw(k, t) for n, t in primals.items()}
            b = bufs.batched(k)
            rng.before_run()
            value, dloss, updated = batched(tangents, b)
            rng.after_run()
            bufs.commit(updated)
            if loss is None:
                loss = value[0]
            for n, v in tangents.items():
                total[n] += torch.tensordot(dloss, v, dims=1)
            del tangents, value, dloss, b, updated
        rng.finish()
        assert loss is not None
        for n, p in params.items():
            accumulate_grad(p, total[n].div_(self.samples))
            if on_grad is not None:
                on_grad(n, p)
        return self._result(loss, jvps=self.samples)

    def rerun_modules(self, model: nn.Module) -> list[tuple[str, nn.Module]]:
        return list(model.named_modules())  # one forward per chunk of samples
