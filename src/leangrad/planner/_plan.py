"""``leangrad.plan``: the fastest way to train *this* model in a memory budget.

The planner tries the ways of computing a step that apply to the model — plain backprop,
checkpointing its blocks (per block, ``"auto"`` and ``"sqrt"`` segments for a sequence;
fused ``nn.LSTM``/``nn.GRU``/``nn.RNN`` modules in 2 to 16 time chunks), cross-entropy that
never computes the logits where the model ends in a vocabulary-sized ``nn.Linear``
(``chunked_ce``, alone and under checkpointing: :mod:`leangrad.loss`), gradient
accumulation over micro-batches where the loss is declared a mean over examples
(:func:`leangrad.loss.per_example`) and no layer couples them (``accumulate``, alone and
under checkpointing; each candidate's time is for the whole batch),
nested forward-AD of its custom activation chains and the exact 1-bit masks of
:mod:`leangrad.bits`, alone and under checkpointing, Moonwalk
and RevBackprop where the model is a ``leangrad.Chain``, and, only when ``exact=False``,
randomized AD and Highway-BP — with an ``optimizer``, each also with per-layer optimizer
steps inside ``on_grad`` (gradients never all live at once: Moonwalk v1, Algorithm 1), and
with ``compile=True`` ``torch.compile`` itself, default and with an
``activation_memory_budget``, and each block compiled (regional compilation, with and
without checkpointing), each measured in a fresh process (:mod:`leangrad.planner._compile`) —
measures each one's peak memory with the allocator-level
tracker (:func:`leangrad.measure.profile_step`), times the ones that fit side by side
(medians of interleaved repeats), and returns the fastest that fits, with the table it
decided from; candidates within timing noise of the fastest are timed again, and a tie
they still make is broken by a stated rule (:mod:`leangrad.planner._choice`). Nothing fits:
it says so and names the smallest peak it found.

Where the time goes: steps, a few seconds each at full size, so a plan spends them only
where they decide. A candidate is not run where its fake-tensor estimate is over the budget
by more than :data:`leangrad.planner._measure.ESTIMATE_MARGIN`; nor where it does all of a
fitting candidate's work and more, so it cannot be faster
(:attr:`leangrad.engines._base.PlanOffer.beaten_by`: the same checkpointing of more blocks
or in two levels, checkpointing where the same step without it fits, blocks recomputed in k
fragments of the batch where k micro-batches fit,
:data:`leangrad.engines.checkpoint._offers.MICRO_BATCHED`; such beaters are measured first:
:func:`beaters_first`); nor as the same step in more pieces where it fits in fewer
(:data:`MORE_PIECES`); nor, on a CNN with BatchNorm in every block, as every block in
fragments where the largest few in as many fit
(:data:`leangrad.engines.checkpoint._offers.BN_EVERY`). One whose first step fits is not
run twice (:mod:`leangrad.planner._measure`); the timing's first round is a race
(:data:`leangrad.planner._choice.RACE`), the second round keeps the first round's rounds of
its contenders, no round runs a warm-up of its own, and the chosen step's peak is
re-measured without another warm-up. Planning the same step at several budgets, a plan after the
first takes the earlier one's peaks and warm engines (``reuse=``:
:func:`leangrad.planner._measure.revisit` says which rows are stepped again), so only the
timing of what fits is repeated. The measurements behind each rule, and the steps a plan
takes with and without them: docs/planner-evidence.md.

A step too big to allocate here (backprop's estimate above ``allocate_limit``, or a
candidate that runs out of memory) is measured on fake tensors instead
(:func:`leangrad.measure.estimate_step`: shapes only, nothing allocated); such rows are
labelled estimates and cannot be timed, so among them the planner keeps its candidate
order (least recomputation first) and says that it did.
"""

from __future__ import annotations

import copy
import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from .. import _errors as errors
from .._keywords import positional
from .._sizes import fmt_bytes, free_bytes
from .._step import Step, as_call
from ..engines import Engine, available, engine_class
from ..engines import engine as engine_named
from ..engines._base import PlanOffer
from ..engines._wrapped import wrapped_by
from ..measure import profile_step, time_interleaved
from ..measure._profile import untouched
from ._choice import Choice, choose, raced_note
from ._io import CHOSEN, Candidate, Measured, Plan, Progress, fingerprint
from ._measure import Context, Tried, measure, not_run, revisit, too_big
from ._measure import key as row_key
from ._measure import stepwise_on_fake as fake_is_stepwise

if TYPE_CHECKING:
    from .._step import MakeOptimizer

__all__ = ["Candidate", "Plan", "candidates", "plan"]

