"""The plan calls exact only what it checked on the user's model.

An engine's exactness is a claim about models in general; the user's model may hold what
the claim did not foresee (a layer drawing random numbers no probe saw, an in-place write,
a loss that is not a mean over examples). Before :func:`leangrad.plan` hands back an exact
engine, :func:`exact_why` runs one step of it and one of ``loss.backward()`` on the user's
model and batch, from the same RNG state, and compares what each leaves: every ``.grad``
(None stays None), every buffer, the global RNG streams. A row that differs is shown as
``inexact: <what differed>`` and the next fastest fitting row is checked instead. The two
steps cost about twice one step of backprop; the plan's message says the check ran.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..engines import engine as engine_named
from ..measure._profile import untouched

__all__ = ["TOLERANCE", "exact_why"]

TOLERANCE = {torch.float64: 1e-8, torch.float32: 2e-3}
"""Largest relative difference of a gradient or buffer from autograd's that still counts as
the same step (a recomputation sums in another order); 5e-2 for 16-bit types. The wrong
engines this check is for differ by 0.1 to 1e5."""
FLOOR = {torch.float64: 1e-6, torch.float32: 1e-4}
"""A gradient below this share of the model's largest is compared on that scale: a true 0
is computed as rounding noise (a BatchNorm shift followed by another training-mode
BatchNorm: 4e-18 in float64, 1.7e-9 in float32 on torchvision's MobileNetV3, where the
largest gradient is 0.11; 1e-2 for 16-bit types)."""


def _tolerance(dtype: torch.dtype) -> float:
    return TOLERANCE.get(dtype, 5e-2)


def _floor(dtype: torch.dtype) -> float:
    return FLOOR.get(dtype, 1e-2)


def _rng(devices: list[torch.device]) -> list[torch.Tensor]:
    return [torch.get_rng_state()] + [torch.cuda.get_rng_state(d) for d in devices]


def _set_rng(state: list[torch.Tensor], devices: list[torch.device]) -> None:
    torch.set_rng_state(state[0])
    for d, s in zip(devices, state[1:], strict=True):
        torch.cuda.set_rng_state(s, d)


After = tuple[list[torch.Tensor | None], list[torch.Tensor], list[torch.Tensor]]


def _after(run: Callable[[], Any], model: nn.Module, devices: list[torch.device]) -> After:
    """One step's ``.grad`` per parameter, buffers and RNG states, from ``.grad`` None."""
    for p in model.parameters():
        p.grad = None
    run()
    grads = [None if p.grad is None else p.grad.detach().clone() for p in model.parameters()]
    return grads, [b.detach().clone() for b in model.buffers()], _rng(devices)


def exact_why(step_engine: Any, model: nn.Module, xs: tuple[torch.Tensor, ...],
              loss_fn: Callable[[Any], torch.Tensor]) -> str | None:  # fmt: skip
    """What one step of ``step_engine`` leaves differently from ``loss.backward()`` on
    ``model`` and ``xs`` (the first difference, named), or ``None``. The model, its
    ``.grad``, buffers and the RNG are put back as they were."""
    devices = sorted({x.device for x in xs if x.device.type == "cuda"}, key=str)
    names = [n for n, _ in model.named_parameters()]
    buffer_names = [n for n, _ in model.named_buffers()]
    reference = engine_named("backprop")
    with untouched(model, xs):
        start = [b.detach().clone() for b in model.buffers()]
        rng = _rng(devices)
        ref = _after(lambda: reference.backward(model, xs, loss_fn), model, devices)
        with torch.no_grad():
            for b, v in zip(model.buffers(), start, strict=True):
                b.copy_(v)
        _set_rng(rng, devices)
        got = _after(lambda: step_engine.backward(model, xs, loss_fn), model, devices)
    g_ref, g_got = ref[0], got[0]
    for n, ga, gb in zip(names, g_ref, g_got, strict=True):
        if (ga is None) != (gb is None):
            return f"{n}.grad is {'None' if gb is None else 'set'} where autograd's is not"
    top = max((float(g.abs().max()) for g in g_ref if g is not None and g.numel()),
              default=0.0)  # fmt: skip
    for n, ga, gb in zip(names, g_ref, g_got, strict=True):
        if ga is None or gb is None or not ga.numel():
            continue
        scale = float(ga.abs().max()) + _floor(ga.dtype) * top + 1e-300
        err = float((ga - gb).abs().max()) / scale
        if not err <= _tolerance(ga.dtype):
            return f"the gradient of {n} differs from autograd's by {err:.2g} (relative)"
    for n, a, b in zip(buffer_names, ref[1], got[1], strict=True):
        if not a.is_floating_point():
            if not torch.equal(a, b):
                return f"buffer {n} ends at {b.tolist()[:3]} where autograd's is {a.tolist()[:3]}"
            continue
        err = float((a - b).abs().max()) / (float(a.abs().max()) + 1.0) if a.numel() else 0.0
        if not err <= _tolerance(a.dtype):
            return f"buffer {n} differs from autograd's by {err:.2g}"
    if not all(torch.equal(a, b) for a, b in zip(ref[2], got[2], strict=True)):
        return "the global RNG stream ends elsewhere than after autograd's step"
    return None
