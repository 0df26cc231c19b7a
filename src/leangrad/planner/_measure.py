"""How :func:`leangrad.plan` measures a candidate: its step (the engine, with an optimizer
after backward or per layer inside ``on_grad``), its peak — for real with
:func:`leangrad.measure.profile_step`, or on fake tensors with
:func:`leangrad.measure.estimate_step` where the step cannot be allocated here — and the
row of the plan's table that records it.

Screening: a candidate whose fake-tensor estimate is above the budget by more than
:data:`ESTIMATE_MARGIN` is over budget without being run (its row says ``over budget
(estimate)``); every other candidate is measured for real, so no decision that a
measurement made rests on an estimate. It is safe because the estimate is the same tracker
on fake tensors (``tests/test_plan_estimate.py``), and a low one only sends a candidate to
be measured. No estimate screens where it counts what a measurement's warm-up step leaves
out (an optimizer's state, autocast), where fake tensors run a fused recurrent module one
time step at a time (:func:`stepwise_on_fake`), for forward-mode engines, nor for engines
whose estimate costs about a step (:attr:`~leangrad.engines.Engine.costly_estimate`) unless
this plan's real steps have taken :data:`COSTLY_FROM` times its cheapest fake one.

A real measurement (:func:`~leangrad.measure.profile_step`, ``repeats=0``) tracks a step
after a warm-up step where the first step is known to hold more than later ones (an
optimizer, whose first step makes its state; autocast). Any other step's first step is
tracked, and where it fits the budget its peak is the row's: one step instead of two.
Where it does not fit, a warm step is tracked and decides, except on the CPU where the first
step is over the budget by more than :data:`FIRST_STEP_MARGIN`. Engines whose first step
does extra work (:attr:`~leangrad.engines.Engine.probes`) are tracked on their first step
too: that work holds nothing at the step's peak (``tests/engines/test_first_step.py``), and
undeclared extra work could only make a fitting row's peak higher, never make a fit that a
warm step would not. Either way the candidate has run before it is timed, which is the
timing's warm-up (:mod:`leangrad.planner._choice` runs none of its own).

The measurements behind these rules and margins: docs/planner-evidence.md.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from .. import _errors as errors
from .._step import PER_LAYER, MakeOptimizer, Step
from ..engines import Engine, engine
from ..engines.checkpoint._time_chunks import fused_recurrent
from ..measure import estimate_step, profile_step

__all__ = [
    "BEATEN", "BEATEN_BECAUSE", "COSTLY_FROM", "ESTIMATED", "ESTIMATE_MARGIN", "FAILED",
    "FIRST_STEP_MARGIN", "PER_LAYER", "Context", "Tried", "failed_verdict", "key",
    "measure", "not_run", "revisit", "stepwise_on_fake", "too_big",
]

ESTIMATED = "estimate"
"""Verdict suffix of a row measured on fake tensors (too big to allocate here, or
confidently over budget)."""
ESTIMATE_MARGIN = 0.02
"""A candidate whose fake-tensor estimate is above ``(1 + this)`` × the budget is not run:
2.5 times the largest excess of an estimate over the tracked peak measured on the zoo's
candidates (the measurements behind this margin: docs/planner-evidence.md)."""
COSTLY_FROM = 50.0
"""An engine whose estimate costs about as much as a step
(:attr:`~leangrad.engines.Engine.costly_estimate`) is estimated all the same where this
plan's real steps so far took at least this many times its cheapest fake step: there the
model's work is in its kernels, which fake tensors skip, not in its operators' count (the
measurements behind this threshold: docs/planner-evidence.md)."""
FIRST_STEP_MARGIN = 0.005
"""On the CPU, a first step whose peak is above ``(1 + this)`` × the budget is over budget
without being tracked again, warm: 25 times the largest first-step excess measured since the
tracker's fixes (the measurements behind this margin: docs/planner-evidence.md). Not used on
other devices: CUDA's first step was not measured so (its libraries allocate workspaces on
first use)."""


def too_big(model: nn.Module, xs: tuple[torch.Tensor, ...],
             loss_fn: Callable[[Any], torch.Tensor], limit: int) -> bool:  # fmt: skip
    """Backprop's step, estimated on fake tensors, needs more than ``limit`` bytes (a step
    whose ops fake tensors cannot run is measured for real, as if it fitted)."""
    try:
        return estimate_step(engine("backprop"), model, xs, loss_fn).peak_bytes > limit
    except Exception:  # any op fake tensors cannot run: measure for real
        return False


def stepwise_on_fake(model: nn.Module) -> str | None:
    """The name of a fused recurrent module (``nn.GRU``, ``nn.RNN``; ``nn.LSTM`` in float64)
    that fake tensors run one time step at a time — it has no fused kernel on its device,
    so its ATen op decomposes into a few ops per step, each dispatched through Python —
    else ``None``. Found by counting the ops one layer dispatches on 2 and on 4 fake time
    steps (what such estimates cost: docs/planner-evidence.md)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._python_dispatch import TorchDispatchMode

    class _Count(TorchDispatchMode):
        ops = 0

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                               kwargs: Any = None) -> Any:  # fmt: skip
            self.ops += 1
            return func(*args, **(kwargs or {}))

    def dispatched(rnn: nn.RNNBase, steps: int) -> int:
        w = next(rnn.parameters())
        shape = (1, steps, rnn.input_size) if rnn.batch_first else (steps, 1, rnn.input_size)
        with FakeTensorMode(allow_non_fake_inputs=True), torch.no_grad(), _Count() as c:
            rnn(torch.empty(shape, dtype=w.dtype, device=w.device))
        return c.ops

    for name, m in fused_recurrent(model):
        try:
            if dispatched(m, 4) > dispatched(m, 2):
                return name
        except Exception:  # an input fake tensors cannot run: the estimate says so
            continue
    return None