BAD_BUDGET = "budget must be a positive number of bytes, got {value!r}"
PLAN_WRAPPED = (
    "plan measures one process's step, and a {wrapper} model cannot be copied or measured "
    "alone: plan {unwrap} on one process, or plan under torchrun with `leangrad train "
    "--budget` (rank 0 plans and every rank trains its choice)"
)
BAD_SETTING = "plan: {name} must be {want}, got {value!r}"
NOT_TIMED = (" — peak is a fake-tensor estimate and untimed (too big to allocate here); "
             "chosen as the first fitting candidate in the planner's order")  # fmt: skip
NOTHING_FITS = (
    "nothing fits {budget}: the smallest peak found is {best} ({engine}); raise the budget, "
    "lower the batch size{inexact}"
)
NOT_COPYABLE = (
    "plan(optimizer=...) steps a copy of the model (copy.deepcopy) so yours is left as it "
    "was, and this model cannot be copied ({why}); plan without optimizer="
)
NOT_REUSABLE = (
    "plan(reuse=...) takes a plan of this same step made in this process, and this one {why}; "
    "plan without reuse="
)
BACKPROP = "backprop"
"""The reference a compiled row's time is scaled from (timed beside the candidates)."""
PIECES = ("fragments", "time_chunks", "micro_batches")
"""Options that cut one step's work into pieces: blocks recomputed in fragments of the
batch, a fused RNN checkpointed in time chunks, gradient accumulation's micro-batches."""
MORE_PIECES = ("runs the same work or less in fewer pieces (more fragments, time chunks or "
               "micro-batches of one step: 0.91-1.62× its time, median 1.01×, in 177 pairs "
               "timed by full-size plans)")
"""Why an offer is not run where the same step in fewer :data:`PIECES` fits
(:func:`coarser`; "or less" where the one that fits beats that step in turn): it runs the
same arithmetic in smaller pieces, so it can only lower the peak, and the plan asks for
the fastest step that fits, a lower peak deciding only between steps within the timing's
5% tie (:data:`leangrad.planner._choice.TIE`). With ``engines=`` every row is run. The
pairs timed behind this rule: docs/planner-evidence.md."""


def coarser(offer: PlanOffer, offers: Sequence[PlanOffer]) -> list[PlanOffer]:
    """The ``offers`` that are ``offer`` in fewer pieces (:data:`MORE_PIECES`): the same
    engine and options but :data:`PIECES`, each of those set in both, none more, one
    fewer."""
    mine = {k: v for k, v in offer.options.items() if k in PIECES}

    def rest(o: PlanOffer) -> dict[str, Any]:
        return {k: v for k, v in o.options.items() if k not in PIECES}

    return [o for o in offers if mine and o.name == offer.name and o.options != offer.options
            and o.options.keys() == offer.options.keys() and rest(o) == rest(offer)
            and all(o.options[k] <= v for k, v in mine.items())]  # fmt: skip


def candidates(model: nn.Module, *, exact: bool = True,
               loss_fn: Callable[[Any], torch.Tensor] | None = None,
               ) -> list[tuple[str, dict[str, Any]]]:  # fmt: skip
    """The ``(engine name, options)`` the planner tries on ``model``: what every registered
    engine offers (:meth:`~leangrad.engines.Engine.plan_candidates`, asked in the
    catalog's order), in the planner's order (:class:`~leangrad.engines._base.PlanOrder`:
    least recomputation first). With ``loss_fn`` declared a mean over examples
    (:func:`leangrad.loss.per_example`): gradient accumulation over 2, 4 and 8
    micro-batches too, alone and under checkpointing, where no layer couples the
    examples."""
    return [(o.name, o.options) for o in _offered(model, exact=exact, loss_fn=loss_fn)]


def _offered(model: nn.Module, *, exact: bool,
             loss_fn: Callable[[Any], torch.Tensor] | None) -> list[PlanOffer]:  # fmt: skip
    """:func:`candidates` as the engines offer them (with what beats each)."""
    from ..engines._blocks import blocks

    try:
        found = blocks(model)
    except errors.LeangradError:
        found = None
    offers = [offer for name in available()
              for offer in engine_class(name).plan_candidates(model, found=found,
                                                              loss_fn=loss_fn, exact=exact)]
    return sorted(offers, key=lambda o: o.order)  # stable


