"""The engine interface every gradient method implements (DESIGN.md, "The mental model").

An engine takes ``(model, inputs, loss_fn)`` and fills ``p.grad`` for every
trainable parameter exactly as ``loss_fn(model(*inputs)).backward()`` would
(accumulating into an existing ``.grad``), so ``torch.optim`` works unchanged.
"""

from __future__ import annotations

import abc
import contextlib
import copy
import dataclasses
import functools
import inspect
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, ClassVar, NamedTuple, TypeAlias

import torch
from torch import nn

from .. import _errors as errors
from .._keywords import positional
from ._blocks import Blocks
from ._blocks import blocks as find_blocks
from ._contract import BufferGuard, check_batch, forward_end, refuse_hooks, refuse_input_grads
from ._loss_fn import LossFn, check_loss, run_forward
from ._prepare import step_scope
from ._wrapped import DDP, WRAPPED, wrapped_by

__all__ = [
    "Engine",
    "GradAnnouncer",
    "Inputs",
    "LossFn",
    "OnGrad",
    "PlanOffer",
    "PlanOrder",
    "StepResult",
    "Trainable",
    "accumulate_grad",
    "as_input_tuple",
    "autocast_on",
    "check_loss",
    "run_forward",
    "trainable_parameters",
]

Inputs: TypeAlias = "torch.Tensor | Sequence[torch.Tensor] | Mapping[str, Any]"
OnGrad: TypeAlias = Callable[[str, nn.Parameter], None]
"""Called as ``on_grad(name, param)`` once ``param.grad`` holds this step's gradient.

The callback may step an optimizer on that parameter alone and set
``param.grad = None`` so that gradients never all live at once. Each parameter is
handed over exactly once per step (:class:`GradAnnouncer`).
"""

NO_AUTOCAST = (
    "engine {engine!r} does not run under torch.autocast (on for {device}): {why}; run "
    "the step in full precision, or use backprop, checkpoint (any options), chunked_ce or "
    "accumulate, which do"
)
ON_GRAD_TWICE = (
    "internal error in engine {engine!r}: on_grad for {name!r} a second time in one "
    "step, so its first call carried a partial gradient; please report this (the engine "
    "must declare the parameter in revisited_parameters)"
)


class PlanOrder:
    """Where an engine's candidates go in :func:`leangrad.plan`'s order — least
    recomputation first, estimators last; the planner sorts every engine's
    :class:`PlanOffer` by it (stably, so one engine's offers keep their own order and
    engines that share a place follow the catalog's)."""

    BACKPROP = 0
    FAD = 10
    """Nested forward-AD of the whole model (``fad``)."""
    BITS = 20
    """1-bit masks on the whole model (``bits``)."""
    LOGITS = 30
    """Cross-entropy that never computes the logits (``chunked_ce``, alone and under
    checkpointing)."""
    BLOCKS = 40
    """Checkpointed blocks: segments, block lists, fragments, two levels (and the module
    transforms under checkpointing)."""
    MICRO_BATCHES = 50
    """Gradient accumulation (alone and under checkpointing)."""
    TIME_CHUNKS = 60
    """Fused recurrent modules checkpointed along time."""
    CHAIN = 70
    """Engines of a ``leangrad.Chain``'s layer rules (moonwalk; revbackprop after it)."""
    OTHER = 80
    """An engine that does not say: after the exact engines above, before estimators."""
    ESTIMATORS = 90
    """Inexact engines, offered only when the plan is not ``exact`` (rad; highway after)."""


