"""leangrad inside Hugging Face's ``Trainer``, in one line: :func:`attach`.

``attach(trainer, "checkpoint+chunked_ce")`` (or a :class:`~leangrad.Engine`, a saved
:class:`~leangrad.Plan`, or ``budget="12GiB"`` / ``budget=0.25`` to plan on the first
batch) makes every training step's loss a :func:`~leangrad.surrogate_loss`: the engine
computes the gradients when ``Trainer.compute_loss`` is called, and the Trainer's own
``training_step`` goes on unchanged — it divides the loss for gradient accumulation where
it does, calls ``accelerator.backward`` (mixed-precision scaling, DDP under
``torchrun``/``accelerate launch``), and the surrogate's backward hands the engine's
gradients over scaled the same way. Evaluation and prediction steps run as before.

The loss is the Trainer's: the model is called with exactly the keyword arguments
``compute_loss`` would call it with (``num_items_in_batch`` included, when the model takes
it), and the loss is read from the output by ``compute_loss`` itself — ``labels=``
computed inside the model, ``compute_loss_func``, label smoothing, the token-average
scaling across devices — so a subclass's or TRL's ``compute_loss`` is honoured too. The
method is patched on the instance; the Trainer's class is left alone.

Splitting a step into micro-batches (``accumulate``) needs a loss that is a sum over the
examples: the Trainer's loss is one when it passes ``num_items_in_batch`` (the loss is
then summed over tokens and divided by that count); on the first batch that is checked by
running the loss on the whole batch and on its two halves, and an engine that splits is
refused when it does not hold.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from . import _errors as errors
from ._sizes import fmt_bytes, parse_bytes
from .engines._surrogate import surrogate_loss

__all__ = ["Attached", "attach"]

LOG = logging.getLogger("leangrad.hf")
ONE_OF = "attach: give an engine (a name, an Engine or a Plan) or budget=, not both"
NEITHER = "attach: give an engine (a name, an Engine or a Plan) or budget= ('12GiB', 0.25)"
BAD_BUDGET = (
    "attach: budget must be bytes ('12GiB', 2**34) or a fraction in (0, 1) of the plain "
    "step's measured peak, got {value!r}"
)
NOT_A_TRAINER = "attach: expected a transformers.Trainer (or a subclass), got {kind}"
TWICE = "attach: this Trainer already runs leangrad ({label}); make a new Trainer to change it"
NOT_A_SUM = (
    "{engine} splits the batch into micro-batches, which needs the Trainer's loss to be a sum "
    "over the examples; {why}. Use an engine that does not split the batch (checkpoint, "
    "chunked_ce), or the Trainer's own gradient_accumulation_steps"
)


class _Recorded(Exception):
    """Raised by :class:`_Recorder` once it has the model's keyword arguments."""


class _Recorder:
    """Stands for the model in a ``compute_loss`` call that is stopped at the model call:
    what the loss would call the model with."""

    def __init__(self, model: nn.Module) -> None:
        self._model = model
        self.kwargs: dict[str, Any] = {}

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if args:
            raise errors.EngineInputError(
                "attach: compute_loss called the model with positional arguments; leangrad "
                "takes the batch as keyword arguments, as Trainer passes it"
            )
        self.kwargs = kwargs
        raise _Recorded

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)


class _Answer:
    """Stands for the model in a ``compute_loss`` call on an output computed already: the
    call returns it; everything else (its class, for ``isinstance``; its name, for label
    smoothing) is the model's."""

    def __init__(self, model: nn.Module, out: Any) -> None:
        self._model, self._out = model, out

    @property  # type: ignore[misc]
    def __class__(self) -> type:  # isinstance(answer, PeftModel) as for the model
        return type(self._model)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        del args, kwargs
        return self._out

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)


@dataclasses.dataclass
class Attached:
    """What :func:`attach` put on a Trainer (``trainer.leangrad``): the engine each training
    step runs (``None`` until a budget is planned on the first batch), the budget in bytes
    (``None``: an engine was given), and the plan made for it."""

    engine: Any
    budget: int | float | None = None
    plan: Any = None
    checked_sum: bool = False

    @property
    def label(self) -> str:
        return str(getattr(self.engine, "label", "(planned on the first batch)"))