def beaters(offers: Sequence[PlanOffer], *, pieces: bool = True,
            ) -> dict[str, list[tuple[str, str | None]]]:  # fmt: skip
    """Each offer's key -> the keys of the offers that beat it, each with why (``None``: a
    strict part of its work): its :attr:`~leangrad.engines._base.PlanOffer.beaten_by`,
    its ``beaten_because`` and, with ``pieces``, the same step in fewer pieces
    (:func:`coarser`)."""
    return {row_key(o.name, o.options): [
        *((row_key(*b), o.beaten_why) for b in o.beaten_by),
        *((row_key(n, opts), why) for n, opts, why in o.beaten_because),
        *((row_key(c.name, c.options), MORE_PIECES)
          for c in (coarser(o, offers) if pieces else ())),
    ] for o in offers}  # fmt: skip


def beaters_first(offers: Sequence[PlanOffer], *, pieces: bool = True) -> list[PlanOffer]:
    """``offers`` in their order, but each after the offers that beat it (:func:`beaters`):
    the planner must know whether those fit before it decides to run this one.
    Micro-batches beat fragments of the batch and come later in the offers' order
    (``accumulate(micro_batches=k)`` is measured before ``checkpoint(fragments=k)``); the
    table keeps the offers' order."""
    by_key = {row_key(o.name, o.options): o for o in offers}
    beat = beaters(offers, pieces=pieces)
    out: list[PlanOffer] = []
    placed: set[str] = set()

    def place(o: PlanOffer, path: frozenset[str]) -> None:
        k = row_key(o.name, o.options)
        if k in placed or k in path:  # done, or a cycle (none is offered): as offered
            return
        for b, _ in beat[k]:
            if b in by_key:
                place(by_key[b], path | {k})
        placed.add(k)
        out.append(o)

    for o in offers:
        place(o, frozenset())
    return out


def last_resorts(model: nn.Module) -> list[tuple[str, dict[str, Any]]]:
    """Tried only when nothing else fits (:meth:`~leangrad.engines.Engine.
    plan_last_resorts`; ``forward`` below :data:`leangrad.engines._forward.
    FORWARD_MAX_PARAMS` parameters: it keeps
    nothing for a backward pass but costs one jvp per parameter, so it is never the
    fastest of engines that fit)."""
    return [(o.name, o.options) for o in _last_resorts(model)]


def _last_resorts(model: nn.Module) -> list[PlanOffer]:
    offers = [offer for name in available()
              for offer in engine_class(name).plan_last_resorts(model)]
    return sorted(offers, key=lambda o: o.order)