class PlanOffer(NamedTuple):
    """One candidate an engine offers :func:`leangrad.plan`: an engine name (a
    composition such as ``"checkpoint+fad"`` where the offering engine knows it), its
    options, its place in the planner's order (:class:`PlanOrder`), and the offers it
    is ``beaten_by``: ``(name, options)`` of steps that do a strict part of its work and
    nothing else differently (the same checkpointing of fewer blocks, or of the same
    blocks in one level instead of two), or that cannot be slower for the reason
    ``beaten_why`` gives. Where one of those fits the budget this one cannot be faster,
    so the planner does not run it (its row says which fits, and why); the planner
    measures them first."""

    name: str
    options: dict[str, Any]
    order: int = PlanOrder.OTHER
    beaten_by: tuple[tuple[str, dict[str, Any]], ...] = ()
    beaten_why: str | None = None
    """Why ``beaten_by`` cannot be slower where they are not a strict part of its work
    (completes "``<offer>`` fits and ..." in the row's verdict); ``None``: they are."""
    beaten_because: tuple[tuple[str, dict[str, Any], str], ...] = ()
    """``(name, options, why)`` of offers that beat this one for a reason of their own
    (completing "``<offer>`` fits and ..." as ``beaten_why`` does), beside ``beaten_by``.
    The planner adds one more kind itself: the same step in fewer pieces
    (:data:`leangrad.planner._plan.MORE_PIECES`)."""


@dataclasses.dataclass(frozen=True)
class StepResult:
    """What one ``engine.backward`` call returns.

    Attributes:
        loss: the loss value, detached.
        engine: the engine's label, e.g. ``"checkpoint(segments=4)"``.
        info: engine-specific facts about the step (e.g. the number of jvps).
    """

    loss: torch.Tensor
    engine: str
    info: dict[str, Any] = dataclasses.field(default_factory=dict)


