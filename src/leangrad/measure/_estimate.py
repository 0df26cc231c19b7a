"""Memory estimates for configurations too big to allocate: the tracker on fake tensors.

Under ``FakeTensorMode`` every operator computes output shapes and dtypes but
allocates nothing, so :class:`MemoryTracker` counts the bytes the step *would*
allocate. The result is labelled ``estimate=True``: it misses kernel scratch
space and allocator rounding, which the real tracker and the RSS cross-check see.
"""

from __future__ import annotations

import copy
import functools
import itertools
import types
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from .._errors import EngineInputError
from ._memory import MemoryReport, MemoryTracker

if TYPE_CHECKING:
    from ._profile import StepProfile

__all__ = ["BUILD_RESULT", "NOT_CALLABLE", "READS_VALUES", "estimate_memory", "estimate_step"]

NOT_CALLABLE = (
    "estimate_memory: {name} must be a callable, got {type}; pass e.g. "
    "build=lambda: (make_model(), torch.randn(64, 3, 32, 32)) and "
    "step=lambda m, x: engine.backward(m, x, loss_fn)"
)
BUILD_RESULT = (
    "estimate_memory: build() must return a (model, inputs) pair with an nn.Module first, "
    "got {what}; return e.g. (model, x)"
)
READS_VALUES = (
    "estimate_memory: the step read a tensor value or made a data-dependent shape ({op}), "
    "which fake tensors do not have; remove .item(), bool(tensor), nonzero() and the like "
    "from the step (log the loss outside it), or measure it with MemoryTracker on real tensors"
)


def estimate_memory(
    build: Callable[[], tuple[nn.Module, Any]],
    step: Callable[[nn.Module, Any], object],
) -> MemoryReport:
    """Estimate the peak memory of ``step(model, inputs)`` without allocating it.

    Args:
        build: makes ``(model, inputs)``; called under ``FakeTensorMode`` so the
            parameters and inputs are fake (shapes only). Targets the loss needs
            must also be made in ``build`` or inside ``step``.
        step: one training step, e.g. ``lambda m, x: engine.backward(m, x, loss_fn)``.
            It must not read tensor values (no ``.item()``, no data-dependent shapes).

    Returns:
        A :class:`MemoryReport` with ``estimate=True``.

    Raises:
        EngineInputError: ``build`` or ``step`` is not callable, ``build`` returns
            something else than ``(model, inputs)``, or ``step`` reads a tensor value.
    """
    from torch._subclasses.fake_tensor import (
        DataDependentOutputException,
        DynamicOutputShapeException,
        FakeTensorMode,
    )

    for name, fn in (("build", build), ("step", step)):
        if not callable(fn):
            raise EngineInputError(NOT_CALLABLE.format(name=name, type=type(fn).__name__))
    with FakeTensorMode():
        built = build()
        if not (isinstance(built, tuple) and len(built) == 2 and isinstance(built[0], nn.Module)):
            what = (f"a tuple of {len(built)}" if isinstance(built, tuple)
                    else type(built).__name__)  # fmt: skip
            raise EngineInputError(BUILD_RESULT.format(what=what))
        model, inputs = built
        try:
            with MemoryTracker(baseline=(model, inputs), estimate=True) as tracker:
                step(model, inputs)
        except (DataDependentOutputException, DynamicOutputShapeException) as e:
            raise EngineInputError(READS_VALUES.format(op=e)) from e
    return tracker.report


def estimate_step(
    engine: Any,
    model: nn.Module,
    inputs: torch.Tensor | Sequence[torch.Tensor],
    loss_fn: Callable[[Any], torch.Tensor],
    *,
    baseline: Sequence[Any] = (),
) -> StepProfile:
    """:func:`~leangrad.measure.profile_step`'s memory figures for a step too big to run
    here: one step of ``engine`` on a fake copy of ``model`` and ``inputs`` (shapes only,
    nothing allocated), with ``.grad`` starting as ``None``.

    The copy shares nothing with ``model``, which is left untouched; ``loss_fn`` may close
    over real tensors (targets), which enter the fake step as fake ones made before it, as
    a real step finds them (tensors it reaches only through other objects are made during
    the step and count as its allocations: a slight over-estimate). Use a fresh
    engine (or one not yet used on ``model``): engines that keep state per model (an
    optimizer inside a training step) would otherwise mix real and fake tensors.

    Returns:
        A :class:`~leangrad.measure.StepProfile` with ``estimate=True`` and no time. It
        misses kernel scratch space and allocator rounding, as every fake-tensor estimate.

    Raises:
        EngineInputError: the step reads a tensor value (``.item()``, data-dependent shapes).
    """
    from torch._subclasses.fake_tensor import (
        DataDependentOutputException,
        DynamicOutputShapeException,
        FakeTensorMode,
    )

    from ._profile import StepProfile

    xs = (inputs,) if isinstance(inputs, torch.Tensor) else tuple(inputs)
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    memo: dict[int, Any] = {}
    for t in itertools.chain(model.parameters(), model.buffers()):
        fake = mode.from_tensor(t)
        memo[id(t)] = (nn.Parameter(fake, requires_grad=t.requires_grad)
                       if isinstance(t, nn.Parameter) else fake)  # fmt: skip
    fake_model = copy.deepcopy(model, memo)
    fake_xs = tuple(mode.from_tensor(x) for x in xs)
    fake_extra = [mode.from_tensor(b) if isinstance(b, torch.Tensor) else b for b in baseline]
    fake_loss_fn = _with_fake_tensors(loss_fn, mode)
    with mode:
        try:
            if getattr(engine, "probes", False):  # its first step differs: warm it up
                engine.backward(fake_model, fake_xs, fake_loss_fn)
                for p in fake_model.parameters():
                    p.grad = None
            with MemoryTracker(baseline=(fake_model, *fake_xs, *fake_extra),
                               estimate=True) as tracker:  # fmt: skip
                result = engine.backward(fake_model, fake_xs, fake_loss_fn)
        except (DataDependentOutputException, DynamicOutputShapeException) as e:
            raise EngineInputError(READS_VALUES.format(op=e)) from e
    return StepProfile.of(engine, tracker.report, result)


def _with_fake_tensors(fn: Any, mode: Any) -> Any:
    """``fn`` with the tensors it closes over (closure cells, defaults, a partial's
    arguments; one level deep, lists and tuples included) made fake before the step, as a
    real step finds its targets existing: neither baseline nor allocation."""

    def fake(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return mode.from_tensor(x)
        if isinstance(x, (list, tuple)) and any(isinstance(y, torch.Tensor) for y in x):
            return type(x)(fake(y) for y in x)
        return x

    if isinstance(fn, functools.partial):
        return functools.partial(_with_fake_tensors(fn.func, mode), *map(fake, fn.args),
                                 **{k: fake(v) for k, v in fn.keywords.items()})  # fmt: skip
    if not isinstance(fn, types.FunctionType):
        return fn  # a callable object: its tensors enter the step as they are met
    cells = []
    for cell in fn.__closure__ or ():
        try:
            cells.append(types.CellType(fake(cell.cell_contents)))
        except ValueError:  # an empty cell
            cells.append(cell)
    defaults = tuple(map(fake, fn.__defaults__)) if fn.__defaults__ else fn.__defaults__
    out = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, defaults,
                             tuple(cells) if fn.__closure__ is not None else None)  # fmt: skip
    out.__kwdefaults__ = fn.__kwdefaults__
    return out