def plan(
    model: nn.Module,
    inputs: torch.Tensor | Sequence[torch.Tensor] | Mapping[str, Any],
    loss_fn: Callable[[Any], torch.Tensor],
    *,
    budget: int,
    exact: bool = True,
    optimizer: MakeOptimizer | None = None,
    engines: Sequence[tuple[str, dict[str, Any]]] | None = None,
    repeats: int = 3,
    allocate_limit: int | None = None,
    progress: Callable[[str], None] | bool | None = None,
    autocast: torch.dtype | None = None,
    compile: bool = False,
    reuse: Plan | None = None,
    within_budget: bool = False,
) -> Plan:
    """Find the fastest engine whose measured peak fits ``budget`` bytes.

    Args:
        model, inputs, loss_fn: one training step, as for ``engine.backward`` (inputs
            may be a mapping, as Hugging Face passes a batch).
        budget: bytes the step may use in all: parameters, buffers and inputs plus what
            the step allocates (activations, saved tensors, gradients, scratch: the
            tracker's peak). Optimizer state is not included.
        exact: only engines whose gradient equals autograd's (``False`` adds rad and
            highway).
        optimizer: makes an optimizer from a list of parameters (e.g.
            ``lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9)``). Each step then
            includes the optimizer step, and every candidate is also tried with the
            optimizer stepped per parameter inside ``on_grad`` (``Plan.per_layer``), which
            frees each gradient as soon as it is used. Measured on a copy of the model.
        engines: ``(name, options)`` to try instead of :func:`candidates` (each is run:
            none is skipped as beaten by another, as the engines' own offers can be).
        repeats: timed steps per fitting candidate (medians of interleaved repeats; the
            first round is a race: where steps take 0.5 s or more, a candidate more than
            1.5× the fastest's one round is out after it, and after a second round (a
            third to come) one whose faster round is more than 1.25× the leader's slower
            one, its row saying so). When the fastest is within noise of others — the
            spreads of their repeats overlap, or their medians are within 10% — it and at
            most two of them (the fastest medians) are timed again, interleaved, until each
            has ``max(5, 2 * repeats)`` rounds (its first ``repeats`` included); nothing
            else is. The fastest median of those wins, unless others are within 5% of it:
            then the tie is broken by the lower peak, then the simpler engine (fewer
            composed parts, a per-layer optimizer counting as one), then the planner's
            order, and the chosen row's ``tie_break`` and the message say so (``"within
            noise of chunked_ce (0.98×): chose by lower peak"``). The rule:
            :mod:`leangrad.planner._choice`; the measurements behind its margins:
            docs/planner-evidence.md.
        allocate_limit: bytes a step may allocate here; when backprop's fake-tensor
            estimate is above it, every candidate is estimated, not run (default: the
            device's free memory, :func:`leangrad._sizes.free_bytes`). A candidate that
            runs out of memory is estimated too.
        progress: called with a short message before each measurement; ``True`` shows a
            progress bar over the candidates on stderr instead (then the timing phase).
        autocast: plan the step as it will run, under ``torch.autocast`` with this dtype
            (e.g. ``torch.bfloat16``) on the inputs' device: every candidate is measured
            and timed under it, each step in an autocast context of its own as a training
            loop enters one per step (so the step's cast copies of the weights count in
            its peak), exact meaning "equal to autograd under the same autocast"; engines
            not checked under autocast are rows saying so. Run the
            chosen engine under the same autocast (``leangrad train --precision bf16``).
        compile: also try ``torch.compile`` of the whole model, default and with AOT
            autograd's ``activation_memory_budget`` (:data:`leangrad.planner._compile.
            COMPILE_BUDGETS`), and regional compilation: each of the model's blocks
            compiled, under plain autograd and under checkpointing
            (:data:`leangrad.planner._compile.COMPILE_REGIONS`; a model whose module tree
            repeats no block has rows saying so); each compiled cold and measured in a
            fresh process (the model, inputs and loss_fn are pickled for it; where they
            cannot be, the rows say why): about 20-30 s per setting on a small model,
            more on a large one.
            Exact meaning "equal to autograd up to float reassociation" (checked in that
            process). A compile that fails is a row ``failed: <reason>``.
        reuse: a plan of the same step (this ``model`` and these ``inputs``, the same
            ``exact``, ``optimizer``, ``autocast``, ``engines`` and ``compile``) at another
            budget, made in this process: its candidates' peaks and warm engines are taken
            instead of stepping each again, since a peak does not depend on the budget;
            only rows that the new budget could judge differently are measured again (one
            its estimate screened out by less than the margin now, a first step's peak
            that fitted the old budget and not this one), and the candidates that fit are
            timed side by side as always — except at a lower budget where the earlier
            plan's choice still fits: every candidate that fits there was timed against it
            and lost, so it stands, timings and all. Planning at ½, ¼ and ⅛ of backprop's
            peak steps each candidate once instead of three times.
        within_budget: the plan itself stays within ``budget``, for planning inside the
            run that has only that much (:func:`leangrad.hf.attach`): every candidate is
            estimated on fake tensors before it runs (slower where estimates are costly)
            and runs only where the estimate fits; the exactness re-check steps
            ``loss.backward()`` on the largest slice of the batch that fits, where the loss
            is declared per example, or the message says it did not run
            (:mod:`leangrad.planner._verify`). Not with ``compile=True``.

    Returns:
        A :class:`Plan`; printing it prints the table. The model, its gradients, buffers
        and the RNG are left as they were.
    """
    if isinstance(budget, bool) or not isinstance(budget, int) or budget <= 0:
        raise ValueError(BAD_BUDGET.format(value=budget))
    for key, value, least in (("repeats", repeats, 1), ("allocate_limit", allocate_limit, 0)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                  or value < least):  # fmt: skip
            raise ValueError(BAD_SETTING.format(name=key, want=f"an int >= {least}",
                                                value=value))  # fmt: skip
    if autocast is not None and not (isinstance(autocast, torch.dtype)
                                     and autocast.is_floating_point):  # fmt: skip
        raise ValueError(BAD_SETTING.format(name="autocast", want="a floating torch.dtype "
                                            "(torch.bfloat16, torch.float16)", value=autocast))
    if (wrapper := wrapped_by(model)) is not None:
        raise errors.EngineInputError(PLAN_WRAPPED.format(wrapper=wrapper[0],
                                                          unwrap=wrapper[1]))  # fmt: skip
    model, flat = positional(model, inputs)
    xs = (flat,) if isinstance(flat, torch.Tensor) else tuple(flat)
    for name, flag in (("compile", compile), ("within_budget", within_budget)):
        if not isinstance(flag, bool):
            raise ValueError(BAD_SETTING.format(name=name, want="True or False", value=flag))
    if compile and within_budget:
        raise ValueError(BAD_SETTING.format(name="within_budget", want="False with compile=True "
                                            "(its rows run in processes of their own)",
                                            value=within_budget))  # fmt: skip
    found = _plan(model, xs, loss_fn, budget=budget, exact=exact, optimizer=optimizer,
                  engines=engines, repeats=repeats, allocate_limit=allocate_limit,
                  progress=progress, compile=compile, autocast=autocast,
                  reuse=reuse, within=within_budget)  # fmt: skip
    if autocast is None:
        return found
    made_for = {**(found.made_for or {}), "autocast": str(autocast).removeprefix("torch.")}
    return dataclasses.replace(found, made_for=made_for)


