"""The loss function an engine is handed, and the two checks every engine runs around it:
the forward call (:func:`run_forward`) and the loss it returns (:func:`check_loss`).

They sit below :mod:`~leangrad.engines._base` (the engine interface),
:mod:`~leangrad.engines._contract` and :mod:`~leangrad.engines._functional`, which all
use them, so that none of those imports another in a circle; ``_base``
re-exports them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeAlias

import torch

from .. import _errors as errors

__all__ = ["LossFn", "ModelRun", "check_loss", "run_forward"]

LossFn: TypeAlias = Callable[[Any], torch.Tensor]
"""Maps the model's output to a scalar loss (it closes over the targets)."""
ModelRun: TypeAlias = Callable[[Callable[..., Any], tuple[torch.Tensor, ...]], Any]
"""``run(fn, xs)``: how an engine calls the model ``fn`` on inputs ``xs`` (e.g.
:func:`run_forward` with its name bound, or a :class:`~._dropout.DropoutTape` recording)."""


def run_forward(engine: str, fn: Callable[..., Any], xs: tuple[torch.Tensor, ...]) -> Any:
    """Call ``fn(*xs)``; a failure names the engine and the input shapes."""
    try:
        return fn(*xs)
    except RuntimeError as err:
        shapes = [tuple(x.shape) for x in xs]
        raise errors.EngineInputError(
            errors.FORWARD_FAILED.format(engine=engine, shapes=shapes, error=err)
        ) from err


def check_loss(loss: Any, *, needs_graph: bool = True) -> torch.Tensor:
    """Validate what ``loss_fn`` returned: a floating scalar tensor (with a graph)."""
    if not isinstance(loss, torch.Tensor):
        raise errors.EngineInputError(errors.LOSS_NOT_TENSOR.format(type=type(loss).__name__))
    if loss.numel() != 1:
        raise errors.EngineInputError(errors.LOSS_NOT_SCALAR.format(shape=tuple(loss.shape)))
    if not loss.is_floating_point():
        raise errors.EngineInputError(errors.LOSS_NOT_FLOAT.format(dtype=loss.dtype))
    if needs_graph and loss.grad_fn is None:
        raise errors.EngineInputError(errors.LOSS_NO_GRAD)
    return loss if loss.dim() == 0 else loss.reshape(())  # no op to transform when scalar
