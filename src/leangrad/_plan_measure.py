"""How :func:`leangrad.plan` measures a candidate: its step (the engine, with an optimizer
after backward or per layer inside ``on_grad``), its peak — for real with
:func:`leangrad.measure.profile_step`, or on fake tensors with
:func:`leangrad.measure.estimate_step` where the step cannot be allocated here — and the
row of the plan's table that records it."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from . import _errors as errors
from ._step import PER_LAYER, MakeOptimizer, Step
from .engines import Engine, engine
from .measure import estimate_step, profile_step

__all__ = [
    "ESTIMATED", "FAILED", "PER_LAYER", "Context", "Tried", "failed_verdict",
    "measure", "too_big",
]

ESTIMATED = "estimate"
"""Verdict suffix of a row measured on fake tensors (too big to allocate here)."""


"""The planner's former name of :class:`leangrad._step.Step` (``Step(engine, make,
per_layer=)``), kept while ``_plan.py`` and the bench's worker still use it."""


def too_big(model: nn.Module, xs: tuple[torch.Tensor, ...],
             loss_fn: Callable[[Any], torch.Tensor], limit: int) -> bool:  # fmt: skip
    """Backprop's step, estimated on fake tensors, needs more than ``limit`` bytes (a step
    whose ops fake tensors cannot run is measured for real, as if it fitted)."""
    try:
        return estimate_step(engine("backprop"), model, xs, loss_fn).peak_bytes > limit
    except Exception:  # any op fake tensors cannot run: measure for real
        return False


def _out_of_memory(err: BaseException) -> bool:
    """An allocation failed: CUDA's OutOfMemoryError or the CPU allocator's refusal."""
    return isinstance(err, torch.OutOfMemoryError) or (
        isinstance(err, RuntimeError) and "can't allocate memory" in str(err))  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Context:
    """What every candidate's measurement shares."""

    model: nn.Module
    xs: tuple[torch.Tensor, ...]
    loss_fn: Callable[[Any], torch.Tensor]
    budget: int
    exact: bool
    optimizer: MakeOptimizer | None
    progress: Callable[[str], None] | None
    estimate_only: bool


@dataclasses.dataclass(frozen=True)
class Tried:
    """One candidate's measurement. ``compile_seconds`` and ``time_ratio`` are a
    compiled row's (:mod:`leangrad._plan_compile`): its cold compile's seconds, and its
    step's time over eager backprop's in the worker (the plan scales backprop's median by
    it, for the row is not timed in this process)."""

    engine: Any  # an Engine, or a Step around one
    label: str
    exact: bool
    peak: int | None
    verdict: str
    name: str
    options: dict[str, Any]
    per_layer: bool = False
    estimate: bool = False
    compile_seconds: float | None = None
    time_ratio: float | None = None

    @property
    def fits(self) -> bool:
        return self.peak is not None and self.verdict.startswith("fits")


def measure(todo: Sequence[tuple[str, dict[str, Any]]], ctx: Context,
             tried: list[Tried]) -> None:  # fmt: skip
    """Measure each candidate's peak (for real, or on fake tensors where it cannot be
    allocated) and append what was found to ``tried``."""
    for name, opts in todo:
        eng = engine(name, **opts)
        kinds: list[bool | None] = [None] if ctx.optimizer is None else [False, True]
        if not ctx.exact or eng.exact:
            try:
                why = eng.supports(ctx.model)
                if why is None:
                    why = eng.idle_reason(ctx.model)
            except errors.LeangradError as err:
                why = str(err)
            except Exception as err:  # e.g. block discovery failing on this model
                tried.append(Tried(None, eng.label, eng.exact, None, failed_verdict(err),
                                   name, dict(opts)))  # fmt: skip
                continue
        else:
            why = "not exact (plan with exact=False to allow estimators)"
        for per_layer in kinds:
            step = _make_step(name, opts, ctx.optimizer, per_layer, eng)
            row = functools.partial(Tried, label=step.label, exact=eng.exact, name=name,
                                    options=dict(opts), per_layer=bool(per_layer))  # fmt: skip
            if why is not None:
                tried.append(row(engine=None, peak=None, verdict=f"n/a: {why}"))
                continue
            if ctx.progress is not None:
                ctx.progress(f"peak of {step.label}")
            try:
                peak, est = _peak(step, name, opts, per_layer, ctx)
            except errors.LeangradError as err:
                tried.append(row(engine=None, peak=None, verdict=f"n/a: {err}"))
                continue
            except Exception as err:  # a candidate's own failure is a row, not the plan's
                if name == "backprop":  # the reference: the model or loss itself fails
                    raise
                tried.append(row(engine=None, peak=None, verdict=failed_verdict(err)))
                continue
            verdict = "fits" if peak <= ctx.budget else "over budget"
            if est:
                verdict += f" ({ESTIMATED})"
            tried.append(row(engine=step, peak=peak, verdict=verdict, estimate=est))


FAILED = "failed: {kind}: {error}"
"""Verdict of a candidate that raised something other than a leangrad refusal."""


def failed_verdict(err: BaseException) -> str:
    """One line naming what a failed candidate raised (the plan goes on without it)."""
    first = str(err).strip().splitlines()
    return FAILED.format(kind=type(err).__name__, error=first[0][:200] if first else "")


def _make_step(name: str, opts: dict[str, Any], optimizer: MakeOptimizer | None,
               per_layer: bool | None, eng: Engine | None = None) -> Any:  # fmt: skip
    """The candidate's engine, wrapped in a :class:`~leangrad._step.Step` with an optimizer."""
    eng = eng if eng is not None else engine(name, **opts)
    if optimizer is None or per_layer is None:
        return eng
    return Step(eng, optimizer, per_layer=per_layer)


def _peak(step: Any, name: str, opts: dict[str, Any], per_layer: bool | None,
          ctx: Context) -> tuple[int, bool]:  # fmt: skip
    """The step's total bytes, and whether they are a fake-tensor estimate."""
    if not ctx.estimate_only:
        try:
            return profile_step(step, ctx.model, ctx.xs, ctx.loss_fn, repeats=0).total_bytes, False
        except Exception as err:  # only running out of memory falls back to an estimate
            if not _out_of_memory(err):
                raise
    if (step.engine if isinstance(step, Step) else step).forward_mode:  # a failed vmap-of-jvp
        # on fake tensors can leave autograd excluded in the dispatcher's thread state
        # (torch 2.13): never estimated
        raise errors.EngineInputError("too big to allocate here, and forward-mode engines are not "
                                 "estimated on fake tensors")
    fresh = _make_step(name, opts, ctx.optimizer, per_layer)  # no real state in a fake step
    try:
        return estimate_step(fresh, ctx.model, ctx.xs, ctx.loss_fn).total_bytes, True
    except errors.LeangradError:
        raise
    except Exception as err:  # an op fake tensors cannot run
        raise errors.EngineInputError(f"too big to allocate here and cannot be estimated "
                                 f"on fake tensors ({type(err).__name__}: {err})") from err
