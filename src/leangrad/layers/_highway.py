"""The decomposition f_i(x) = r_i(x, g_i(x)) that Highway-BP needs (paper section 3, eq. 1-2).

A layer's Jacobian splits as ``∂f/∂x = J + K`` (eq. 2) with ``J = ∂r/∂z · ∂g/∂x``
(expensive; only multiplied by vectors) and ``K = ∂r/∂x`` (cheap). leangrad supports
three structures of ``K`` (paper section 4.3: "scalar, identity, diagonal"):

- ``"identity"`` — ``r(x, z) = x + z`` (pre-activation ResNet, pre-LN transformer);
- ``"scalar"`` — ``r(x, z) = c·x + z`` (the γ split of eq. 17, ``c = 1 − γ``);
- ``"diagonal"`` — ``r(x, z) = d(x, z) ⊙ x + …`` (ReLU after the add, post-LN, GRU, LSTM).

Two kinds of objects implement it:

- a :class:`HighwayBlock` is one residual layer with ``g``, ``r``, ``k_factor`` and
  ``r_z_vjp`` (the cotangent of ``z`` given the cotangent of ``r``); a
  :class:`~leangrad.highway.ResidualStack` chains L of them;
- a :class:`HighwayStack` is anything that runs L layers and offers the three batched
  operations the engine uses: :meth:`~HighwayStack.trace` (forward, saving what the
  backward needs), :meth:`~HighwayStack.j_vjp` (``w_t J_t`` for every t at once, eq. 8)
  and :meth:`~HighwayStack.param_vjp` (parameter and input gradients in one batched vjp).
"""

from __future__ import annotations

import abc
import dataclasses
import itertools
from collections.abc import Sequence
from typing import Any, ClassVar, Literal

import torch
from torch import nn

from .._errors import LeangradError

__all__ = [
    "BAD_GAMMA",
    "BAD_K_SHAPE",
    "BAD_K_STRUCTURE",
    "BLOCK_WIDTH",
    "EMPTY_SEQUENCE",
    "K_STRUCTURES",
    "MISMATCHED_SIZES",
    "NOT_HIGHWAY",
    "SHORT_SEQUENCE",
    "HighwayBlock",
    "HighwayError",
    "HighwayNet",
    "HighwayStack",
    "KStructure",
    "Trace",
    "check_block",
    "check_gamma",
    "check_k",
]

KStructure = Literal["identity", "scalar", "diagonal"]
K_STRUCTURES: tuple[str, ...] = ("identity", "scalar", "diagonal")

BAD_K_STRUCTURE = (
    "{block}: k_structure must be one of {known} (K = ∂r/∂x must stay cheap to multiply, "
    "paper section 4.3), got {value!r}; write the layer as r(x, g(x)) with r(x, z) = x + z, "
    "c·x + z or d(x, z) ⊙ x + e(z), or use the fpi baseline (baseline='fpi')"
)
BAD_K_SHAPE = (
    "{block}: k_structure {structure!r} needs k_factor of shape {want}, got {got}; "
    "a diagonal K is a tensor shaped like the layer's state, a scalar K one number"
)
BAD_GAMMA = "{block}: gamma must lie in [0, 1] (eq. 17 / eq. 23 split), got {gamma!r}"
MISMATCHED_SIZES = (
    "{where}: mismatched hidden sizes: {detail}; Highway-BP runs the residual path through "
    "every layer, so each layer must map a state to a state of the same shape"
)
SHORT_SEQUENCE = (
    "{where}: Highway-BP needs a sequence of length >= 2 (got length {length}); "
    "a sequence of length 0 has nothing to differentiate and length 1 has no residual path "
    "— use the backprop engine for it"
)
EMPTY_SEQUENCE = (
    "input {index} has sequence length 0 (shape {shape}): {where} reads it time-first, "
    "(L, batch, …), so dimension 0 is the sequence, and a sequence of no time steps has no "
    "loss to differentiate; skip empty sequences (e.g. drop zero-length samples before "
    "batching), or transpose batch-first data to (L, batch, …)"
)
BLOCK_WIDTH = (
    "{where}: block {index} ({block}) expects width {want} but receives width {got} "
    "({source}); a residual stack keeps the state's shape through every block, so all its "
    "blocks need one width: {fix}"
)

NOT_HIGHWAY = (
    "the highway engine needs a leangrad.highway.HighwayNet (stem -> HighwayStacks -> head) "
    "or a HighwayStack, got {model}; build one, e.g. HighwayNet(stem, [ResidualStack(blocks)], "
    "head) or HighwayNet(embedding, [GRULayer(h, h)], head) (leangrad.zoo.highway_gru_lm), or "
    "use an engine that takes the model as written: 'backprop', 'checkpoint', 'fad', 'rad'"
)


class HighwayError(LeangradError, ValueError):
    """A model, block or option that breaks the Highway-BP decomposition's contract."""


