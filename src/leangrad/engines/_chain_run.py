"""What the chain engines (``moonwalk``, ``revbackprop``) share: their base class
:class:`ChainEngine` (the model as a :class:`~leangrad.Chain` with checked layers, what
they rerun, where they are offered), the stem run once and replayed, the head
differentiated by autograd, and a :class:`GradSink` that takes each layer's parameter
gradients as they are formed.

Both engines handle a chain ``head(f_L ∘ … ∘ f_1(stem(x)))`` the same way at its
ends (Moonwalk v1 section 4, whose RevBackprop baseline walks the same chain): the
head's graph lives only until the chain output's cotangent h_L exists, and the
stem is replayed under its first run's RNG state instead of keeping x₀.
"""

from __future__ import annotations

import abc
import itertools
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from .. import _errors as errors
from ..layers._base import (
    NOT_INVERTIBLE,
    NOT_SUBMERSIVE,
    ChainLayer,
    NotInvertibleError,
    NotSubmersiveError,
)
from ..layers._chain import Chain
from ._backprop import grad_hooks
from ._base import Engine, LossFn, OnGrad, PlanOffer, accumulate_grad, check_loss, run_forward
from ._contract import forward_end, random_module

if TYPE_CHECKING:
    from ._blocks import Blocks

__all__ = [
    "LAYER_ERROR",
    "NOT_A_CHAIN",
    "RANDOM_LAYER",
    "ChainEngine",
    "GradSink",
    "StemRun",
    "chain_and_layers",
    "chain_of",
    "chain_reruns",
    "chain_revisited",
    "head_backward",
    "refuse_random_layers",
]

NOT_A_CHAIN = (
    "engine {engine!r} needs a leangrad.Chain(stem=..., *layers, head=...) whose layers carry "
    "chain rules; got {model}. Build the model as leangrad.Chain, or use an engine that "
    "takes the model as written: 'backprop', 'checkpoint' (its repeated blocks, or "
    "blocks=[...]), 'fad', 'rad'"
)
LAYER_ERROR = "chain layer {index}: {error}"
RANDOM_LAYER = (
    "engine {engine!r} reruns the chain layers after the forward pass, so they must be "
    "deterministic, but chain layer {index} has {module} in training mode (its masks "
    "would differ between the runs); move dropout into the stem or the head, or call "
    "model.eval() on that layer"
)


def refuse_random_layers(engine: str, layers: list[ChainLayer]) -> None:
    """Chain layers are rerun (Phase III, inverses): dropout in them would draw new masks."""
    for i, layer in enumerate(layers):
        found = random_module(layer)
        if found is not None:
            raise errors.EngineInputError(RANDOM_LAYER.format(engine=engine, index=i, module=found))


def chain_reruns(chain: Chain, *, head: bool = False) -> list[tuple[str, nn.Module]]:
    """The modules a chain engine runs more than once: the stem (replayed), the chain
    layers (Phase III, inverses) and, in pure mode, the head."""
    parts = [("stem", chain.stem), ("layers", chain.layers)]
    parts += [("head", chain.head)] if head else []
    return [(f"{p}.{n}" if n else p, m) for p, mod in parts for n, m in mod.named_modules()]


def chain_revisited(model: nn.Module, params: Mapping[str, nn.Parameter]) -> set[int]:
    """Ids of the trainable parameters held by more than one part of a chain (stem, each
    chain layer position, head): a chain engine hands each part's gradients over on their
    own, so these arrive in pieces (a layer listed twice, weights tied across parts) and
    their ``on_grad`` waits for the end of the step (:class:`~._base.GradAnnouncer`)."""
    if not isinstance(model, Chain):
        return set()  # refused by the engine's _backward, naming the fix
    trainable = {id(p) for p in params.values()}
    seen: set[int] = set()
    twice: set[int] = set()
    for part in [model.stem, *model.layers, model.head]:
        for key in {id(p) for p in part.parameters()} & trainable:
            (twice if key in seen else seen).add(key)
    return twice


def chain_of(model: nn.Module, engine: str) -> Chain:
    """``model`` as a Chain, or an error naming the fix."""
    if not isinstance(model, Chain):
        raise errors.EngineInputError(NOT_A_CHAIN.format(engine=engine, model=type(model).__name__))
    return model


