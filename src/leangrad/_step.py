"""The training step as one value: an engine's backward, under ``torch.autocast`` or not,
followed by the optimizer's step — after backward, or per parameter inside ``on_grad``.

:class:`Step` is what :func:`leangrad.plan` measures (with
:func:`leangrad.measure.profile_step`, for which it is engine-like), what
:func:`leangrad.train.measure_grad_memory` runs both ways and what the plan suite times.

Per-layer steps are Moonwalk v1's Algorithm 1 ("apply g_i to θ_i"): an engine hands each
parameter's gradient over as soon as it is final; stepping that parameter's optimizer there
and dropping ``p.grad`` frees the gradient before the next one is made. With backprop this
is PyTorch's per-parameter approach (``register_post_accumulate_grad_hook``), here for
every engine through ``on_grad``.

Across processes a step may also combine gradients as the engine hands them over
(``reduce``: :class:`leangrad.train.GradBuckets`, bucketed all-reduces overlapping the rest
of the backward) before the optimizer sees them; :func:`leangrad.train.fit` runs its steps
this way.

This module sits low: it imports the engines' interface and nothing from ``train``,
``bench`` or the planner.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Protocol, TypeAlias

import torch
from torch import nn

from . import _errors as errors
from .engines._base import Engine, OnGrad, StepResult
from .engines._loss_fn import LossFn

__all__ = ["PER_LAYER", "GradReducer", "MakeOptimizer", "MakeReducer", "PerLayerOptimizer", "Step",
           "as_call"]

MakeOptimizer: TypeAlias = Callable[[list[nn.Parameter]], torch.optim.Optimizer]
"""Builds an optimizer over a list of parameters (e.g. Adam with the learning rate)."""


class GradReducer(Protocol):
    """Combines each gradient across processes as the engine hands it over
    (:class:`leangrad.train.GradBuckets`); :meth:`finish`, called once the backward has
    returned, takes what the engine did not hand over and waits for every reduction."""

    def on_grad(self, name: str, p: nn.Parameter) -> None: ...

    def finish(self, params: Iterable[tuple[str, nn.Parameter]] = ()) -> None: ...


MakeReducer: TypeAlias = Callable[[OnGrad | None], GradReducer]
"""Builds a :class:`GradReducer` that calls its argument (the per-layer optimizer's
``on_grad``, or ``None``) for each parameter once its gradient is combined."""

PER_LAYER = ", step per layer"
"""Label suffix of a step whose optimizer steps each parameter inside ``on_grad``."""

PER_LAYER_WITHOUT_OPTIMIZER = (
    "Step(per_layer=True) needs optimizer= (a function making an optimizer over a list of "
    "parameters): per-layer means the optimizer steps each parameter inside on_grad; "
    "pass optimizer=, or per_layer=False"
)
NO_LOSS = (
    "Step.run has no loss: pass loss= to Step(...) or to run(...) (a function from the "
    "model's output to a scalar loss)"
)
BAD_AUTOCAST = (
    "Step(autocast={value!r}) must be a floating torch.dtype (torch.bfloat16, "
    "torch.float16) or None for no autocast"
)


class PerLayerOptimizer:
    """One optimizer per parameter, stepped in ``on_grad`` and then ``p.grad = None``.

    Args:
        params: the trainable parameters by name.
        make: builds an optimizer over a list of parameters (e.g. Adam with the lr).
    """

    def __init__(self, params: Mapping[str, nn.Parameter], make: MakeOptimizer) -> None:
        self.params = dict(params)
        self.optimizers = {n: make([p]) for n, p in self.params.items()}

    def on_grad(self, name: str, p: nn.Parameter) -> None:
        """Step ``name``'s optimizer now and free its gradient."""
        if p.grad is None:
            return
        self.optimizers[name].step()
        p.grad = None

    def finish(self) -> None:
        """Step any parameter the engine did not hand over (its gradient is still set)."""
        for n, p in self.params.items():
            self.on_grad(n, p)

    def state_dict(self) -> dict[str, dict[str, Any]]:
        return {n: o.state_dict() for n, o in self.optimizers.items()}

    def load_state_dict(self, state: Mapping[str, dict[str, Any]]) -> None:
        for n, o in self.optimizers.items():
            o.load_state_dict(state[n])