def _plan(
    model: nn.Module,
    xs: tuple[torch.Tensor, ...],
    loss_fn: Callable[[Any], torch.Tensor],
    *,
    budget: int,
    exact: bool,
    optimizer: MakeOptimizer | None,
    engines: Sequence[tuple[str, dict[str, Any]]] | None,
    repeats: int,
    allocate_limit: int | None,
    progress: Callable[[str], None] | bool | None,
    compile: bool = False,
    autocast: torch.dtype | None = None,
    reuse: Plan | None = None,
    within: bool = False,
) -> Plan:
    """:func:`plan`'s search, its arguments checked (each step under ``autocast``, in a
    context of its own, where given): every candidate measured (:class:`_Search`), the ones
    that fit timed side by side (:func:`_timed`), the fastest re-checked where ``exact``,
    and the table built from it all."""
    start = time.perf_counter()
    made_for = fingerprint(model, xs)  # what Plan.load checks a model and batch against
    device = xs[0].device if xs else next(model.parameters()).device
    limit = allocate_limit if allocate_limit is not None else free_bytes(device)
    setting = (exact, optimizer, autocast, None if engines is None else repr(list(engines)),
               compile, within)  # fmt: skip
    prior = _prior(reuse, model, xs, setting)
    user_model, model = model, _stepped_model(model, prior, optimizer)
    first = ([PlanOffer(n, o) for n, o in engines] if engines is not None
             else _offered(model, exact=exact, loss_fn=loss_fn))  # fmt: skip
    shown = Progress(progress, total=len(first) + 1)  # each candidate, then the timing
    if compile:
        from ._compile import compile_candidates

        shown.grow(len(compile_candidates()))
    ctx = Context(model, xs, loss_fn, budget, exact, optimizer, shown,
                  too_big(model, xs, loss_fn, limit), autocast,
                  screen=fake_is_stepwise(model) is None, within=within)  # fmt: skip
    search = _Search(ctx, prior, first, shown, pieces=engines is None)
    search.run(last_resorts=engines is None,
               compiled=(repeats, autocast is not None) if compile else None)  # fmt: skip
    tried = search.tried
    fitting = {t.label: t.engine for t in tried if t.engine is not None and t.verdict == "fits"}
    scaled = {t.label: t.time_ratio for t in tried if t.fits and t.time_ratio is not None}
    choice = _timed(ctx, prior, fitting, scaled, tried, shown, repeats)
    verdicts = dict(prior.checked) if prior is not None else {}
    result, choice = _decided(ctx, choice, fitting, scaled, tried, shown, verdicts)
    shown.advance()
    shown.close()
    measured = Measured(model, xs, setting, search.rows, of=user_model, budget=budget,
                        choice=choice, checked=verdicts)  # fmt: skip
    return dataclasses.replace(result, wall_seconds=time.perf_counter() - start,
                               made_for=made_for, measured=measured)  # fmt: skip


def _stepped_model(model: nn.Module, prior: Measured | None,
                   optimizer: MakeOptimizer | None) -> nn.Module:  # fmt: skip
    """The model the plan steps: an earlier plan's (the user's, or the copy its optimizer
    stepped), a copy where an optimizer steps it (never the user's), else the user's."""
    if prior is not None:
        return prior.model
    if optimizer is None:
        return model
    try:
        return copy.deepcopy(model)
    except Exception as err:  # any reason a module cannot be copied
        raise errors.EngineInputError(NOT_COPYABLE.format(why=err)) from err


