"""How a step is spread over processes: the modes ``fit(parallel=...)``,
``leangrad train --parallel`` and ``leangrad plan --parallel`` take, and which engines
FSDP2 can train.

One home for the rules that :mod:`leangrad.train` (which runs the modes,
:mod:`leangrad.train._sharded`) and the per-rank estimates (:mod:`leangrad.planner._ranks`)
both apply, below both, so that neither reaches up into the other.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .. import _errors as errors
from ..engines._wrapped import FSDP2

if TYPE_CHECKING:
    from torch import nn

    from ..engines import Engine

__all__ = ["BAD_PARALLEL", "FSDP_ENGINE", "PARALLEL", "check_parallel", "fsdp_refusal"]

PARALLEL = ("ddp", "fsdp")
"""How ``fit`` spreads a step over processes (under torchrun; ignored on one process)."""

BAD_PARALLEL = "parallel must be one of {names}, got {value!r}"
FSDP_ENGINE = (
    "--parallel fsdp trains through FSDP2's own backward, which {engine} does not run "
    "(it would keep each process's gradient shard unreduced); use --engine backprop, "
    "checkpoint, chunked_ce, accumulate or a composition of them (checkpoint+chunked_ce), "
    "or --parallel ddp"
)


def check_parallel(value: str) -> str:
    """``value`` if it is one of :data:`PARALLEL`.

    Raises:
        OptionError: any other value (the message lists the modes).
    """
    if value not in PARALLEL:
        raise errors.OptionError(BAD_PARALLEL.format(names=", ".join(PARALLEL), value=value))
    return value


def fsdp_refusal(eng: Engine, model: nn.Module) -> str | None:
    """Why ``fit(parallel="fsdp")`` cannot train ``model`` with ``eng`` (it must run FSDP2's
    own backward: ``wrapped_models``, and whatever the engine's ``wrapped_why`` refuses on
    an FSDP2 model, e.g. checkpoint's options that regroup blocks), or ``None``."""
    if not eng.wrapped_models:
        return FSDP_ENGINE.format(engine=eng.label)
    why = getattr(eng, "wrapped_why", None)  # engines that vet their options per wrapper
    return why(model, FSDP2) if callable(why) else None
