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

This module sits low: it imports the engines' interface and nothing from ``train``,
``bench`` or the planner.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeAlias

import torch
from torch import nn

from . import _errors as errors
from .engines._base import Engine, StepResult
from .engines._loss_fn import LossFn

__all__ = ["PER_LAYER", "MakeOptimizer", "PerLayerOptimizer", "Step"]

MakeOptimizer: TypeAlias = Callable[[list[nn.Parameter]], torch.optim.Optimizer]
"""Builds an optimizer over a list of parameters (e.g. Adam with the learning rate)."""

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


@dataclasses.dataclass(frozen=True)
class Step:
    """One training step: ``engine.backward`` (under ``torch.autocast`` with ``autocast``,
    if set), then the optimizer.

    - ``optimizer=None``: the engine's backward only (``p.grad`` is left filled);
    - ``per_layer=False``: ``.grad`` set to ``None``, backward, ``optimizer.step()``,
      ``.grad`` set to ``None`` again (``zero_grad(set_to_none=True)`` before and after);
    - ``per_layer=True``: backward with ``on_grad`` stepping each parameter's own optimizer
      and freeing its gradient (:class:`PerLayerOptimizer`), then the parameters the engine
      did not hand over.

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
    """

    engine: Engine
    optimizer: MakeOptimizer | None = None
    _: dataclasses.KW_ONLY
    per_layer: bool = False
    autocast: torch.dtype | None = None
    loss: LossFn | None = None
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
        if self.optimizer is None:
            with self._autocast(inputs):
                result = self.engine.backward(model, inputs, loss_fn)
            return result if keep else None
        opt = self._optimizer_for(model)
        if isinstance(opt, PerLayerOptimizer):
            with self._autocast(inputs):
                result = self.engine.backward(model, inputs, loss_fn, on_grad=opt.on_grad)
            result = result if keep else None
            opt.finish()
            return result
        opt.zero_grad(set_to_none=True)
        with self._autocast(inputs):
            result = self.engine.backward(model, inputs, loss_fn)
        result = result if keep else None
        opt.step()
        opt.zero_grad(set_to_none=True)
        return result

    def _optimizer_for(self, model: nn.Module) -> torch.optim.Optimizer | PerLayerOptimizer:
        made = self._made
        if made.optimizer is None or made.model is not model:
            assert self.optimizer is not None
            params = {n: p for n, p in model.named_parameters() if p.requires_grad}
            made.model = model
            made.optimizer = (PerLayerOptimizer(params, self.optimizer) if self.per_layer
                              else self.optimizer(list(params.values())))  # fmt: skip
        return made.optimizer

    def _autocast(self, inputs: torch.Tensor | Sequence[torch.Tensor]
                  ) -> contextlib.AbstractContextManager[Any]:  # fmt: skip
        if self.autocast is None:
            return contextlib.nullcontext()
        first = inputs if isinstance(inputs, torch.Tensor) else next(iter(inputs))
        return torch.autocast(first.device.type, dtype=self.autocast)