def attach(trainer: Any, engine: Any = None, *, budget: str | int | float | None = None) -> Any:
    """Make ``trainer`` compute each training step's gradients with a leangrad engine.

    Args:
        trainer: a ``transformers.Trainer`` (or subclass, e.g. TRL's ``SFTTrainer``).
        engine: an engine name (``"checkpoint+chunked_ce"``), an engine, or a
            :class:`~leangrad.Plan` (``leangrad.planner.load_plan(path)``).
        budget: instead of ``engine``: bytes the step may use (``"12GiB"``), or a fraction
            in (0, 1) of the plain step's peak; :func:`leangrad.plan` picks the fastest
            engine that fits on the first training batch, and the Trainer logs it
            (``leangrad_engine``, ``leangrad_peak_mib``, ``leangrad_budget_mib``).

    Returns:
        ``trainer`` itself (``trainer.leangrad`` says what runs: :class:`Attached`).
    """
    transformers = _transformers()
    if not isinstance(trainer, transformers.Trainer):
        raise errors.OptionError(NOT_A_TRAINER.format(kind=type(trainer).__name__))
    if isinstance(getattr(trainer, "leangrad", None), Attached):
        raise errors.OptionError(TWICE.format(label=trainer.leangrad.label))
    if (engine is None) == (budget is None):
        raise errors.OptionError(ONE_OF if engine is not None else NEITHER)
    attached = Attached(engine=_engine_of(engine) if engine is not None else None,
                        budget=_budget(budget) if budget is not None else None)  # fmt: skip
    original = trainer.compute_loss

    def compute_loss(model: nn.Module, inputs: Mapping[str, Any], return_outputs: bool = False,
                     num_items_in_batch: Any = None, **kwargs: Any) -> Any:  # fmt: skip
        if return_outputs or kwargs or not model.training or not torch.is_grad_enabled():
            return original(model, inputs, return_outputs=return_outputs,
                            num_items_in_batch=num_items_in_batch, **kwargs)  # fmt: skip
        call, loss_fn = _step_of(original, model, inputs, num_items_in_batch)
        if attached.engine is None:
            _plan_first(trainer, attached, model, call, loss_fn)
        if _splits(attached.engine) and not attached.checked_sum:
            _check_sum(attached, model, call, loss_fn)
        return surrogate_loss(attached.engine, model, call, loss_fn)

    trainer.compute_loss = compute_loss
    trainer.leangrad = attached
    LOG.info("leangrad: training steps run %s", attached.label)
    return trainer


def _transformers() -> Any:
    return errors.require("transformers", feature="leangrad.hf.attach", extra="hf")


def _engine_of(engine: Any) -> Any:
    from .engines import Engine
    from .engines import engine as engine_named
    from .planner import Plan

    if isinstance(engine, str):
        return engine_named(engine)
    if isinstance(engine, Plan):
        if engine.engine is None:
            raise errors.OptionError("attach: the plan chose no engine (nothing fitted)")
        return engine.engine
    if isinstance(engine, Engine):
        return engine
    raise errors.OptionError(f"attach: engine must be a name, an Engine or a Plan, got "
                             f"{type(engine).__name__}")  # fmt: skip


def _budget(value: str | int | float) -> int | float:
    if isinstance(value, float) and 0 < value < 1:
        return value
    try:
        got = parse_bytes(value)
    except ValueError:
        raise errors.OptionError(BAD_BUDGET.format(value=value)) from None
    if got <= 0:
        raise errors.OptionError(BAD_BUDGET.format(value=value))
    return got


LossOf = Callable[[Any], torch.Tensor]


def _step_of(original: Callable[..., Any], model: nn.Module, inputs: Mapping[str, Any],
             num_items_in_batch: Any) -> tuple[dict[str, Any], LossOf]:  # fmt: skip
    """The model's keyword arguments, as ``compute_loss`` calls it, and the loss of its
    output as ``compute_loss`` computes it."""
    from .loss import per_example

    recorder = _Recorder(model)
    try:
        original(recorder, dict(inputs), num_items_in_batch=num_items_in_batch)
    except _Recorded:
        pass
    else:
        raise errors.EngineInputError("attach: compute_loss did not call the model")
    call = recorder.kwargs

    # What compute_loss takes from the batch but not to the model (the labels it pops for
    # compute_loss_func or label smoothing): split with the micro-batches where they split.
    kept = [k for k, v in inputs.items()
            if k not in call and isinstance(v, torch.Tensor) and v.dim()]  # fmt: skip

    def loss_fn(out: Any, *parts: torch.Tensor) -> torch.Tensor:
        batch = {**inputs, **dict(zip(kept, parts, strict=False))}
        loss: torch.Tensor = original(_Answer(model, out), batch,
                                      num_items_in_batch=num_items_in_batch)  # fmt: skip
        return loss

    rows = [inputs[k] for k in kept] or [v for v in call.values()
                                         if isinstance(v, torch.Tensor) and v.dim()][:1]
    if num_items_in_batch is None or not rows:
        return call, loss_fn
    # Summed over tokens and divided by the accumulated batch's count: a sum over examples.
    return call, per_example(loss_fn, *rows, reduction="sum")