def _out_of_memory(err: BaseException) -> bool:
    """An allocation failed: CUDA's OutOfMemoryError or the CPU allocator's refusal."""
    return isinstance(err, torch.OutOfMemoryError) or (
        isinstance(err, RuntimeError) and "can't allocate memory" in str(err))  # fmt: skip


@dataclasses.dataclass
class Clock:
    """The seconds of the cheapest fake-tensor estimate and of the cheapest real tracked
    step a plan has taken so far (:data:`COSTLY_FROM`)."""

    fake: float = float("inf")
    real: float = float("inf")

    def fakes_cheap(self) -> bool:
        """Real steps (one at least) have taken :data:`COSTLY_FROM` times the cheapest fake
        one or more."""
        seen = max(self.fake, self.real) < float("inf")  # one of each
        return seen and self.real >= COSTLY_FROM * self.fake


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
    autocast: torch.dtype | None = None
    """Planning under ``torch.autocast`` with this dtype: every step runs in its own
    context (:class:`~leangrad._step.Step`), as ``train --precision`` runs it, so its cast
    copies of the weights are made inside it and count in its peak (one context around
    the whole plan kept them cached from the first step on, and no later step counted
    them). No estimate decides alone there (not compared with a real step's peak)."""
    screen: bool = True
    """Whether fake-tensor estimates may rule candidates out (:data:`ESTIMATE_MARGIN`):
    not where fake tensors run a fused recurrent module one time step at a time
    (:func:`stepwise_on_fake`), which makes an estimate cost several real steps."""
    clock: Clock = dataclasses.field(default_factory=Clock)
    """How long this plan's fake and real steps took (:data:`COSTLY_FROM`)."""
    within: bool = False
    """The plan itself stays within the budget (``plan(within_budget=True)``): every
    candidate is estimated on fake tensors before it runs, whatever that costs in time,
    and runs only where the estimate fits (no margin); one fake tensors cannot run is not
    run (:data:`UNESTIMATED`)."""

    @property
    def screen_above(self) -> float:
        """Bytes above which an estimate rules a candidate out: the budget plus
        :data:`ESTIMATE_MARGIN`, or the budget itself where the plan stays within it."""
        return (1 + (0 if self.within else ESTIMATE_MARGIN)) * self.budget


@dataclasses.dataclass(frozen=True)
class Tried:
    """One candidate's measurement. ``compile_seconds`` and ``time_ratio`` are a
    compiled row's (:mod:`leangrad.planner._compile`): its cold compile's seconds, and its
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
    warm: bool = True
    """The peak is a warm step's (``False``: the first step's, kept because it fitted)."""
    screened: bool = False
    """Not run: its fake-tensor estimate was over the budget by more than the margin."""
    beaten: bool = False
    """Not run: a step that does a strict part of its work fits (:data:`BEATEN`)."""

    @property
    def fits(self) -> bool:
        return self.peak is not None and self.verdict.startswith("fits")


def key(name: str, options: dict[str, Any]) -> str:
    """A candidate's name and options as one dictionary key."""
    return f"{name} {options!r}"


BEATEN = "not run: {by} fits and does a strict part of its work, nothing else differently"
"""Verdict of a candidate one of whose :attr:`~leangrad.engines._base.PlanOffer.beaten_by`
fits (or is itself beaten by one that fits): it recomputes more of the same and cannot be
faster, so it is neither measured nor timed."""
BEATEN_BECAUSE = "not run: {by} fits and {why}"
""":data:`BEATEN` where the step that fits is not a strict part of this one's work
(:attr:`~leangrad.engines._base.PlanOffer.beaten_why` says why it cannot be slower)."""


