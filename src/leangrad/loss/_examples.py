"""A loss declared as a mean (or sum) over the examples of the batch, so that a step may
run the batch in micro-batches and add their gradients (gradient accumulation).

``loss_fn(out)`` closes over the batch's targets, so nothing can tell from it which
targets belong to which rows of the output. :func:`per_example` holds the targets beside
the loss function: called on the whole batch's output it is an ordinary ``loss_fn``, and
:meth:`PerExample.rows` gives the loss of a slice of the batch, weighted so that the
micro-batches' losses — and so their gradients — add up to the whole batch's.

A mean over *tokens* (cross-entropy of a padded batch, whose labels hold
``ignore_index``) weighs each example by its counted tokens, not equally: a micro-batch's
share of it is its share of the counted tokens. ``ignore_index=`` (or ``counts=``) says
so; a ``"mean"`` whose first target holds -100 (PyTorch's and Hugging Face's
``ignore_index``) in unequal numbers per example, declared without either, is refused
when split rather than weighted wrongly.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch._subclasses.fake_tensor import is_fake
from torch.utils import _pytree as pytree

from .. import _errors as errors

__all__ = ["PerExample", "per_example"]

BAD_REDUCTION = "per_example: reduction must be 'mean' or 'sum', got {value!r}"
NO_TARGETS = "per_example: give the targets, e.g. per_example(fn, y); fn(out, y) is the loss"
UNEQUAL_TOKENS = (
    "per_example: target 0 holds -100 (cross-entropy's ignore_index) in unequal numbers per "
    "example, so a mean over its tokens weighs each example by its counted tokens, and "
    "micro-batches weighted by their examples would not add up to the batch's loss; declare "
    "per_example(fn, labels, ignore_index=-100) (or counts=, one weight per example), or "
    "reduction='sum'"
)
BAD_COUNTS = "per_example: counts must be one number per example (shape ({batch},)), got {shape}"
TARGET_ROWS = (
    "per_example: target {index} has {rows} rows along dimension 0 and target 0 has "
    "{first}; every target holds one row per example of the batch"
)


class PerExample:
    """``fn(out, *targets)``: a loss that is a mean (``reduction="mean"``) or a sum over the
    rows (examples) of ``out`` and of each target. See :func:`per_example`."""

    def __init__(self, fn: Callable[..., torch.Tensor], targets: tuple[torch.Tensor, ...],
                 reduction: str, counts: torch.Tensor | None = None) -> None:  # fmt: skip
        self.fn, self.targets, self.reduction = fn, targets, reduction
        self.counts = counts
        """Each example's weight in the mean (its counted tokens), or ``None``: equal."""

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
        weight = self.share(start, stop) if self.reduction == "mean" else 1.0
        fn = self.fn

        def loss_fn(out: Any) -> torch.Tensor:
            if weight == 0.0:  # no counted token here: its mean is 0/0, its share nothing
                leaves = [o for o in pytree.tree_leaves(out)
                          if isinstance(o, torch.Tensor) and o.is_floating_point()]  # fmt: skip
                return sum((o.sum() * 0.0 for o in leaves), torch.zeros(()))
            loss = fn(out, *part)
            return loss * weight if weight != 1.0 else loss

        return loss_fn

    def share(self, start: int, stop: int) -> float:
        """Examples ``start:stop``'s share of the mean: their count of examples, or of
        counted tokens (``counts``), over the batch's (on fake tensors, which a memory
        estimate runs on, the examples')."""
        if self.counts is None or is_fake(self.counts):  # a memory estimate: no values
            first = self.targets[0]
            if not is_fake(first) and not first.is_floating_point() and first.dim() > 1:
                per_row = (first == -100).flatten(1).sum(1)
                if bool((per_row != per_row[0]).any()):
                    raise errors.EngineInputError(UNEQUAL_TOKENS)
            return (stop - start) / self.batch
        total = float(self.counts.sum())
        return float(self.counts[start:stop].sum()) / total if total else 0.0


def per_example(fn: Callable[..., torch.Tensor], *targets: torch.Tensor,
                reduction: str = "mean", ignore_index: int | None = None,
                counts: torch.Tensor | None = None) -> PerExample:  # fmt: skip
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
        ignore_index: ``fn`` is a mean over the tokens of ``targets[0]`` that are not
            ``ignore_index`` (``F.cross_entropy(..., ignore_index=-100)``, Hugging Face's
            ``labels``): each example weighs its count of them. ``targets[0]`` must hold
            exactly the labels the mean runs over: a causal LM's shifted ``labels[:, 1:]``.
        counts: each example's weight in the mean, one number per example (e.g. its
            count of unmasked positions), for a mean over other counted elements.

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
    if ignore_index is not None and counts is None:
        counts = (targets[0] != ignore_index).flatten(1).sum(1) if targets[0].dim() > 1 else (
            targets[0] != ignore_index).long()  # fmt: skip
    if counts is not None and tuple(counts.shape) != (first,):
        raise errors.EngineInputError(BAD_COUNTS.format(batch=first, shape=tuple(counts.shape)))
    return PerExample(fn, tuple(targets), reduction, counts)