def _decided(ctx: Context, choice: Choice, fitting: dict[str, Any], scaled: dict[str, float],
             tried: list[Tried], shown: Progress,
             verdicts: dict[str, str | None]) -> tuple[Plan, Choice]:  # fmt: skip
    """The plan from the timed ``choice``: under ``exact``, the fastest row that also
    leaves what ``loss.backward()`` leaves (:func:`_checked`; ``verdicts`` gains each
    check); where nothing fitting could run here, the first fitting estimate; the table
    with every row's verdict and time. With the choice as it stands after the check."""
    model, xs, loss_fn = ctx.model, ctx.xs, ctx.loss_fn
    times, chosen = choice.seconds, choice.label
    checked = ""
    if ctx.exact and chosen is not None and not ctx.estimate_only and chosen in fitting:
        before = chosen
        chosen, checked = _checked(chosen, fitting, times, tried, ctx, shown, verdicts)
        if chosen != before:
            choice = dataclasses.replace(choice, label=chosen, tie_break=None)
    if chosen is None:  # nothing fitting could be run here: the first fitting estimate
        chosen = next((t.label for t in tried if t.fits and t.estimate), None)
        fitting = {t.label: t.engine for t in tried if t.label == chosen}
    fitting.update({t.label: t.engine for t in tried if t.label in scaled})
    step = fitting.get(chosen) if chosen else None  # the engine, or a Step around it
    inner = step.engine if isinstance(step, Step) else step
    table = tuple(_candidate(t, times.get(t.label), chosen, inner, choice.tie_break,
                             raced_note(choice, t.label)) for t in tried)  # fmt: skip
    row = next((c for c in table if c.engine is not None), None)
    result = _result(table, row, step, ctx.budget, ctx.exact, model, xs, loss_fn)
    if checked and result.engine is not None:
        result = dataclasses.replace(result, message=result.message + checked)
    return result, choice


class _Search:
    """Every candidate of one plan measured, in the order that lets a fitting row spare
    the rows it beats (:func:`beaters_first`): ``tried`` (the rows, in the offers' order)
    and ``rows`` (each candidate's, kept for a later plan's ``reuse=``)."""

    def __init__(self, ctx: Context, prior: Measured | None, first: list[PlanOffer],
                 shown: Progress, *, pieces: bool) -> None:  # fmt: skip
        self.ctx, self.prior, self.first, self.pieces = ctx, prior, first, pieces
        self.shown = shown
        self.tried: list[Tried] = []
        self.rows: dict[str, list[Tried]] = {}
        # a candidate's key -> the fitting row that beats what it beats, and why where that
        # row is not a strict part of the work (along the chain, else the link's own)
        self.winners: dict[str, tuple[str, str | None]] = {}
        self.beat = beaters(first, pieces=pieces)

    def run(self, *, last_resorts: bool, compiled: tuple[int, bool] | None) -> None:
        """The offers, then (``last_resorts``, where none fits) the engines offered only
        then, then (``compiled``: repeats and autocast) the compiled rows."""
        for c in beaters_first(self.first, pieces=self.pieces):
            self.candidate(c)
        order = dict.fromkeys(row_key(c.name, c.options) for c in self.first)
        self.tried[:] = [t for k in order for t in self.rows[k]]  # the offers' order again
        if last_resorts and not any(t.fits for t in self.tried):
            rest = _last_resorts(self.ctx.model)
            self.shown.grow(len(rest))
            for c in rest:
                self.candidate(c)
        if compiled is not None:  # last: its workers never share the CPU with a measurement
            from ._compile import measure_compiled

            repeats, autocast = compiled
            for _ in range(self.take(COMPILED, lambda: measure_compiled(
                    self.ctx, self.tried, repeats=repeats, autocast=autocast))):  # fmt: skip
                self.shown.advance()

    def take(self, key: str, fresh: Callable[[], None]) -> int:
        """The rows under ``key``: the earlier plan's, judged again, or ``fresh()``'s (a
        row the earlier plan did not run as beaten is decided again); how many."""
        before = len(self.tried)
        old = self.prior.rows.get(key) if self.prior else None
        if old is None or any(t.beaten for t in old):
            fresh()
        else:
            revisit(old, self.ctx, self.tried)
        self.rows[key] = self.tried[before:]
        return len(self.rows[key])

    def candidate(self, c: PlanOffer) -> None:
        """One offer: not run where a fitting row beats it, else measured; the progress
        bar advances per candidate."""
        k, ctx, tried = row_key(c.name, c.options), self.ctx, self.tried
        won = next(((self.winners[b][0], self.winners[b][1] or why)
                    for b, why in self.beat.get(k, []) if b in self.winners), None)  # fmt: skip
        if won is not None:
            by, why = won
            self.take(k, lambda: not_run(c.name, c.options, ctx, tried, by=by, why=why))
            self.winners[k] = (by, why)
        elif self.take(k, lambda: measure([(c.name, c.options)], ctx, tried)) and all(
                t.fits for t in self.rows[k]):  # fmt: skip
            self.winners[k] = (self.rows[k][0].label, None)
        self.shown.advance()