def not_run(name: str, options: dict[str, Any], ctx: Context, tried: list[Tried], *,
            by: str, why: str | None = None) -> None:  # fmt: skip
    """Append the rows of a candidate beaten by the fitting row ``by`` (:data:`BEATEN`, or
    :data:`BEATEN_BECAUSE` with ``why``), one per optimizer kind as :func:`measure` would."""
    eng = engine(name, **options)
    verdict = BEATEN.format(by=by) if why is None else BEATEN_BECAUSE.format(by=by, why=why)
    for per_layer in [None] if ctx.optimizer is None else [False, True]:
        step = _make_step(name, options, ctx, per_layer, eng)
        tried.append(Tried(None, step.label, eng.exact, None, verdict, name, dict(options),
                           bool(per_layer), beaten=True))  # fmt: skip


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
            tried.append(_measure_kind(name, opts, ctx, per_layer, eng, why))


def _measure_kind(name: str, opts: dict[str, Any], ctx: Context, per_layer: bool | None,
                  eng: Engine, why: str | None) -> Tried:  # fmt: skip
    """One candidate's row, its optimizer stepped after backward or per layer (without one:
    ``per_layer`` is ``None``); ``why``: the reason it does not apply, if any."""
    step = _make_step(name, opts, ctx, per_layer, eng)
    row = functools.partial(Tried, label=step.label, exact=eng.exact, name=name,
                            options=dict(opts), per_layer=bool(per_layer))  # fmt: skip
    if why is not None:
        return row(engine=None, peak=None, verdict=f"n/a: {why}")
    if ctx.progress is not None:
        ctx.progress(f"peak of {step.label}")
    screen = _estimate(step, name, opts, per_layer, ctx)
    if ctx.within and screen is None:
        return row(engine=None, peak=None, verdict=UNESTIMATED)
    if screen is not None and screen > ctx.screen_above:
        return row(engine=step, peak=screen, verdict=f"over budget ({ESTIMATED})", estimate=True,
                   screened=True)  # fmt: skip
    try:
        peak, est, warm = _peak(step, name, opts, per_layer, ctx)
    except errors.LeangradError as err:
        return row(engine=None, peak=None, verdict=f"n/a: {err}")
    except Exception as err:  # a candidate's own failure is a row, not the plan's
        if name == "backprop":  # the reference: the model or loss itself fails
            raise
        return row(engine=None, peak=None, verdict=failed_verdict(err))
    return row(engine=step, peak=peak, verdict=_verdict(peak, ctx.budget, est), estimate=est,
               warm=warm)  # fmt: skip


UNESTIMATED = ("not run: fake tensors cannot estimate its peak, and plan(within_budget=True) "
               "runs only steps estimated to fit")  # fmt: skip
"""Verdict of a candidate a plan that stays within its budget could not estimate."""


def _verdict(peak: int, budget: int, estimate: bool) -> str:
    return ("fits" if peak <= budget else "over budget") + (f" ({ESTIMATED})" if estimate else "")


def revisit(rows: Sequence[Tried], ctx: Context, tried: list[Tried]) -> None:
    """``rows``, one candidate's as an earlier plan of the same step measured them, judged
    against this plan's budget and appended to ``tried``. A peak is the same at any budget,
    so only a row that could now be judged differently is stepped again: one its estimate
    screened out that the margin no longer rules out (measured now), and one whose
    first-step peak does not decide alone at this budget (tracked again, warm, as
    :func:`_measured` would have). A compiled row keeps its fresh process's peak."""
    for t in rows:
        if t.engine is None or t.peak is None:  # n/a or failed: the same at any budget
            tried.append(t)
        elif t.screened:
            if t.peak > ctx.screen_above:
                tried.append(t)
                continue
            eng = t.engine.engine if isinstance(t.engine, Step) else t.engine
            per_layer = None if ctx.optimizer is None else t.per_layer  # as measure's kinds
            tried.append(_measure_kind(t.name, t.options, ctx, per_layer, eng, None))
        elif not t.warm and t.peak > ctx.budget and not _far_over(t.peak, ctx):
            if ctx.progress is not None:
                ctx.progress(f"peak of {t.label}")
            peak = profile_step(t.engine, ctx.model, ctx.xs, ctx.loss_fn, repeats=0,
                                warmup=0).total_bytes  # fmt: skip
            tried.append(dataclasses.replace(t, peak=peak, warm=True,
                                             verdict=_verdict(peak, ctx.budget, False)))
        else:  # its note (" (estimate)", a compiled row's " (RSS-scaled)") stays
            note = t.verdict.removeprefix("fits").removeprefix("over budget")
            verdict = ("fits" if t.peak <= ctx.budget else "over budget") + note
            tried.append(dataclasses.replace(t, verdict=verdict))