def _splits(engine: Any) -> bool:
    return "accumulate" in str(getattr(engine, "label", ""))


def _check_sum(attached: Attached, model: nn.Module, call: dict[str, Any],
               loss_fn: Any) -> None:  # fmt: skip
    """Watch the loss on the whole batch and on its halves: micro-batches may add only if
    their losses do."""
    from .loss import PerExample

    label = attached.label
    if not isinstance(loss_fn, PerExample):
        raise errors.EngineInputError(NOT_A_SUM.format(
            engine=label, why="the Trainer passes no num_items_in_batch to this model"))
    tensors = {k: v for k, v in call.items() if isinstance(v, torch.Tensor) and v.dim()}
    rows = {int(v.shape[0]) for v in tensors.values()}
    if len(rows) != 1 or (n := rows.pop()) < 2:
        raise errors.EngineInputError(NOT_A_SUM.format(
            engine=label, why="its tensors do not share one batch dimension of 2 or more"))
    inner = _unwrapped(model)
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        whole = loss_fn.fn(inner(**call), *loss_fn.targets)
        parts = torch.stack([loss_fn.fn(inner(**{**call, **{k: v[s] for k, v in tensors.items()}}),
                               *(t[s] for t in loss_fn.targets))
                    for s in (slice(0, n // 2), slice(n // 2, n))]).sum()  # fmt: skip
    if not torch.allclose(whole, parts, rtol=1e-4, atol=1e-6):
        raise errors.EngineInputError(NOT_A_SUM.format(
            engine=label, why=f"its loss on the batch ({float(whole):.6g}) is not the sum of "
            f"its losses on the two halves ({float(parts):.6g})"))  # fmt: skip
    attached.checked_sum = True


def _unwrapped(model: nn.Module) -> nn.Module:
    """The module DDP wraps (the Trainer hands ``compute_loss`` the wrapped model under
    ``torchrun``), or ``model``."""
    from .engines._wrapped import DDP, wrapped_by

    wrapper = wrapped_by(model)
    return model.get_submodule("module") if wrapper is not None and wrapper[0] == DDP else model


def _plan_first(trainer: Any, attached: Attached, model: nn.Module, call: dict[str, Any],
                loss_fn: Any) -> None:  # fmt: skip
    """Plan on the first batch and log the choice."""
    from .planner import plan

    inner = _unwrapped(model)
    budget = attached.budget
    assert budget is not None
    if isinstance(budget, float):  # of the plain step's peak, estimated: never run here
        from ._keywords import positional
        from .engines import engine as engine_named
        from .measure import estimate_step

        viewed, flat = positional(inner, call)
        plain = estimate_step(engine_named("backprop"), viewed, flat, loss_fn)
        budget = int(budget * plain.total_bytes)
    found = plan(inner, call, loss_fn, budget=budget, repeats=1, within_budget=True)
    if found.engine is None:
        raise errors.EngineInputError(
            f"attach: no engine fits {fmt_bytes(budget)} on this batch:\n{found}")
    attached.engine, attached.plan, attached.budget = found.engine, found, budget
    peak = found.peak_bytes
    logs: dict[str, Any] = {"leangrad_engine": found.engine.label,
                            "leangrad_budget_mib": round(budget / 2**20, 3)}
    if peak is not None:
        logs["leangrad_peak_mib"] = round(peak / 2**20, 3)
    LOG.info("leangrad: planned %s", logs)
    if "NOT re-checked" in found.message:
        LOG.warning("leangrad: %s", found.message)
    trainer.log(logs)
