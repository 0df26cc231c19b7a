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

from ._memory import MemoryReport, MemoryTracker

__all__ = ["estimate_memory"]


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
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        model, inputs = build()
        with MemoryTracker(baseline=(model, inputs), estimate=True) as tracker:
            step(model, inputs)
    return tracker.report
