"""Per-layer optimizer steps inside ``on_grad``: gradients never all live at once.

Moonwalk v1, Algorithm 1 ("apply g_i to θ_i"): an engine hands each parameter's
gradient over as soon as it is final; stepping that parameter's optimizer there
and dropping ``p.grad`` frees the gradient before the next one is made. With
backprop this is PyTorch's per-parameter approach
(``register_post_accumulate_grad_hook``), here for every engine through
``on_grad``. :func:`measure_grad_memory` measures what it saves with the tracker.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from ..engines._base import Engine, LossFn
from ..measure import MemoryTracker

__all__ = ["GradMemory", "PerLayerOptimizer", "measure_grad_memory"]

MakeOptimizer = Callable[[list[nn.Parameter]], torch.optim.Optimizer]


class PerLayerOptimizer:
    """One optimizer per parameter, stepped in ``on_grad`` and then ``p.grad = None``.

    Args:
        params: the trainable parameters by name.
        make: builds an optimizer over a list of parameters (e.g. Adam with the lr).
    """

    def __init__(self, params: Mapping[str, nn.Parameter], make: MakeOptimizer) -> None:
        self.params = dict(params)
        self.optimizers = {n: make([p]) for n, p in self.params.items()}

    def on_grad(self, name: str, p: nn.Parameter) -> None:
        """Step ``name``'s optimizer now and free its gradient."""
        if p.grad is None:
            return
        self.optimizers[name].step()
        p.grad = None

    def finish(self) -> None:
        """Step any parameter the engine did not hand over (its gradient is still set)."""
        for n, p in self.params.items():
            self.on_grad(n, p)

    def state_dict(self) -> dict[str, dict[str, Any]]:
        return {n: o.state_dict() for n, o in self.optimizers.items()}

    def load_state_dict(self, state: Mapping[str, dict[str, Any]]) -> None:
        for n, o in self.optimizers.items():
            o.load_state_dict(state[n])


@dataclasses.dataclass(frozen=True)
class GradMemory:
    """Peak memory of one training step (backward and optimizer step), with the
    optimizer applied after backward and per layer inside ``on_grad``.

    Attributes:
        full_peak_bytes: tracker peak above baseline, optimizer step after backward.
        per_layer_peak_bytes: the same with per-layer steps.
        grad_bytes: bytes of all parameter gradients together.
        engine: the engine's label.
    """

    full_peak_bytes: int
    per_layer_peak_bytes: int
    grad_bytes: int
    engine: str

    @property
    def saving_bytes(self) -> int:
        return self.full_peak_bytes - self.per_layer_peak_bytes

    @property
    def saving_fraction(self) -> float:
        return self.saving_bytes / self.full_peak_bytes if self.full_peak_bytes else 0.0


def measure_grad_memory(
    model: nn.Module,
    engine: Engine,
    inputs: torch.Tensor | tuple[torch.Tensor, ...],
    loss_fn: LossFn,
    make: MakeOptimizer,
) -> GradMemory:
    """Measure one step both ways on copies of ``model`` (the model is not changed).

    Each way first runs one untracked warm-up step, so optimizer state (e.g. Adam's
    moments) exists before the tracked step and only the step's own allocations
    count. The global RNG state is restored afterwards.
    """
    rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    try:
        peaks: dict[bool, int] = {}
        for per_layer in (False, True):
            m = copy.deepcopy(model)
            e = copy.deepcopy(engine)
            params = {n: p for n, p in m.named_parameters() if p.requires_grad}
            if per_layer:
                plo = PerLayerOptimizer(params, make)
                step = _per_layer_step(m, e, inputs, loss_fn, plo)
            else:
                step = _full_step(m, e, inputs, loss_fn, make(list(params.values())))
            step()
            with MemoryTracker(baseline=(m, inputs)) as tracker:
                step()
            peaks[per_layer] = tracker.report.peak_bytes
            del m, e, params, step
    finally:
        torch.set_rng_state(rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    return GradMemory(peaks[False], peaks[True], grad_bytes, engine.label)


def _full_step(
    model: nn.Module,
    engine: Engine,
    inputs: torch.Tensor | tuple[torch.Tensor, ...],
    loss_fn: LossFn,
    opt: torch.optim.Optimizer,
) -> Callable[[], None]:
    def step() -> None:
        opt.zero_grad(set_to_none=True)
        engine.backward(model, inputs, loss_fn)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def _per_layer_step(
    model: nn.Module,
    engine: Engine,
    inputs: torch.Tensor | tuple[torch.Tensor, ...],
    loss_fn: LossFn,
    plo: PerLayerOptimizer,
) -> Callable[[], None]:
    def step() -> None:
        engine.backward(model, inputs, loss_fn, on_grad=plo.on_grad)
        plo.finish()

    return step
