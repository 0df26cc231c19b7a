"""How good is Highway-BP's gradient after k iterations, and how to choose k
(paper section 5.3, Fig. 6; the reviewers' ask for guidance on k).

- :func:`convergence` — per k: cosine similarity and max-norm relative error of the
  parameter gradient against the exact one, and the k-th iteration's share of the norm
  (``‖g_k − g_{k−1}‖ / ‖g_exact‖`` with ``g_{−1} = 0``; Fig. 6 bottom row);
- :func:`suggest_k` — the smallest k whose cosine reaches a target;
- :class:`KSchedule` — k raised during training (section 6: "increase the number of
  iterations during training and end with an exact backpropagation");
- the adaptive mode is the engine's ``tol=`` option (stop when an update's relative
  norm falls below ``tol``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from ..engines import engine
from ..layers._highway import HighwayError

__all__ = ["BAD_SCHEDULE", "KPoint", "KSchedule", "convergence", "suggest_k"]

BAD_SCHEDULE = (
    "KSchedule: need 0 <= start <= end and steps >= 1 and kind 'linear' or 'step', "
    "got start={start!r}, end={end!r}, steps={steps!r}, kind={kind!r}"
)


@dataclasses.dataclass(frozen=True)
class KPoint:
    """Gradient quality after k iterations.

    Attributes:
        k: iterations.
        cosine: of all parameter gradients concatenated, against the exact gradient.
        rel_err: ``max|g_k − g| / max|g|`` over all parameters.
        step_share: ``‖g_k − g_{k−1}‖ / ‖g‖`` (``g_{−1} = 0``): the norm iteration k adds.
    """

    k: int
    cosine: float
    rel_err: float
    step_share: float


def _flat_grads(model: nn.Module) -> torch.Tensor:
    return torch.cat([
        (p.grad if p.grad is not None else torch.zeros_like(p)).detach().reshape(-1).double()
        for p in model.parameters() if p.requires_grad
    ])  # fmt: skip


def _grad_of(
    model: nn.Module, engine: Any, inputs: Any, loss_fn: Callable[..., torch.Tensor]
) -> torch.Tensor:
    saved = {p: p.grad for p in model.parameters()}
    for p in saved:
        p.grad = None
    engine.backward(model, inputs, loss_fn)
    g = _flat_grads(model)
    for p, old in saved.items():
        p.grad = old
    return g


def convergence(
    model: nn.Module,
    inputs: Any,
    loss_fn: Callable[[Any], torch.Tensor],
    *,
    ks: Sequence[int],
    baseline: str = "highway",
    reference: torch.Tensor | None = None,
) -> list[KPoint]:
    """Cosine, relative error and norm share of Highway-BP's gradient for each k in ``ks``.

    The exact gradient is autograd's (the ``backprop`` engine) unless ``reference`` (a flat
    float64 vector in ``model.parameters()`` order) is given. The model's ``.grad`` are
    left as they were. BatchNorm running statistics are updated by each run, as by any
    training step; pass a copy to keep them.
    """
    exact = reference if reference is not None else _grad_of(
        model, engine("backprop"), inputs, loss_fn
    )
    norm = float(exact.norm())
    scale = float(exact.abs().max())
    out: list[KPoint] = []
    prev = torch.zeros_like(exact)
    for k in sorted(ks):
        g = _grad_of(model, engine("highway", k=k, baseline=baseline), inputs, loss_fn)
        cos = float(torch.dot(g, exact) / (g.norm() * norm)) if norm and g.norm() else 0.0
        rel = float((g - exact).abs().max()) / scale if scale else float((g - exact).abs().max())
        share = float((g - prev).norm()) / norm if norm else 0.0
        out.append(KPoint(k=k, cosine=cos, rel_err=rel, step_share=share))
        prev = g
    return out


def suggest_k(
    model: nn.Module,
    inputs: Any,
    loss_fn: Callable[[Any], torch.Tensor],
    *,
    target_cosine: float = 0.99,
    k_max: int = 10,
) -> int:
    """The smallest k ≤ ``k_max`` whose gradient's cosine to the exact one reaches
    ``target_cosine`` on this batch (``k_max`` when none does). Re-check during training:
    the paper's Fig. 6 shows the k needed grows as layers start to cooperate."""
    for p in convergence(model, inputs, loss_fn, ks=range(k_max + 1)):
        if p.cosine >= target_cosine:
            return p.k
    return k_max


@dataclasses.dataclass(frozen=True)
class KSchedule:
    """k as a function of the training step: from ``start`` to ``end`` over ``steps``.

    ``kind="linear"`` rounds the straight line; ``kind="step"`` keeps ``start`` for the
    first half and ``end`` after. Use it by building the engine per step::

        sched = KSchedule(start=0, end=5, steps=1000)
        leangrad.engine("highway", k=sched(step)).backward(model, x, loss_fn)
    """

    start: int
    end: int
    steps: int
    kind: str = "linear"

    def __post_init__(self) -> None:
        ok = (
            isinstance(self.start, int) and isinstance(self.end, int)
            and isinstance(self.steps, int) and 0 <= self.start <= self.end and self.steps >= 1
            and self.kind in ("linear", "step")
        )  # fmt: skip
        if not ok:
            raise HighwayError(
                BAD_SCHEDULE.format(start=self.start, end=self.end, steps=self.steps,
                                    kind=self.kind)
            )  # fmt: skip

    def __call__(self, step: int) -> int:
        frac = min(max(step / self.steps, 0.0), 1.0)
        if self.kind == "step":
            return self.start if frac < 0.5 else self.end
        return self.start + math.floor(frac * (self.end - self.start) + 0.5)