def chain_and_layers(model: nn.Module, engine: str, *, need: str) -> tuple[Chain, list[ChainLayer]]:
    """The chain and its layers, each checked to be ``need`` ("submersive"/"invertible");
    the first that is not raises, naming its index, the layer and the fix."""
    chain = chain_of(model, engine)
    layers = chain.rule_layers(engine)
    for i, layer in enumerate(layers):
        if not getattr(layer, need):
            template, error = (
                (NOT_SUBMERSIVE, NotSubmersiveError)
                if need == "submersive"
                else (NOT_INVERTIBLE, NotInvertibleError)
            )
            msg = template.format(layer=layer._describe())
            raise error(LAYER_ERROR.format(index=i, error=msg))
    return chain, layers


class ChainEngine(Engine):
    """Base class of the engines of a :class:`~leangrad.Chain`'s layer rules: they take
    the model only as a chain whose layers pass :meth:`_layers`' check, rerun its stem and
    layers (:func:`chain_reruns`), hand each part's gradients over on their own
    (:func:`chain_revisited`), leave the stem and head to autograd (and so to the
    transforms), and are offered to the planner on chains only."""

    reruns = True
    transforms_act_on = "stem_head"

    @classmethod
    def plan_candidates(cls, model: nn.Module, *, found: Blocks | None,
                        loss_fn: Callable[[Any], torch.Tensor] | None,
                        exact: bool) -> list[PlanOffer]:  # fmt: skip
        """On a :class:`~leangrad.Chain`: :attr:`~Engine.plan_offers`; elsewhere none."""
        if not isinstance(model, Chain):
            return []
        return super().plan_candidates(model, found=found, loss_fn=loss_fn, exact=exact)

    @abc.abstractmethod
    def _layers(self, model: nn.Module) -> tuple[Chain, list[ChainLayer]]:
        """The chain and its layers, each checked for this engine's rules; raises a
        :class:`~leangrad._errors.LeangradError` naming the first that fails and the fix."""

    @property
    def _reruns_head(self) -> bool:
        """Whether the head runs again after the forward pass too (moonwalk's pure mode)."""
        return False

    def supports(self, model: nn.Module) -> str | None:
        try:
            self._layers(model)
        except errors.LeangradError as err:
            return str(err)
        return None

    def rerun_modules(self, model: nn.Module) -> list[tuple[str, nn.Module]]:
        return chain_reruns(chain_of(model, self.label), head=self._reruns_head)

    def revisited_parameters(self, model: nn.Module,
                             params: Mapping[str, nn.Parameter]) -> set[int]:  # fmt: skip
        return chain_revisited(model, params)


class GradSink:
    """Where a chain engine's parameter gradients go: into ``.grad`` of the step's
    trainable parameters (``params``, keyed by their names in the model), each handed
    to ``on_grad`` as soon as its part of the chain is done, so it can be applied and freed
    at once (a parameter held by several parts: at the end of the step, see
    :func:`chain_revisited`).

    Args:
        params: the parameters this step differentiates, by full name.
        on_grad: called as ``on_grad(name, param)`` once ``param.grad`` is final.
    """

    def __init__(self, params: Mapping[str, nn.Parameter], on_grad: OnGrad | None) -> None:
        self.params = params
        self.on_grad = on_grad
        self._full_name = {id(p): n for n, p in params.items()}

    def trainable(self, layer: nn.Module) -> list[tuple[str, nn.Parameter]]:
        """The layer's parameters that take gradients this step, by local name."""
        return [(n, p) for n, p in layer.named_parameters() if id(p) in self._full_name]

    def deliver(self, layer: nn.Module, grads: dict[str, torch.Tensor]) -> None:
        """Write a layer's parameter gradients (keyed by local names) into ``.grad`` and call
        ``on_grad`` for each at once; frozen parameters (not in ``params``) get nothing."""
        local = dict(layer.named_parameters())
        for name, g in grads.items():
            full = self._full_name.get(id(local[name]))
            if full is not None:
                accumulate_grad(self.params[full], g)
                if self.on_grad is not None:
                    self.on_grad(full, self.params[full])

    def of(self, chain: Chain, module: nn.Module) -> dict[str, nn.Parameter]:
        """The trainable parameters of one part of the chain (stem, head), by their names in
        ``params`` (a weight tied across parts is named once there)."""
        del chain
        return {self._full_name[id(p)]: p for p in module.parameters() if id(p) in self._full_name}

    def hooks(self, chain: Chain, module: nn.Module, *, announce: bool = True) -> grad_hooks:
        """While autograd differentiates ``module``: ``on_grad`` for each of its parameters
        as autograd completes it (not when ``announce`` is false: see :meth:`announce`)."""
        return grad_hooks(self.of(chain, module), self.on_grad if announce else None)

    def announce(self, chain: Chain, module: nn.Module) -> None:
        """``on_grad`` for the parameters of ``module`` that have a gradient, all now."""
        if self.on_grad is None:
            return
        for n, p in self.of(chain, module).items():
            if p.grad is not None:
                self.on_grad(n, p)


