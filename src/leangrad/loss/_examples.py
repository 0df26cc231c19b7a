"""A loss declared as a mean (or sum) over the examples of the batch, so that a step may
run the batch in micro-batches and add their gradients (gradient accumulation).

``loss_fn(out)`` closes over the batch's targets, so nothing can tell from it which
targets belong to which rows of the output. :func:`per_example` holds the targets beside
the loss function: called on the whole batch's output it is an ordinary ``loss_fn``, and
:meth:`PerExample.rows` gives the loss of a slice of the batch, weighted so that the
micro-batches' losses — and so their gradients — add up to the whole batch's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .. import _errors as errors

__all__ = ["PerExample", "per_example"]

BAD_REDUCTION = "per_example: reduction must be 'mean' or 'sum', got {value!r}"
NO_TARGETS = "per_example: give the targets, e.g. per_example(fn, y); fn(out, y) is the loss"
TARGET_ROWS = (
    "per_example: target {index} has {rows} rows along dimension 0 and target 0 has "
    "{first}; every target holds one row per example of the batch"
)


class PerExample:
    """``fn(out, *targets)``: a loss that is a mean (``reduction="mean"``) or a sum over the
    rows (examples) of ``out`` and of each target. See :func:`per_example`."""

    def __init__(self, fn: Callable[..., torch.Tensor], targets: tuple[torch.Tensor, ...],
                 reduction: str) -> None:  # fmt: skip
        self.fn, self.targets, self.reduction = fn, targets, reduction

    @property
    def batch(self) -> int:
        """Examples in the batch (rows of the targets)."""
        return int(self.targets[0].shape[0])

    def __call__(self, out: Any) -> torch.Tensor:
        return self.fn(out, *self.targets)

    def rows(self, start: int, stop: int) -> Callable[[Any], torch.Tensor]:
        """The loss of examples ``start:stop`` (their output only), weighted by
        ``(stop - start) / batch`` for a mean, so the slices' losses add up to this one."""
        part = tuple(t[start:stop] for t in self.targets)
        weight = (stop - start) / self.batch if self.reduction == "mean" else 1.0
        fn = self.fn

        def loss_fn(out: Any) -> torch.Tensor:
            loss = fn(out, *part)
            return loss * weight if weight != 1.0 else loss

        return loss_fn


def per_example(fn: Callable[..., torch.Tensor], *targets: torch.Tensor,
                reduction: str = "mean") -> PerExample:  # fmt: skip
    """Declare ``loss_fn = lambda out: fn(out, *targets)`` a mean (or sum) over examples.

    Every engine takes the result as an ordinary ``loss_fn``; the ``accumulate`` engine
    and :func:`leangrad.plan` use the declaration to split the batch into micro-batches,
    each with its rows of ``targets`` (gradient accumulation, exact for such a loss where
    no layer couples the examples).

    Args:
        fn: ``fn(out, *targets) -> scalar``, a mean (or sum) over the rows of ``out`` and
            the targets, e.g. ``lambda out, y: F.cross_entropy(out.flatten(0, 1),
            y.flatten())`` for a language model whose every example has as many tokens.
        targets: tensors with one row per example along dimension 0.
        reduction: ``"mean"`` (each example weighs 1/batch) or ``"sum"``.

    Example::

        loss_fn = leangrad.loss.per_example(lambda out, y: F.cross_entropy(out, y), y)
        leangrad.engine("accumulate", micro_batches=4).backward(model, x, loss_fn)
    """
    if reduction not in ("mean", "sum"):
        raise ValueError(BAD_REDUCTION.format(value=reduction))
    if not targets:
        raise errors.EngineInputError(NO_TARGETS)
    first = targets[0].shape[0] if targets[0].dim() else 0
    for i, t in enumerate(targets):
        rows = t.shape[0] if t.dim() else 0
        if rows != first or rows == 0:
            raise errors.EngineInputError(TARGET_ROWS.format(index=i, rows=rows, first=first))
    return PerExample(fn, tuple(targets), reduction)
