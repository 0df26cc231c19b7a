"""The plan calls exact only what it checked on the user's model.

An engine's exactness is a claim about models in general; the user's model may hold what
the claim did not foresee (a layer drawing random numbers no probe saw, an in-place write,
a loss that is not a mean over examples). Before :func:`leangrad.plan` hands back an exact
engine, :func:`exact_why` runs one step of it and one of ``loss.backward()`` on the user's
model and batch, from the same RNG state, and compares what each leaves: every ``.grad``
(None stays None), every buffer, the global RNG streams. A row that differs is shown as
``inexact: <what differed>`` and the next fastest fitting row is checked instead. The two
steps cost about twice one step of backprop; the plan's message says the check ran.

A plan that stays within its budget (``plan(within_budget=True)``, as
:func:`leangrad.hf.attach` plans inside a run) cannot step ``loss.backward()`` on a batch
whose backprop is over the budget: :func:`check_batch` gives the check the first half,
quarter, ... of the batch, the largest whose backprop step is estimated to fit, where the
loss is declared per example (:func:`leangrad.loss.per_example`, which the Trainer
integration declares) — an engine that mishandles a layer's randomness, an in-place write
or a coupled batch does so on any slice of it. Where no slice fits, or the loss cannot be
sliced, the plan's message says the check did not run and why.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from .._sizes import fmt_bytes
from ..engines import engine as engine_named
from ..loss import PerExample
from ..measure import estimate_step
from ..measure._profile import untouched

__all__ = ["CHECKED", "TOLERANCE", "check_batch", "exact_why"]

CHECKED = "; re-checked against loss.backward() on this model and batch (one step each)"
SLICED = ("; re-checked against loss.backward() on this model and the first {n} of the "
          "batch's {batch} examples (one step each: the whole batch's backprop, ~{peak}, "
          "is over the budget)")  # fmt: skip
NOT_CHECKED = ("; NOT re-checked against loss.backward(): its step on this batch (~{peak}) "
               "is over the budget, and {why}")  # fmt: skip
Check = tuple[tuple[torch.Tensor, ...], Callable[[Any], torch.Tensor], str]

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


def check_batch(model: nn.Module, xs: tuple[torch.Tensor, ...],
                loss_fn: Callable[[Any], torch.Tensor], most: int | None,
                step_engine: Any) -> Check | str:  # fmt: skip
    """The inputs and loss :func:`exact_why` steps ``step_engine`` (a fresh one) and
    backprop on within ``most`` bytes (``None``: no limit), with the plan's note; or, where
    none fits, the note saying the check did not run (the module docstring says how the
    batch is sliced). Both steps' estimates count what the check holds beside them: a copy
    of the reference's gradients and two of the buffers (:func:`_held_bytes`)."""
    if most is None:
        return xs, loss_fn, CHECKED
    held = _held_bytes(model)
    whole: int | None = None  # backprop's estimate on the whole batch, for the notes
    for i, (n, part, sliced) in enumerate(_slices(xs, loss_fn)):
        peaks = [_estimated(e, model, part, sliced)
                 for e in (engine_named("backprop"), step_engine)]  # fmt: skip
        if i == 0:
            whole = peaks[0]
        if all(p is not None and p + held <= most for p in peaks):
            if part is xs:
                return xs, loss_fn, CHECKED
            batch = loss_fn.batch  # type: ignore[attr-defined]
            return part, sliced, SLICED.format(n=n, batch=batch, peak=_shown(whole))
    if not isinstance(loss_fn, PerExample):
        return NOT_CHECKED.format(peak=_shown(whole), why="the loss is not declared per "
                                  "example (leangrad.loss.per_example), so no slice of the "
                                  "batch can be checked instead")  # fmt: skip
    return NOT_CHECKED.format(peak=_shown(whole), why="so is one example's")


def _slices(xs: tuple[torch.Tensor, ...], loss_fn: Callable[[Any], torch.Tensor],
            ) -> Iterator[tuple[int, tuple[torch.Tensor, ...], Callable[[Any], torch.Tensor]]]:
    """The whole batch, then (a loss declared per example) its first half, quarter, ...
    down to one example, each with its rows of the loss's targets."""
    if not isinstance(loss_fn, PerExample):
        yield 0, xs, loss_fn
        return
    batch, n = loss_fn.batch, loss_fn.batch
    yield n, xs, loss_fn
    while (n := n // 2) >= 1:
        # copies, not views: fake tensors cannot be made of a view of a real batch
        part = tuple(x[:n].clone() if x.dim() and x.shape[0] == batch else x for x in xs)
        counts = None if loss_fn.counts is None else loss_fn.counts[:n].clone()
        yield n, part, PerExample(loss_fn.fn, tuple(t[:n].clone() for t in loss_fn.targets),
                                  loss_fn.reduction, counts)  # fmt: skip


def _held_bytes(model: nn.Module) -> int:
    """What :func:`exact_why` holds beside a step: the reference's gradients, and the
    buffers as they started and as the reference left them."""
    grads = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    return grads + 2 * sum(b.numel() * b.element_size() for b in model.buffers())


def _shown(peak: int | None) -> str:
    return "?" if peak is None else fmt_bytes(peak)


def _estimated(step_engine: Any, model: nn.Module, xs: tuple[torch.Tensor, ...],
               loss_fn: Callable[[Any], torch.Tensor]) -> int | None:  # fmt: skip
    """The engine's fake-tensor estimate of the step (total bytes), or ``None`` where fake
    tensors cannot run it."""
    try:
        return estimate_step(step_engine, model, xs, loss_fn).total_bytes
    except Exception:  # an op fake tensors cannot run: not known to fit
        return None