@dataclasses.dataclass
class Trace:
    """What a stack's traced forward keeps for the Highway-BP backward.

    Attributes:
        output: what the next stage of the model consumes.
        length: L, the number of layers (time steps for a recurrent stack).
        k: the K factors stacked over layers, ``(L, *state)`` for diagonal K (for a
            stack whose :meth:`HighwayStack.k_support` is a slice: K on that slice of the
            last axis only, as K = 0 elsewhere), ``(L, 1, …, 1)`` for scalar K, ``None``
            when every K is the identity.
        saved: stack-specific tensors (gates, block inputs, …).
    """

    output: torch.Tensor
    length: int
    k: torch.Tensor | None
    saved: dict[str, Any] = dataclasses.field(default_factory=dict)


class HighwayBlock(nn.Module, abc.ABC):
    """One residual layer ``f(x) = r(x, g(x))`` (eq. 1) with a cheap ``K = ∂r/∂x``.

    Subclasses set :attr:`k_structure` and implement :meth:`g`, :meth:`r`,
    :meth:`k_factor` and :meth:`r_z_vjp`; ``forward(x) = r(x, g(x))``.
    """

    k_structure: ClassVar[str] = "identity"
    width: int | None = None
    """The size of the input dimension :attr:`width_dim` the block is built for (its
    channels or features); ``None``: not declared. A :class:`~leangrad.highway.ResidualStack`
    checks it, so that blocks of different widths are named instead of failing deep inside."""
    width_dim: ClassVar[int] = -1
    """The input dimension that :attr:`width` sizes (1 for ``(N, C, H, W)`` images)."""

    @abc.abstractmethod
    def g(self, x: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """The expensive block ``z = g(x)`` (all the parameters live here)."""

    @abc.abstractmethod
    def r(self, x: torch.Tensor, z: Any) -> torch.Tensor:
        """The cheap residual function ``r(x, z)``; parameter-free."""

    def k_factor(self, x: torch.Tensor, z: Any) -> torch.Tensor | float | None:
        """``K = ∂r/∂x``: ``None`` (identity), a float (scalar) or a state-shaped tensor."""
        del x, z
        return None

    @abc.abstractmethod
    def r_z_vjp(self, x: torch.Tensor, z: Any, w: torch.Tensor) -> Any:
        """``w · ∂r/∂z`` with the structure of ``z`` (a tensor or a tuple)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.r(x, self.g(x))


class HighwayStack(nn.Module, abc.ABC):
    """L layers that the highway engine differentiates with batched operations.

    ``forward`` is the plain autograd forward (what backprop differentiates);
    :meth:`trace` runs the same computation for the engine and returns a :class:`Trace`.
    Index ``t`` (0-based) is the layer producing state ``t + 1``; the cotangent
    ``w[t]`` lives on that state.
    """

    k_structure: ClassVar[str] = "identity"
    time_first: ClassVar[bool] = False
    """The input is ``(L, batch, …)`` (a recurrent stack): dimension 0 is the sequence."""
    direct_off_support: ClassVar[bool] = False
    """``direct_grads`` is zero wherever :meth:`k_support` lets K be non-zero (an LSTM's
    loss sees ``h``, its K moves only ``c``): eq. 10's scan of the direct gradients is then
    the identity, and the engine skips it."""

    def explain_empty_input(self, index: int, x: torch.Tensor) -> str | None:
        """Why the empty input ``x`` (position ``index``) cannot be differentiated, when this
        stack knows which of its dimensions is empty (a time-first stack: the sequence);
        ``None`` leaves the engine's generic "empty batch" message. Engines ask the model
        before any forward."""
        if self.time_first and x.dim() >= 1 and x.shape[0] == 0:
            return EMPTY_SEQUENCE.format(index=index, shape=tuple(x.shape), where=self._name())
        return None

    def _name(self) -> str:
        return f"{type(self).__name__}({self.extra_repr()})"

    def k_support(self) -> slice | None:
        """Where a diagonal K may be non-zero, as a slice of the state's last axis
        (``None``: anywhere). Outside it K = 0: ``trace.k`` holds K on this slice only, and
        the engine scans only this part, leaving the cotangent as it is elsewhere (an
        LSTM's ``K = diag([f, 0])``: the ``c`` half)."""
        return None

    @abc.abstractmethod
    def trace(self, x: torch.Tensor) -> Trace:
        """Run the stack on ``x`` keeping what the backward needs (no autograd graph
        outside what :meth:`j_vjp` needs)."""

    def prepare(self, trace: Trace) -> None:
        """Backward-only set-up from what :meth:`trace` saved (e.g. gates -> J-vjp factors,
        ``trace.k``); the engine calls it first, so its cost counts as backward time."""

    @abc.abstractmethod
    def direct_grads(self, trace: Trace, dy: torch.Tensor) -> torch.Tensor:
        """``∂L_t/∂h_t`` for every state t (``(L, *state)``) given the output's cotangent."""

    @abc.abstractmethod
    def j_vjp(self, trace: Trace, w: torch.Tensor) -> torch.Tensor:
        """``w[t] · J_t`` for every layer t at once (eq. 8): ``(L, *state)``."""

    @abc.abstractmethod
    def param_vjp(
        self, trace: Trace, w: torch.Tensor, dy: torch.Tensor
    ) -> tuple[dict[nn.Parameter, torch.Tensor], torch.Tensor]:
        """Parameter gradients ``Σ_t w[t] ∂f_t/∂θ`` and the gradient of the stack's input,
        in one batched vjp (``dy`` is the output cotangent, for skip connections)."""


def check_k(block: str, structure: str, value: Any, state_shape: torch.Size) -> None:
    """Raise :class:`HighwayError` unless ``value`` has the structure ``structure`` declares."""
    if structure not in K_STRUCTURES:
        raise HighwayError(
            BAD_K_STRUCTURE.format(block=block, known=", ".join(K_STRUCTURES), value=structure)
        )
    if structure == "identity":
        ok, want = value is None, "None"
    elif structure == "scalar":
        ok = isinstance(value, (int, float)) or (
            isinstance(value, torch.Tensor) and value.numel() == 1
        )
        want = "a float"
    else:
        ok = isinstance(value, torch.Tensor) and value.shape == state_shape
        want = str(tuple(state_shape))
    if not ok:
        got = tuple(value.shape) if isinstance(value, torch.Tensor) else repr(value)
        raise HighwayError(
            BAD_K_SHAPE.format(block=block, structure=structure, want=want, got=got)
        )


def check_block(block: nn.Module) -> None:
    """Validate a user block eagerly: it is a :class:`HighwayBlock` with a supported K."""
    name = type(block).__name__
    structure = getattr(block, "k_structure", None)
    if not isinstance(block, HighwayBlock) or structure not in K_STRUCTURES:
        raise HighwayError(
            BAD_K_STRUCTURE.format(block=name, known=", ".join(K_STRUCTURES), value=structure)
        )


def check_gamma(block: str, gamma: float) -> float:
    """``gamma`` as a float in [0, 1], else :class:`HighwayError` naming the block."""
    if isinstance(gamma, bool) or not isinstance(gamma, (int, float)) or not 0 <= gamma <= 1:
        raise HighwayError(BAD_GAMMA.format(block=block, gamma=gamma))
    return float(gamma)


class HighwayNet(nn.Module):
    """``head(stacks(stem(*inputs)))``: the model the highway engine differentiates.

    ``stem`` and ``head`` are any modules (``None`` for identity) and are differentiated
    by autograd; the stacks run Highway-BP. A recurrent head is applied to every time
    step, so a loss over all steps gives the per-step losses ``L_t(h_t)`` of section 3.

    Args:
        stem: maps the inputs to the first stack's input.
        stacks: :class:`HighwayStack` s applied in order (e.g. stacked GRU layers).
        head: maps the last stack's output to what ``loss_fn`` takes.
    """

    def __init__(
        self, stem: nn.Module | None, stacks: Sequence[HighwayStack], head: nn.Module | None
    ) -> None:
        super().__init__()
        if len(stacks) == 0:
            raise HighwayError("HighwayNet needs at least one HighwayStack, got none")
        for i, s in enumerate(stacks):
            if not isinstance(s, HighwayStack):
                raise HighwayError(NOT_HIGHWAY.format(model=f"stacks[{i}] {type(s).__name__}"))
        for i, (a, b) in enumerate(itertools.pairwise(stacks)):
            out, inp = getattr(a, "hidden_size", None), getattr(b, "input_size", None)
            if out is not None and inp is not None and out != inp:
                raise HighwayError(
                    MISMATCHED_SIZES.format(
                        where=f"HighwayNet.stacks[{i}] -> stacks[{i + 1}]",
                        detail=f"hidden_size {out} feeds input_size {inp}",
                    )
                )
        self.stem = stem
        self.stacks = nn.ModuleList(stacks)
        self.head = head

    def explain_empty_input(self, index: int, x: torch.Tensor) -> str | None:
        """The first stack's :meth:`HighwayStack.explain_empty_input` when the stem keeps
        the input's leading dimensions (none, ``nn.Identity`` or ``nn.Embedding``: token ids
        ``(L, batch)`` become ``(L, batch, d)``), else ``None``."""
        keeps_layout = self.stem is None or isinstance(self.stem, (nn.Identity, nn.Embedding))
        if index != 0 or not keeps_layout:
            return None
        first = self.stacks[0]
        assert isinstance(first, HighwayStack)
        return first.explain_empty_input(index, x)

    def forward(self, *inputs: torch.Tensor) -> Any:
        x = self.stem(*inputs) if self.stem is not None else inputs[0]
        for s in self.stacks:
            x = s(x)
        return self.head(x) if self.head is not None else x