FAILED = "failed: {kind}: {error}"
"""Verdict of a candidate that raised something other than a leangrad refusal."""


def failed_verdict(err: BaseException) -> str:
    """One line naming what a failed candidate raised (the plan goes on without it)."""
    first = str(err).strip().splitlines()
    return FAILED.format(kind=type(err).__name__, error=first[0][:200] if first else "")


def _make_step(name: str, opts: dict[str, Any], ctx: Context, per_layer: bool | None,
               eng: Engine | None = None) -> Any:  # fmt: skip
    """The candidate's engine, wrapped in a :class:`~leangrad._step.Step` with an optimizer
    or under autocast (each step its own context)."""
    eng = eng if eng is not None else engine(name, **opts)
    if ctx.autocast is not None:
        return Step(eng, ctx.optimizer, per_layer=bool(per_layer), autocast=ctx.autocast)
    if ctx.optimizer is None or per_layer is None:
        return eng
    return Step(eng, ctx.optimizer, per_layer=per_layer)


def _estimate(step: Any, name: str, opts: dict[str, Any], per_layer: bool | None,
              ctx: Context) -> int | None:  # fmt: skip
    """The step's fake-tensor estimate (total bytes), or ``None`` where it is not asked
    (the module docstring says where, and why) or fake tensors cannot run the step. Above
    the budget by more than :data:`ESTIMATE_MARGIN` it rules the candidate out."""
    eng = step.engine if isinstance(step, Step) else step
    if ctx.estimate_only:
        return None
    if not ctx.within and (ctx.optimizer is not None or ctx.autocast or not ctx.screen or
                           eng.forward_mode or
                           (eng.costly_estimate and not ctx.clock.fakes_cheap())):  # fmt: skip
        return None
    start = time.perf_counter()
    try:
        est = estimate_step(_make_step(name, opts, ctx, per_layer), ctx.model,
                            ctx.xs, ctx.loss_fn).total_bytes  # fmt: skip
    except Exception:  # an op fake tensors cannot run, or the candidate's own failure:
        return None  # the real measurement says which
    ctx.clock.fake = min(ctx.clock.fake, time.perf_counter() - start)
    return est


def _measured(step: Any, ctx: Context) -> tuple[int, bool]:
    """The step's total bytes, tracked for real: its first step where that fits the budget
    or is far over it (:func:`_far_over`), else (or under an optimizer or autocast) a step after a
    warm-up (the module docstring says why); and whether they are a warm step's."""

    def tracked(warmup: int) -> int:
        start = time.perf_counter()
        peak = profile_step(step, ctx.model, ctx.xs, ctx.loss_fn, repeats=0,
                            warmup=warmup).total_bytes  # fmt: skip
        ctx.clock.real = min(ctx.clock.real, (time.perf_counter() - start) / (1 + warmup))
        return peak

    if ctx.optimizer is not None or ctx.autocast:
        return tracked(1), True
    first = tracked(0)
    if first <= ctx.budget or _far_over(first, ctx):
        return first, False
    return tracked(0), True  # warm: as tracked(1)


def _far_over(first: int, ctx: Context) -> bool:
    """On the CPU (where this rule was measured), a first step's peak over the budget by
    more than :data:`FIRST_STEP_MARGIN`: over budget without tracking a warm step."""
    device = ctx.xs[0].device if ctx.xs else next(ctx.model.parameters()).device
    return device.type == "cpu" and first > (1 + FIRST_STEP_MARGIN) * ctx.budget


def _peak(step: Any, name: str, opts: dict[str, Any], per_layer: bool | None,
          ctx: Context) -> tuple[int, bool, bool]:  # fmt: skip
    """The step's total bytes, whether they are a fake-tensor estimate, and whether they
    are a warm step's (an estimate's count as warm: no first step's extra work)."""
    if not ctx.estimate_only:
        try:
            peak, warm = _measured(step, ctx)
            return peak, False, warm
        except Exception as err:  # only running out of memory falls back to an estimate
            if not _out_of_memory(err):
                raise
    if (step.engine if isinstance(step, Step) else step).forward_mode:  # a failed vmap-of-jvp
        # on fake tensors can leave autograd excluded in the dispatcher's thread state
        # (torch 2.13): never estimated
        raise errors.EngineInputError("too big to allocate here, and forward-mode engines are not "
                                 "estimated on fake tensors")
    fresh = _make_step(name, opts, ctx, per_layer)  # no real state in a fake step
    try:
        return estimate_step(fresh, ctx.model, ctx.xs, ctx.loss_fn).total_bytes, True, True
    except errors.LeangradError:
        raise
    except Exception as err:  # an op fake tensors cannot run
        raise errors.EngineInputError(f"too big to allocate here and cannot be estimated "
                                 f"on fake tensors ({type(err).__name__}: {err})") from err
