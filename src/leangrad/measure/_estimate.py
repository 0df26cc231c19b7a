"""Memory estimates for configurations too big to allocate: the tracker on fake tensors.

Under ``FakeTensorMode`` every operator computes output shapes and dtypes but
allocates nothing, so :class:`MemoryTracker` counts the bytes the step *would*
allocate. The result is labelled ``estimate=True``: it misses kernel scratch
space and allocator rounding, which the real tracker and the RSS cross-check see.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

from .._errors import EngineInputError
from ._memory import MemoryReport, MemoryTracker

__all__ = ["BUILD_RESULT", "NOT_CALLABLE", "READS_VALUES", "estimate_memory"]

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