class StemRun:
    """Runs the stem once without a graph and can replay it exactly (same RNG state),
    so the chain input x₀ need not be kept between the phases."""

    def __init__(self, chain: Chain, inputs: tuple[torch.Tensor, ...], engine: str) -> None:
        self.chain, self.inputs = chain, inputs
        self.devices = [x.device for x in inputs if x.device.type == "cuda"]
        self.cpu_state = torch.get_rng_state()
        self.cuda_states = [torch.cuda.get_rng_state(d) for d in self.devices]
        self.engine = engine
        self.input_grads = any(x.requires_grad for x in inputs)
        """Inputs want ``.grad``: the stem's backward must run even without parameters."""

    def take(self) -> torch.Tensor:
        """x₀ from the first run of the stem (the caller should drop it when done)."""
        with torch.no_grad():
            return run_forward(self.engine, self.chain.stem, self.inputs)

    def chunks(self, n_chunks: int) -> list[tuple[int, int]]:
        """Batch ranges for chunked replays of the stem."""
        n = self.inputs[0].shape[0]
        bounds = [round(i * n / n_chunks) for i in range(n_chunks + 1)]
        return [(a, b) for a, b in itertools.pairwise(bounds) if a < b]

    def on_chunk(self, a: int, b: int) -> torch.Tensor:
        """The stem on examples ``a:b`` of the batch (the caller sets the grad mode)."""
        return self.chain.stem(*(x[a:b] for x in self.inputs))

    def rng_moved(self) -> bool:
        """Whether the RNG streams moved since this run was made (something drew)."""
        if not torch.equal(torch.get_rng_state(), self.cpu_state):
            return True
        return any(not torch.equal(torch.cuda.get_rng_state(d), s)
                   for d, s in zip(self.devices, self.cuda_states, strict=True))  # fmt: skip

    def rewind(self) -> None:
        """Put the RNG streams back where they were when this run was made."""
        torch.set_rng_state(self.cpu_state)
        for d, s in zip(self.devices, self.cuda_states, strict=True):
            torch.cuda.set_rng_state(s, d)

    def replay(self, *, grad: bool = False) -> torch.Tensor:
        """x₀ again, bit for bit: the stem rerun under the RNG state of its first run."""
        with torch.random.fork_rng(devices=self.devices):
            self.rewind()
            with torch.set_grad_enabled(grad):
                return self.chain.stem(*self.inputs)

    def backward(
        self, h0: torch.Tensor, sink: GradSink, *, keep: bool = True, announce: bool = True
    ) -> torch.Tensor | None:
        """Give the stem's parameters their gradients from h₀ (replaying it with a graph);
        return x₀ (detached) for Phase III when ``keep``. ``announce=False`` leaves their
        ``on_grad`` to :meth:`GradSink.announce`."""
        if not sink.of(self.chain, self.chain.stem) and not self.input_grads:
            return self.replay() if keep else None
        x0 = self.replay(grad=True)
        with sink.hooks(self.chain, self.chain.stem, announce=announce):
            x0.backward(h0)
        return x0.detach() if keep else None


def head_backward(
    engine: str, chain: Chain, x_last: torch.Tensor, loss_fn: LossFn, sink: GradSink
) -> tuple[torch.Tensor, torch.Tensor]:
    """Loss and the chain output's cotangent h_L (head parameters get their grads).

    The head runs on a leaf made from the chain's output; a head that writes its input in
    place (``nn.Dropout(inplace=True)``, ``nn.ReLU(inplace=True)`` first) gets its own
    copy instead, as a leaf that requires grad cannot be written in place."""
    xl = x_last.detach().requires_grad_(True)
    head_in = xl.clone() if _writes_in_place(chain.head) else xl
    with torch.enable_grad():
        loss = check_loss(loss_fn(run_forward(engine, chain.head, (head_in,))))
    forward_end()
    with sink.hooks(chain, chain.head):
        loss.backward()
    assert xl.grad is not None
    return loss.detach(), xl.grad


def _writes_in_place(module: nn.Module) -> bool:
    """A submodule of ``module`` was built with ``inplace=True`` (dropout, activations)."""
    return any(getattr(m, "inplace", False) is True for m in module.modules())
