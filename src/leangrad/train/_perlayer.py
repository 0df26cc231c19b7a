"""Per-layer optimizer steps inside ``on_grad``: gradients never all live at once.

Moonwalk v1, Algorithm 1 ("apply g_i to θ_i"): an engine hands each parameter's
gradient over as soon as it is final; stepping that parameter's optimizer there
and dropping ``p.grad`` frees the gradient before the next one is made. With
backprop this is PyTorch's per-parameter approach
(``register_post_accumulate_grad_hook``), here for every engine through
``on_grad``. :func:`measure_grad_memory` measures what it saves with the tracker, running
each way as a :class:`leangrad._step.Step` (where :class:`PerLayerOptimizer` and
``MakeOptimizer`` now live; they are re-exported here and from :mod:`leangrad.train`);
:func:`grad_memory_of_plan` reads it from a plan that measured both ways (``train
--budget``: no second measurement, no copies).
"""

from __future__ import annotations

import copy
import dataclasses

import torch
from torch import nn

from .._step import MakeOptimizer, PerLayerOptimizer, Step
from ..engines._base import Engine, LossFn
from ..measure import MemoryTracker, baseline_bytes
from ..planner._io import Plan

__all__ = ["GradMemory", "MakeOptimizer", "PerLayerOptimizer", "grad_memory_of_plan",
           "measure_grad_memory"]  # fmt: skip


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


def grad_memory_of_plan(
    plan: Plan, model: nn.Module, inputs: torch.Tensor | tuple[torch.Tensor, ...]
) -> GradMemory | None:
    """What per-layer steps save, read from ``plan``'s table where it chose a per-layer
    step and measured the same engine stepped after backward (the two rows'
    :attr:`~leangrad.Candidate.peak_bytes`, less the baseline ``model`` and ``inputs``
    hold, as :func:`measure_grad_memory` counts them); ``None`` where it did not (a
    whole-model step chosen, or either row an estimate or unmeasured)."""
    row = plan.chosen
    if row is None or not row.per_layer or row.peak_bytes is None or row.estimate:
        return None
    whole = next((c for c in plan.table if not c.per_layer and c.name == row.name
                  and c.options == row.options and c.peak_bytes is not None
                  and not c.estimate), None)  # fmt: skip
    if whole is None or whole.peak_bytes is None:
        return None
    base = baseline_bytes(model, inputs)
    grad_bytes = _grad_bytes(model)
    return GradMemory(whole.peak_bytes - base, row.peak_bytes - base, grad_bytes, row.label)


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
            step = Step(copy.deepcopy(engine), make, per_layer=per_layer)
            step.backward(m, inputs, loss_fn)
            with MemoryTracker(baseline=(m, inputs)) as tracker:
                step.backward(m, inputs, loss_fn)
            peaks[per_layer] = tracker.report.peak_bytes
            del m, step
    finally:
        torch.set_rng_state(rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)
    grad_bytes = _grad_bytes(model)
    return GradMemory(peaks[False], peaks[True], grad_bytes, engine.label)


def _grad_bytes(model: nn.Module) -> int:
    """Bytes of all of ``model``'s parameter gradients together."""
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