def _timed(ctx: Context, prior: Measured | None, fitting: dict[str, Any],
           scaled: dict[str, float], tried: list[Tried], shown: Progress,
           repeats: int) -> Choice:  # fmt: skip
    """The fastest of the rows that fit, timed side by side (medians of interleaved
    rounds; compiled rows ``scaled`` from backprop's time beside them) — or the earlier
    plan's choice, where it still fits at this budget or less."""
    if prior is not None and prior.choice is not None and prior.choice.label in fitting \
            and ctx.budget <= prior.budget:  # fmt: skip
        shown("the earlier plan's fastest fits: its timing stands")
        return _still(prior.choice, set(fitting) | set(scaled))
    if not (fitting or scaled):
        return Choice(None, {})
    model, xs, loss_fn = ctx.model, ctx.xs, ctx.loss_fn
    shown(f"timing {len(fitting)} candidates side by side")
    steps = {label: as_call(e, model, xs, loss_fn) for label, e in fitting.items()}
    if scaled and BACKPROP not in steps:  # the reference compiled rows are scaled from
        steps[BACKPROP] = as_call(engine_named(BACKPROP), model, xs, loss_fn)
    with untouched(model, xs):  # the timer is looked up here: tests replace it
        for label in steps.keys() - fitting.keys():  # the reference, made just now: the
            steps[label]()  # rounds run no warm-up (the candidates' is their peak's)
        return choose(steps, fitting=list(fitting), scaled=scaled, reference=BACKPROP,
                      rows=tried, repeats=repeats, timer=time_interleaved,
                      progress=shown)  # fmt: skip


def _checked(chosen: str, fitting: dict[str, Any], times: dict[str, float], tried: list[Tried],
             ctx: Context, shown: Progress,
             verdicts: dict[str, str | None]) -> tuple[str | None, str]:  # fmt: skip
    """The fastest fitting row whose step leaves what ``loss.backward()`` leaves on this
    model (:func:`~leangrad.planner._verify.exact_why`, on a fresh engine of the row's name and
    options), starting at ``chosen``; each one that does not becomes ``inexact: <why>`` in
    ``tried`` and leaves ``fitting``. ``verdicts`` holds the rows checked already (an
    earlier plan's, under ``reuse=``) and gains this plan's. With the note for the plan's
    message. A plan within its budget checks on a slice of the batch that fits
    (:func:`~leangrad.planner._verify.check_batch`), or says it could not check."""
    from ._verify import CHECKED, check_batch, exact_why

    most = ctx.budget if ctx.within else None
    rows = {t.label: t for t in tried}
    label: str | None = chosen
    note = CHECKED
    while label is not None:
        row = rows.get(label)
        if row is None or row.name == BACKPROP:
            return label, ""
        if label not in verdicts:
            where = check_batch(ctx.model, ctx.xs, ctx.loss_fn, most,
                                engine_named(row.name, **row.options))  # fmt: skip
            if isinstance(where, str):  # no batch to check it on within the budget
                return label, where
            xs, loss_fn, note = where
            shown(f"re-checking {label} against loss.backward()")
            verdicts[label] = exact_why(engine_named(row.name, **row.options), ctx.model, xs,
                                        loss_fn)  # fmt: skip
        why = verdicts[label]
        if why is None:
            return label, note
        tried[:] = [dataclasses.replace(t, verdict=f"inexact: {why}", engine=None)
                    if t.label == label else t for t in tried]  # fmt: skip
        fitting.pop(label)
        timed = [lb for lb in fitting if lb in times]
        label = min(timed, key=lambda lb: times[lb]) if timed else None
    return None, ""


def _still(choice: Choice, here: set[str]) -> Choice:
    """An earlier plan's ``choice`` at a lower budget where its fastest still fits: every
    row that fits here fitted there (a peak is the same at any budget) and was timed
    there, and none was faster; the rows that no longer fit lose their times."""
    return Choice(choice.label, {k: v for k, v in choice.seconds.items() if k in here},
                  tuple(k for k in choice.contenders if k in here), choice.tie_break,
                  {k: v for k, v in choice.raced.items() if k in here},
                  {k: v for k, v in choice.raced_in.items() if k in here})  # fmt: skip


COMPILED = "compiled"
"""The key of the compiled rows in :attr:`Measured.rows` (every candidate's has a space)."""


def _prior(reuse: Plan | None, model: nn.Module, xs: tuple[torch.Tensor, ...],
           setting: tuple[Any, ...]) -> Measured | None:  # fmt: skip
    """``reuse``'s measurements where they are of this step (:func:`plan`'s ``reuse``)."""
    if reuse is None:
        return None
    found = reuse.measured
    if found is None:
        why = "has no measurements (a plan loaded from a file, or built by hand)"
    elif found.of is not model or len(found.xs) != len(xs) or any(
            a is not b for a, b in zip(found.xs, xs, strict=False)):  # fmt: skip
        why = "was made on another model or other inputs"
    elif found.setting != setting:
        why = "was made with other settings (exact, optimizer, autocast, engines or compile)"
    else:
        return found
    raise ValueError(NOT_REUSABLE.format(why=why))