class Engine(abc.ABC):
    """Base class of gradient engines: one module per engine, one signature.

    Subclasses set :attr:`name` and :attr:`exact`, take their options as
    keyword-only ``__init__`` arguments stored in :attr:`options`, and implement
    :meth:`_backward`. The public :meth:`backward` validates the inputs first.
    """

    name: ClassVar[str]
    exact: ClassVar[bool] = True
    """``True`` when the engine's gradient equals autograd's up to rounding."""
    input_gradients: ClassVar[bool] = True
    """``True`` when inputs with ``requires_grad=True`` get their ``.grad`` as under
    autograd; engines that cannot compute them raise instead of leaving them ``None``."""
    autocast: ClassVar[bool] = False
    """``True`` when the engine is checked to compute, under ``torch.autocast``, what
    autograd computes under the same autocast (tests/engines/test_autocast.py); the others
    refuse a step under autocast, naming why (:meth:`autocast_why`)."""
    wrapped_models: ClassVar[bool] = False
    """``True`` when the engine's gradients are averaged by ``DistributedDataParallel``
    or FSDP as autograd's are (its backward is the wrapper's own); the others refuse a
    wrapped model, naming how to unwrap it (:mod:`~leangrad.engines._wrapped`)."""
    reruns: ClassVar[bool] = False
    """``True`` when the engine runs part of the model again after the forward phase
    (recomputation, replays): buffers are then guarded so that running statistics
    advance once (:class:`~leangrad.engines._contract.BufferGuard`)."""
    forward_mode: ClassVar[bool] = False
    """``True`` when the engine computes its gradient with forward-mode AD of the whole
    step (jvps): no transform composes with it, and it is never estimated on fake
    tensors (a vmap of jvps reads values)."""
    transforms_act_on: ClassVar[str] = "model"
    """Where a composition's transforms (``"+fad"``, ``"+rad"``, …) act under this base
    engine: ``"model"`` (the whole model: autograd runs all of it), ``"stem_head"`` (the
    model's ``stem`` and ``head``: the layers between keep the engine's own rules) or
    ``"blocks"`` (each block the engine finds, which stays one block:
    :meth:`apply_transforms` says how)."""

    plan_offers: ClassVar[tuple[PlanOffer, ...]] = ()
    """The fixed candidates :meth:`plan_candidates` returns unless overridden (``backprop``;
    ``fad`` and ``bits`` on the whole model; the chain engines', on a chain only)."""

    @classmethod
    def plan_candidates(cls, model: nn.Module, *, found: Blocks | None,
                        loss_fn: Callable[[Any], torch.Tensor] | None,
                        exact: bool) -> list[PlanOffer]:  # fmt: skip
        """The candidates this engine offers :func:`leangrad.plan` on ``model``
        (``found``: its blocks, ``None`` where none were found; ``loss_fn``: the step's
        loss, a :class:`leangrad.loss.PerExample` where declared a mean over examples;
        ``exact``: only exact candidates wanted). Default: :attr:`plan_offers` (none
        unless set) — an engine the planner should try says so there or here."""
        del model, found, loss_fn, exact
        return [offer._replace(options=dict(offer.options)) for offer in cls.plan_offers]

    @classmethod
    def plan_last_resorts(cls, model: nn.Module) -> list[PlanOffer]:
        """Candidates :func:`leangrad.plan` tries only when nothing else fits. Default:
        none."""
        del model
        return []

    def apply_transforms(self, model: nn.Module,
                         transform: Callable[[str, nn.Module], nn.Module],
                         ) -> tuple[nn.Module, Engine]:  # fmt: skip
        """``model`` with ``transform(part, module)`` applied where this engine leaves
        the work to autograd (:attr:`transforms_act_on`), and the engine that runs the
        result (``self`` unless it must be told what changed). The user's module is never
        modified."""
        if self.transforms_act_on != "stem_head":
            return transform("model", model), self
        new = copy.copy(model)  # the same layers and rules; only stem and head change
        new._modules = dict(model._modules)
        for part in ("stem", "head"):
            module = getattr(model, part, None)
            if isinstance(module, nn.Module):
                setattr(new, part, transform(part, module))
        return new, self

    def transform_blocks(self, model: nn.Module) -> tuple[str, ...]:
        """The blocks a step transform (``accumulate``, ``chunked_ce``) should treat as
        this engine's (checkpointing: those it finds); default none."""
        del model
        return ()

    def blocks(self, model: nn.Module) -> Blocks:
        """The blocks of ``model`` as this engine sees them: :func:`leangrad.blocks`'s by
        default; ``checkpoint`` overrides it with those it checkpoints (its ``blocks=``), a
        composition with its base engine's. ``fit(parallel="fsdp")`` shards each in an FSDP
        unit of its own (:func:`leangrad.train._sharded.shard`).

        Raises:
            EngineInputError: no blocks are found in ``model``.
        """
        return find_blocks(model)

    def idle_reason(self, model: nn.Module) -> str | None:
        """Why this engine, though it supports ``model``, computes there just what a
        simpler one does (a composition whose transforms change nothing), so that
        :func:`leangrad.plan` does not offer it; ``None`` (the default) when it does not."""
        del model
        return None

    def explain_lines(self, model: nn.Module) -> list[str]:
        """What :func:`leangrad.explain` prints about this engine on ``model`` (the
        checkpointed blocks, what each transform changed); default nothing."""
        del model
        return []

    def __init__(self, **options: Any) -> None:
        self.options: dict[str, Any] = options

    @property
    def probes(self) -> bool:
        """``True`` when the engine's first step on a model does extra work later steps
        skip (``checkpoint(fragments=...)`` probes each block once, ``trace=True`` traces
        it): an estimate on fake tensors warms it up first
        (:func:`leangrad.measure.estimate_step`). The work holds nothing at a real step's
        peak, so a real measurement tracks the first step (:mod:`leangrad.planner._measure`)."""
        return False

    @property
    def costly_estimate(self) -> bool:
        """``True`` when a fake-tensor estimate of a step costs about as much as the step
        (``checkpoint(fragments=...)``: fragments multiply a step's operators, and a fake
        operator costs what a real one does at small sizes); the planner then measures it
        for real instead of asking the estimate first (:mod:`leangrad.planner._measure`)."""
        return False

    @property
    def label(self) -> str:
        """The name with its non-default options, e.g. ``checkpoint(segments=4)`` (made
        again only when the options changed: a step reads it twice)."""
        made = self.__dict__.get("_label")
        if made is not None and made[0] == self.options:
            return str(made[1])
        text = self._make_label()
        self.__dict__["_label"] = (dict(self.options), text)
        return text

    def _make_label(self) -> str:
        params = _init_parameters(type(self))
        shown = {
            k: v
            for k, v in self.options.items()
            if k not in params
            or params[k].default is inspect.Parameter.empty
            or params[k].default != v
        }
        if not shown:
            return self.name
        return f"{self.name}({','.join(f'{k}={v}' for k, v in shown.items())})"

    def __repr__(self) -> str:
        return f"<leangrad engine {self.label}>"

    def state_dict(self) -> dict[str, Any]:
        """What a resumed training run needs to continue this engine bit-exactly (its
        random generators' states); empty for engines that draw nothing of their own.
        Training checkpoints store it (:func:`leangrad.train.fit`)."""
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` into a freshly made engine with the same options."""
        if state:
            raise errors.EngineInputError(
                f"{self.label} keeps no state, but was given {sorted(state)}: a checkpoint of "
                "another engine? Resume with the engine the run was started with"
            )

    def autocast_why(self) -> str | None:
        """Why this engine's step cannot run under ``torch.autocast`` (``None``: it can)."""
        if self.autocast:
            return None
        return (f"{self.name}'s own backward rules are not checked under reduced precision "
                "(they run outside autocast, or mix dtypes)")  # fmt: skip

    def supports(self, model: nn.Module) -> str | None:
        """``None`` if this engine can differentiate ``model``, else the reason it cannot.

        Generic engines accept any module; engines that need layer rules
        (e.g. a chain of submersive layers) override this.
        """
        del model
        return None

    def backward(
        self,
        model: nn.Module,
        inputs: Inputs,
        loss_fn: LossFn,
        *,
        on_grad: OnGrad | None = None,
    ) -> StepResult:
        """Compute the loss and fill ``p.grad`` of every trainable parameter of ``model``.

        Args:
            model: the network; called as ``model(*inputs)``, or ``model(**inputs)``.
            inputs: a tensor, a sequence of tensors, or a mapping of names to tensors
                (a Hugging Face batch; values that are not tensors are passed as they are).
            loss_fn: maps the model output to a scalar loss (closes over targets).
            on_grad: optional ``on_grad(name, param)``, called for each parameter as
                soon as its gradient is final for this step.

        Returns:
            A :class:`StepResult` with the detached loss.
        """
        with step_scope():
            return self._checked_backward(model, inputs, loss_fn, on_grad)

    def _checked_backward(self, model: nn.Module, inputs: Inputs, loss_fn: LossFn,
                          on_grad: OnGrad | None) -> StepResult:  # fmt: skip
        """:meth:`backward`'s checks, then :meth:`_backward`."""
        model, flat = positional(model, inputs)
        xs = as_input_tuple(flat)
        _check_inputs(xs, _first_trainable(model))
        params = Trainable(model)
        wrapper = wrapped_by(model)
        if wrapper is not None and wrapper[0] == DDP and not self.wrapped_models:
            return self._under_ddp(model, inputs, loss_fn, on_grad)
        if wrapper is not None and not self.wrapped_models:
            raise errors.EngineInputError(WRAPPED.format(engine=self.label, wrapper=wrapper[0],
                                                         unwrap=wrapper[1]))  # fmt: skip
        if wrapper is not None and (why := self.wrapped_why(model, wrapper[0])) is not None:
            raise errors.EngineInputError(why)
        if (kind := autocast_on(xs)) is not None and (why := self.autocast_why()) is not None:
            raise errors.EngineInputError(NO_AUTOCAST.format(engine=self.label, device=kind,
                                                             why=why))  # fmt: skip
        check_batch(xs, model)
        if not self.input_gradients:
            refuse_input_grads(self.label, xs)
        rerun = list(self.rerun_modules(model))
        if rerun:
            refuse_hooks(self.label, rerun)
        guard = BufferGuard(model) if self.reruns else contextlib.nullcontext()
        with guard:
            if on_grad is None:
                return self._backward(model, xs, loss_fn, params, None)
            held = self.revisited_parameters(model, params)
            if wrapper is not None:  # DDP averages at the end of the backward: hand over then
                held = {id(p) for p in params.values()}
            announcer = GradAnnouncer(self.label, params, on_grad, held=held)
            result = self._backward(model, xs, loss_fn, params, announcer)
            announcer.finish()
            return result

    def _under_ddp(self, ddp: nn.Module, inputs: Inputs, loss_fn: LossFn,
                   on_grad: OnGrad | None) -> StepResult:  # fmt: skip
        """The step on the module DDP wraps, its gradients then handed to DDP's own
        backward (:func:`leangrad.surrogate_loss`): DDP's hooks average them in one
        reduction (or keep them local inside ``no_sync``), as for autograd's."""
        from ._surrogate import held_step

        loss, result = held_step(self, ddp, inputs, loss_fn)
        loss.backward()
        if on_grad is not None:
            for name, p in trainable_parameters(ddp).items():
                on_grad(name, p)
        return StepResult(loss=result.loss, engine=result.engine, info=result.info)

    def wrapped_why(self, model: nn.Module, wrapper: str) -> str | None:
        """Why this engine, with its options, cannot run on ``model`` wrapped by
        ``wrapper`` (a name from :mod:`~leangrad.engines._wrapped`: ``DDP``, ``FSDP2``,
        ``FSDP1``), though it declares ``wrapped_models``; ``None`` when it can. ``model``
        may be the wrapped model or the one about to be wrapped (``fit`` asks before it
        shards). Default: it can."""
        del model, wrapper
        return None

    def revisited_parameters(self, model: nn.Module,
                             params: Mapping[str, nn.Parameter]) -> set[int]:  # fmt: skip
        """Ids of the parameters whose gradient this engine forms in several pieces that it
        hands to ``on_grad`` one by one (a chain layer listed twice, a parameter shared by
        the stem and the head): :class:`GradAnnouncer` holds their calls back until the
        end of the step. Default: none — the engine calls ``on_grad`` once per parameter
        with its final gradient (autograd's post-accumulate-grad hooks fire once per
        backward pass, tied weights included)."""
        del model, params
        return set()

    def rerun_modules(self, model: nn.Module) -> Iterable[tuple[str, nn.Module]]:
        """The (name, module) pairs this engine runs more than once per step; their
        forward hooks would fire more than once, so :meth:`backward` refuses them."""
        del model
        return ()

    @abc.abstractmethod
    def _backward(
        self,
        model: nn.Module,
        inputs: tuple[torch.Tensor, ...],
        loss_fn: LossFn,
        params: Mapping[str, nn.Parameter],
        on_grad: OnGrad | None,
    ) -> StepResult:
        """Engine-specific work; inputs already validated."""

    @staticmethod
    def _positive_int(name: str, value: object) -> int:
        """Validate an integer option ≥ 1 (bools are rejected)."""
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(errors.POSITIVE_INT.format(name=name, value=value))
        return value

    def _result(self, loss: torch.Tensor, **info: Any) -> StepResult:
        return StepResult(loss=loss.detach(), engine=self.label, info=info)


@functools.cache
def _init_parameters(cls: type[Engine]) -> Mapping[str, inspect.Parameter]:
    """``cls.__init__``'s parameters (read once per class: a label is made per step)."""
    return inspect.signature(cls.__init__).parameters


class GradAnnouncer:
    """The ``on_grad`` an engine's :meth:`Engine._backward` receives: it hands each
    parameter to the user's ``on_grad`` exactly once per step, with its final gradient.

    Calls for the parameters in ``held`` (ids; the engine's
    :meth:`Engine.revisited_parameters`, whose gradient arrives in pieces) are held back
    and made by :meth:`finish` at the end of the step, when every piece is in — and no
    optimizer step inside ``on_grad`` moves a parameter the step has yet to use. Every
    other parameter is handed on at once; a second call for one of them is an engine bug,
    raised (a ``RuntimeError``, not a refusal) rather than passed over in silence. A
    parameter reached under several names (tied weights) is handed on under its name in
    ``params``.

    Args:
        engine: the engine's label, for the error.
        params: the step's trainable parameters by name.
        on_grad: the user's callback.
        held: ids of the parameters whose calls wait for :meth:`finish`.
    """

    def __init__(
        self,
        engine: str,
        params: Mapping[str, nn.Parameter],
        on_grad: OnGrad,
        *,
        held: set[int],
    ) -> None:
        self.engine = engine
        self.on_grad = on_grad
        self.held = held
        self._names = {id(p): n for n, p in params.items()}
        self._pending: dict[int, tuple[str, nn.Parameter]] = {}
        self._done: set[int] = set()

    def __call__(self, name: str, param: nn.Parameter) -> None:
        key = id(param)
        name = self._names.get(key, name)
        if key in self.held:
            self._pending[key] = (name, param)
            return
        if key in self._done:
            raise RuntimeError(ON_GRAD_TWICE.format(engine=self.engine, name=name))
        self._done.add(key)
        self.on_grad(name, param)

    def finish(self) -> None:
        """Hand on the held-back parameters that received a gradient this step."""
        pending, self._pending = self._pending, {}
        for name, param in pending.values():
            self.on_grad(name, param)


def autocast_on(xs: tuple[torch.Tensor, ...]) -> str | None:
    """The device type ``torch.autocast`` is on for (the inputs' devices and the CPU), or
    ``None``."""
    if torch.is_autocast_enabled("cpu"):
        return "cpu"
    for x in xs:  # sorted: "cpu" first, then the inputs' other devices
        kind = x.device.type
        if kind != "cpu" and torch.is_autocast_enabled(kind):
            return kind
    return None


def as_input_tuple(inputs: torch.Tensor | Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """Normalise ``inputs`` to a tuple of tensors, naming the first non-tensor."""
    xs = (inputs,) if isinstance(inputs, torch.Tensor) else tuple(inputs)
    for i, x in enumerate(xs):
        if not isinstance(x, torch.Tensor):
            raise errors.EngineInputError(
                errors.INPUT_NOT_TENSOR.format(type=type(x).__name__, index=i)
            )
    return xs


def trainable_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    """Named parameters with ``requires_grad``; raises when there are none."""
    if not isinstance(model, nn.Module):
        raise errors.EngineInputError(
            f"model must be a torch.nn.Module, got {type(model).__name__}"
        )
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    if not params:
        raise errors.EngineInputError(errors.NO_PARAMETERS.format(model=type(model).__name__))
    return params


class Trainable(Mapping[str, nn.Parameter]):
    """:func:`trainable_parameters` of a model, walked on first use: a step whose engine
    reads no parameter by name (backprop without ``on_grad``) never walks the module tree
    (on a small model, that walk was the largest host cost of the step)."""

    def __init__(self, model: nn.Module) -> None:
        self._model = model
        self._params: dict[str, nn.Parameter] | None = None

    @property
    def params(self) -> dict[str, nn.Parameter]:
        if self._params is None:
            self._params = trainable_parameters(self._model)
        return self._params

    def __getitem__(self, name: str) -> nn.Parameter:
        return self.params[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.params)

    def __len__(self) -> int:
        return len(self.params)


def _first_trainable(model: nn.Module) -> nn.Parameter:
    """The model's first trainable parameter (the walk stops there); raises when there is
    none, as :func:`trainable_parameters` does."""
    if not isinstance(model, nn.Module):
        raise errors.EngineInputError(
            f"model must be a torch.nn.Module, got {type(model).__name__}"
        )
    ref = next((p for p in model.parameters() if p.requires_grad), None)
    if ref is None:
        raise errors.EngineInputError(errors.NO_PARAMETERS.format(model=type(model).__name__))
    return ref


def _check_inputs(xs: tuple[torch.Tensor, ...], ref: nn.Parameter) -> None:
    for i, x in enumerate(xs):
        if x.is_floating_point() and x.dtype != ref.dtype:
            raise errors.EngineInputError(
                errors.INPUT_DTYPE.format(index=i, input_dtype=x.dtype, param_dtype=ref.dtype)
            )
        if x.device != ref.device:
            raise errors.EngineInputError(
                errors.INPUT_DEVICE.format(
                    index=i, input_device=x.device, param_device=str(ref.device)
                )
            )


def forward_loss(
    engine: str, model: Callable[..., Any], xs: tuple[torch.Tensor, ...], loss_fn: LossFn
) -> torch.Tensor:
    """Run the model (any callable) and the loss with autograd recording, then mark the
    forward end."""
    loss = check_loss(loss_fn(run_forward(engine, model, xs)))
    forward_end()
    return loss


def accumulate_grad(param: nn.Parameter, grad: torch.Tensor) -> None:
    """Write ``grad`` into ``param.grad`` the way autograd does: set, or add in place."""
    grad = grad.detach().reshape(param.shape).to(param.dtype)
    if param.grad is None:
        param.grad = grad
    else:
        param.grad.add_(grad)