@dataclasses.dataclass
class _Made:
    """What a :class:`Step` made on first use for the model it stepped: the optimizer
    (one, or one per parameter) over that model's trainable parameters."""

    model: nn.Module | None = None
    optimizer: torch.optim.Optimizer | PerLayerOptimizer | None = None
    reducer: GradReducer | None = None
    params: dict[str, nn.Parameter] = dataclasses.field(default_factory=dict)


def as_call(engine: Any, model: nn.Module, inputs: Any, loss_fn: Any) -> Callable[[], None]:
    """One step of ``engine`` (an engine or a :class:`Step`) as a call without arguments:
    ``.grad`` set to ``None``, then its backward — what a timing round runs."""

    def step() -> None:
        model.zero_grad(set_to_none=True)
        engine.backward(model, inputs, loss_fn)

    return step


@dataclasses.dataclass(frozen=True)
class Step:
    """One training step: ``engine.backward`` (under ``torch.autocast`` with ``autocast``,
    if set), then the optimizer.

    - ``optimizer=None``: the engine's backward only (``p.grad`` is left filled);
    - ``per_layer=False``: ``.grad`` set to ``None``, backward, ``optimizer.step()``,
      ``.grad`` set to ``None`` again (``zero_grad(set_to_none=True)`` before and after);
    - ``per_layer=True``: backward with ``on_grad`` stepping each parameter's own optimizer
      and freeing its gradient (:class:`PerLayerOptimizer`), then the parameters the engine
      did not hand over;
    - ``reduce`` set: the engine hands each gradient to the reducer it makes, which combines
      it across processes and then (per layer) steps it; the whole-step optimizer steps
      after the reducer's ``finish``.

    The optimizer is made on the first step for the model stepped and kept for later steps
    on it (a step on another model makes that model's); :meth:`fresh` is the same step with
    nothing made yet. Engine-like for :func:`leangrad.measure.profile_step`
    (:meth:`backward`, :attr:`label`, :attr:`exact`).

    Args:
        engine: the gradient engine.
        optimizer: builds an optimizer over a list of parameters, or ``None``.
        per_layer: step the optimizer per parameter inside ``on_grad``.
        autocast: run the engine's backward under ``torch.autocast`` with this dtype
            (on the inputs' device); ``None``: no autocast.
        loss: the loss :meth:`run` uses when it is given none (a function from the
            model's output to a scalar; losses built per batch from its targets are passed
            to :meth:`run` instead).
        reduce: builds the :class:`GradReducer` gradients pass through before the
            optimizer (made with the optimizer, on the first step); ``None``: none.
    """

    engine: Engine
    optimizer: MakeOptimizer | None = None
    _: dataclasses.KW_ONLY
    per_layer: bool = False
    autocast: torch.dtype | None = None
    loss: LossFn | None = None
    reduce: MakeReducer | None = None
    _made: _Made = dataclasses.field(default_factory=_Made, init=False, repr=False,
                                     compare=False)  # fmt: skip

    def __post_init__(self) -> None:
        if self.per_layer and self.optimizer is None:
            raise errors.OptionError(PER_LAYER_WITHOUT_OPTIMIZER)
        if self.autocast is not None and not (isinstance(self.autocast, torch.dtype)
                                              and self.autocast.is_floating_point):  # fmt: skip
            raise errors.OptionError(BAD_AUTOCAST.format(value=self.autocast))

    @property
    def label(self) -> str:
        """The engine's label, with :data:`PER_LAYER` for a per-layer step."""
        return self.engine.label + (PER_LAYER if self.per_layer else "")

    @property
    def exact(self) -> bool:
        """The engine's exactness (the optimizer changes nothing about it)."""
        return bool(self.engine.exact)

    @property
    def made(self) -> torch.optim.Optimizer | PerLayerOptimizer | None:
        """The optimizer made on the last model stepped (``None`` before the first step)."""
        return self._made.optimizer

    def fresh(self) -> Step:
        """This step with nothing made yet (e.g. for a step on fake tensors)."""
        return dataclasses.replace(self)

    def run(self, model: nn.Module, inputs: torch.Tensor | Sequence[torch.Tensor], *,
            loss: LossFn | None = None) -> StepResult:  # fmt: skip
        """One step on ``model`` and ``inputs`` with ``loss`` (default: :attr:`loss`);
        returns the engine's :class:`~leangrad.engines.StepResult` (its loss is kept while
        the optimizer steps, as a training loop that logs it keeps it)."""
        loss_fn = loss if loss is not None else self.loss
        if loss_fn is None:
            raise errors.OptionError(NO_LOSS)
        result = self._step(model, inputs, loss_fn, keep=True)
        assert result is not None
        return result

    def backward(self, model: nn.Module, inputs: torch.Tensor | Sequence[torch.Tensor],
                 loss_fn: LossFn) -> None:  # fmt: skip
        """The step with the engine's signature, keeping nothing: what
        :func:`~leangrad.measure.profile_step`, :func:`leangrad.plan` and
        :func:`leangrad.train.measure_grad_memory` measure. The engine's result (its loss)
        is dropped as soon as the engine returns, before the optimizer steps, so the peak
        is the step's own."""
        self._step(model, inputs, loss_fn, keep=False)

    def _step(self, model: nn.Module, inputs: torch.Tensor | Sequence[torch.Tensor],
              loss_fn: LossFn, *, keep: bool) -> StepResult | None:  # fmt: skip
        result: StepResult | None
        if self.optimizer is None and self.reduce is None:
            with self._autocast(inputs):
                result = self.engine.backward(model, inputs, loss_fn)
            return result if keep else None
        opt = self.optimizer_for(model)
        made = self._made
        per_layer = opt if isinstance(opt, PerLayerOptimizer) else None
        whole = opt if isinstance(opt, torch.optim.Optimizer) else None
        on_grad = (made.reducer.on_grad if made.reducer is not None
                   else per_layer.on_grad if per_layer is not None else None)  # fmt: skip
        if whole is not None:
            whole.zero_grad(set_to_none=True)
        with self._autocast(inputs):
            result = self.engine.backward(model, inputs, loss_fn, on_grad=on_grad)
        result = result if keep else None
        if made.reducer is not None:  # with what the engine did not hand over
            made.reducer.finish(made.params.items())
        elif per_layer is not None:
            per_layer.finish()
        if whole is not None:
            whole.step()
            whole.zero_grad(set_to_none=True)
        return result

    def optimizer_for(self, model: nn.Module) -> torch.optim.Optimizer | PerLayerOptimizer | None:
        """The optimizer this step uses on ``model`` (and its reducer), made now if it was
        not made for ``model`` yet: a training loop that saves or loads the optimizer's
        state before the first step asks for it here."""
        made = self._made
        if made.model is not model:
            made.model = model
            made.params = {n: p for n, p in model.named_parameters() if p.requires_grad}
            made.optimizer = (
                None if self.optimizer is None
                else PerLayerOptimizer(made.params, self.optimizer) if self.per_layer
                else self.optimizer(list(made.params.values()))
            )  # fmt: skip
            then = made.optimizer.on_grad if isinstance(made.optimizer, PerLayerOptimizer) else None
            made.reducer = None if self.reduce is None else self.reduce(then)
        return made.optimizer

    def _autocast(self, inputs: torch.Tensor | Sequence[torch.Tensor]
                  ) -> contextlib.AbstractContextManager[Any]:  # fmt: skip
        if self.autocast is None:
            return contextlib.nullcontext()
        first = inputs if isinstance(inputs, torch.Tensor) else next(iter(inputs))
        return torch.autocast(first.device.type, dtype=self.autocast)