def _candidate(t: Tried, seconds: float | None, chosen: str | None, engine: Engine | None,
               tie_break: str | None = None, raced: str | None = None) -> Candidate:  # fmt: skip
    """``t``'s row; the chosen one carries ``engine``, the object that was measured, and
    ``tie_break``, how it was chosen among contenders within noise (``None``: fastest); a
    row the race dropped says so (``raced``: :func:`~leangrad.planner._choice.raced_note`)."""
    if t.label != chosen:
        verdict = t.verdict if raced is None else f"{t.verdict}; {raced}"
        return Candidate(t.label, t.exact, t.peak, seconds, verdict, t.name, t.options,
                         t.per_layer, t.estimate, t.compile_seconds)  # fmt: skip
    # a fitting row's note ("fits (estimate)", "fits (RSS-scaled)") stays when it is chosen
    verdict = CHOSEN + t.verdict.removeprefix("fits")
    return Candidate(t.label, t.exact, t.peak, seconds, verdict, t.name, t.options, t.per_layer,
                     t.estimate, t.compile_seconds, tie_break, engine=engine)  # fmt: skip


def _result(table: tuple[Candidate, ...], row: Candidate | None, step: Any, budget: int,
            exact: bool, model: nn.Module, xs: tuple[torch.Tensor, ...],
            loss_fn: Callable[[Any], torch.Tensor]) -> Plan:  # fmt: skip
    """The plan of ``table`` whose chosen ``row`` (``None``: nothing fits) was measured as
    ``step`` (its engine, or a :class:`~leangrad._step.Step` around it)."""
    if row is None:
        inexact = [c for c in table if c.verdict.startswith("inexact")]
        measured = [c for c in table if c.peak_bytes is not None and c not in inexact]
        if not measured:
            msg = "nothing could run on this model (see the table)"
        else:
            best = min(measured, key=lambda c: c.peak_bytes or 0)
            msg = NOTHING_FITS.format(
                budget=fmt_bytes(budget), engine=best.label,
                best=("~" if best.estimate else "") + fmt_bytes(best.peak_bytes),  # an estimate
                inexact=", or allow estimators (exact=False / --inexact)" if exact else "",
            )  # fmt: skip
        if inexact:
            msg += (f"; {len(inexact)} fitting row(s) did not leave what loss.backward() "
                    "leaves on this model (inexact: see the table)")
        return Plan(None, None, None, None, budget, table, msg)
    inner = row.engine
    assert inner is not None  # the chosen row carries its engine
    if row.estimate:
        msg = (f"chosen: {row.label} — peak ~{fmt_bytes(row.peak_bytes)} of "
               f"{fmt_bytes(budget)}{NOT_TIMED}")  # fmt: skip
        return Plan(inner, row.peak_bytes, None, inner.exact, budget, table, msg, None,
                    row.per_layer, estimate=True, chosen=row)  # fmt: skip
    if row.compile_seconds is not None:  # its memory is visible in a fresh process only
        msg = (f"chosen: {row.label} — peak {fmt_bytes(row.peak_bytes)} of {fmt_bytes(budget)} "
               f"({row.verdict.removeprefix('chosen ').strip('()')}: measured in a fresh "
               f"process), {row.seconds:.4f} s/step; compiles on its first backward (took "
               f"{row.compile_seconds:.1f} s cold){_tie_note(row)}")  # fmt: skip
        return Plan(inner, row.peak_bytes, row.seconds, inner.exact, budget, table, msg,
                    chosen=row)  # fmt: skip
    again = profile_step(step, model, xs, loss_fn, repeats=0, warmup=0).total_bytes  # warm
    msg = (f"chosen: {row.label} — peak {fmt_bytes(row.peak_bytes)} of {fmt_bytes(budget)} "
           f"(re-measured {fmt_bytes(again)}), {row.seconds:.4f} s/step"
           f"{_tie_note(row)}")  # fmt: skip
    return Plan(inner, row.peak_bytes, row.seconds, inner.exact, budget, table, msg, again,
                row.per_layer, chosen=row)  # fmt: skip


def _tie_note(row: Candidate) -> str:
    """The message's tail saying how a tie within noise was broken (``""``: none)."""
    return "" if row.tie_break is None else f"; {row.tie_break}"
