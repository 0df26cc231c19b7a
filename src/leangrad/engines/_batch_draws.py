"""Micro-batches that draw the whole batch's random numbers.

One forward of the whole batch draws, say, timm's ``DropPath`` mask as one ``(B, 1, 1, 1)``
tensor and a dropout mask as one tensor of the activation's shape; ``k`` micro-batches
drawing ``k`` smaller tensors one after another get other numbers, so accumulation would
compute the gradient of another network. :class:`BatchDraws` makes them get the same: at
each random op of the first micro-batch it draws the tensor the whole batch would have
drawn (same shape but the batch, same memory layout, same generator, same order, so the
generator moves exactly as in autograd's step) and hands the micro-batch its rows; the
later micro-batches, and every recomputation of a checkpointed block, get their rows of the
same tensor without drawing. A draw whose shape does not follow the batch (a noise vector
shared by every example) is drawn once and handed to every micro-batch whole, as one
forward would use it.

Which draws follow the batch is watched, not assumed: :func:`layout` compares the shapes a
forward of two examples draws with those of one example (``Draws`` records them). Ops that
draw from their input's values (``multinomial``, ``bernoulli(probs)``, ``randperm`` in a
data-dependent place, fused attention kernels with dropout) cannot be replayed this way:
the caller refuses them, naming the module.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .. import _errors as errors
from ..layers._bits import PackedBits, pack_bits, unpack_bits
from ._draws import BY_FIRST, REPLAYING, draw_shape, may_draw, op_name, size_index

__all__ = ["BatchDraws", "Drawn", "layout", "rng_states", "set_rng_states"]

CANNOT_REPLAY = (
    "{where} draws random numbers with {op}, which {pieces} cannot replay as the whole "
    "batch draws them ({why}); put it in eval mode or set its probability to 0, or leave "
    "out {option}"
)
REPLAY_MISMATCH = (
    "the model's forward drew other random numbers in piece {piece} of the batch than in "
    "the first ({why}); micro-batches and fragments replay the whole batch's draws, which "
    "needs the same random calls in every piece: make the forward's draws independent of "
    "the data, or leave out accumulate (fragments=)"
)
RECOMPUTED_DRAW = (
    "a random op ({op}) ran during the backward pass outside leangrad's checkpointing (the "
    "model's own torch.utils.checkpoint, or Hugging Face's gradient checkpointing?): "
    "accumulate cannot replay the whole batch's draws there; turn the model's own "
    "checkpointing off and use engine='checkpoint+accumulate', or leave out accumulate"
)


@dataclasses.dataclass(frozen=True)
class Drawn:
    """One random op of the forward: its name, and whether its draw follows the batch
    (``True``: dimension 0 is the batch) or is shared by every example."""

    op: str
    batch: bool


def layout(whole: Sequence[tuple[str, str, tuple[int, ...] | None]],
           piece: Sequence[tuple[str, str, tuple[int, ...] | None]], *,
           n_whole: int, n_piece: int, pieces: str = "micro-batches",
           option: str = "accumulate") -> tuple[tuple[Drawn, ...], str | None]:  # fmt: skip
    """Which of the draws ``(module, op, shape)`` of a forward of ``n_whole`` examples follow
    the batch, against a forward of ``n_piece`` examples: ``(draws, None)``, or ``((), why)``
    naming the first draw that ``pieces`` cannot replay (the fix: leave out ``option``)."""
    named = {"pieces": pieces, "option": option}
    if len(whole) != len(piece):
        where, op, _ = (whole or piece)[0]
        return (), CANNOT_REPLAY.format(where=where, op=op, **named, why=(
            f"{len(whole)} draws for {n_whole} examples, {len(piece)} for {n_piece}"))
    out = []
    for (where, op, a), (_, op_b, b) in zip(whole, piece, strict=True):
        if a is None or b is None or op != op_b:
            return (), CANNOT_REPLAY.format(where=where, op=op, **named, why=(
                "its draw depends on its input's values" if a is None or b is None
                else f"another op, {op_b}, on fewer examples"))  # fmt: skip
        if a == b:
            out.append(Drawn(op, batch=False))
        elif a[1:] == b[1:] and a[:1] == (n_whole,) and b[:1] == (n_piece,):
            out.append(Drawn(op, batch=True))
        else:
            return (), CANNOT_REPLAY.format(where=where, op=op, **named, why=(
                f"its shape {list(a)} for {n_whole} examples is not the batch's along "
                f"dimension 0 ({list(b)} for {n_piece})"))  # fmt: skip
    return tuple(out), None


_MASKS = frozenset({"bernoulli_.float", "bernoulli.p", "native_dropout.default"})
"""Draws of 0s and 1s (dropout's and stochastic depth's masks): kept as packed bits."""


@dataclasses.dataclass
class _Kept:
    """One draw of the whole batch, kept in pieces (``edges``; ``None``: shared by every
    example, one piece), each a tensor or, for a 0/1 mask, packed bits (1 bit per element
    where one forward would hold the mask in the activation's dtype)."""

    pieces: list[torch.Tensor | PackedBits | None]
    edges: tuple[int, ...] | None
    dtype: torch.dtype

    @classmethod
    def of(cls, full: torch.Tensor, edges: Sequence[int] | None, *, bits: bool) -> _Kept:
        cuts = [full] if edges is None else [full[a:b] for a, b in itertools.pairwise(edges)]
        pieces: list[torch.Tensor | PackedBits | None] = [
            pack_bits(c.bool()) if bits else c.clone() for c in cuts]  # fmt: skip
        return cls(pieces, None if edges is None else tuple(edges), full.dtype)

    def rows(self, a: int, b: int) -> torch.Tensor:
        """Rows ``a:b`` of the draw (all of it where it is shared)."""
        if self.edges is None:
            return self._piece(0)
        picked = [i for i in range(len(self.pieces))
                  if self.edges[i] < b and self.edges[i + 1] > a]  # fmt: skip
        parts = [self._piece(i) for i in picked]
        whole = parts[0] if len(parts) == 1 else torch.cat(parts)
        lo = self.edges[picked[0]]
        return whole[a - lo:b - lo]

    def _piece(self, i: int) -> torch.Tensor:
        kept = self.pieces[i]
        if kept is None:
            raise errors.EngineInputError(REPLAY_MISMATCH.format(piece=i, why=(
                "its rows of a draw were asked for after its turn")))  # fmt: skip
        if isinstance(kept, PackedBits):
            return unpack_bits(kept).to(self.dtype)
        return kept

    def release(self, i: int) -> None:
        """Lets piece ``i`` go (a shared draw stays: every piece uses it)."""
        if self.edges is not None:
            self.pieces[i] = None


def _full(t: torch.Tensor, n: int) -> torch.Tensor:
    """An empty tensor like ``t`` with ``n`` rows, laid out in memory as the whole batch's
    would be (``t``'s order of dimensions, the batch outermost)."""
    stride = t.stride()
    inner = sorted(range(1, t.dim()), key=lambda d: (-stride[d], d))
    if t.shape[0] > 1 and any(t.shape[d] > 1 and stride[0] < stride[d] * t.shape[d]
                              for d in inner):  # fmt: skip
        raise errors.EngineInputError(REPLAY_MISMATCH.format(piece=0, why=(
            "a draw on a tensor whose batch dimension is not outermost in memory")))  # fmt: skip
    perm = [0, *inner]
    shape = [n if d == 0 else t.shape[d] for d in perm]
    back = sorted(range(t.dim()), key=lambda d: perm[d]) if t.dim() else []
    return torch.empty(shape, dtype=t.dtype, device=t.device).permute(back)


class BatchDraws(TorchDispatchMode):
    """Replays a whole batch's random draws in its micro-batches (module docstring).

    ``draws`` from :func:`layout`; ``edges`` the micro-batches' first rows and the batch
    size (``[0, 4, 8]``); ``forward_only``: see the attribute. Enter it around each
    micro-batch's step with :meth:`piece` (or any rows with :meth:`span`: checkpoint's
    fragments); leangrad's checkpointing rewinds :attr:`cursor` for its recomputations
    (:mod:`._generators`).
    """

    def __init__(self, draws: Sequence[Drawn], *, edges: Sequence[int],
                 forward_only: bool = True) -> None:  # fmt: skip
        super().__init__()
        self.forward_only = forward_only
        """Whether a draw in the backward pass outside a recomputation it was told of is an
        error (accumulate: a recomputation it cannot rewind); fragments run their forward
        inside other recomputations too (two-level checkpointing), each with its own tape."""
        self.draws = tuple(draws)
        self.edges = tuple(edges)
        self.rows = (0, 0)
        self.label = ""
        self.cursor = 0
        self.recomputing = 0
        self.paused = 0
        """Above 0 while a probe runs beside the step (:func:`~._draws.aside`)."""
        self.tape: list[_Kept | None] = [None] * len(self.draws)

    @contextlib.contextmanager
    def piece(self, index: int) -> Iterator[None]:
        """Micro-batch ``index`` runs (forward and backward) inside; its rows of the draws
        are let go after it."""
        with self.span(self.edges[index], self.edges[index + 1], label=str(index)):
            yield
        for kept in self.tape:
            if kept is not None:
                kept.release(index)

    @contextlib.contextmanager
    def span(self, a: int, b: int, *, label: str = "", recompute: bool = False) -> Iterator[None]:
        """Rows ``a:b`` of the batch run inside; ``recompute``: a recomputation in the
        backward pass, handed what the forward drew."""
        self.rows, self.label, self.cursor = (a, b), label or f"{a}:{b}", 0
        self.recomputing += recompute
        REPLAYING.append(self)
        try:
            with self:
                yield
        finally:
            REPLAYING.remove(self)
            self.recomputing -= recompute
        if self.cursor != len(self.draws):
            raise errors.EngineInputError(REPLAY_MISMATCH.format(piece=self.label, why=(
                f"{self.cursor} random calls, {len(self.draws)} expected")))  # fmt: skip

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:  # fmt: skip
        kwargs = kwargs or {}
        if (self.paused or torch.Tag.nondeterministic_seeded not in func.tags
                or not may_draw(func, args, kwargs)):  # fmt: skip
            return func(*args, **kwargs)
        if (self.forward_only and not self.recomputing
                and torch._C._current_graph_task_id() != -1):  # fmt: skip
            raise errors.EngineInputError(RECOMPUTED_DRAW.format(op=op_name(func)))
        i = self.cursor
        self.cursor += 1
        if i >= len(self.draws) or self.draws[i].op != op_name(func):
            want = self.draws[i].op if i < len(self.draws) else "none"
            raise errors.EngineInputError(REPLAY_MISMATCH.format(piece=self.label, why=(
                f"call {i}: {op_name(func)}, expected {want}")))  # fmt: skip
        drawn = self.draws[i]
        a, b = self.rows
        shape = draw_shape(func, args, kwargs)
        if shape is None or (drawn.batch and shape[:1] != (b - a,)):
            raise errors.EngineInputError(REPLAY_MISMATCH.format(piece=self.label, why=(
                f"call {i}: {op_name(func)} of shape {shape}")))  # fmt: skip
        kept = self.tape[i]
        if kept is None:
            full = self._draw(func, args, kwargs, drawn)
            kept = self.tape[i] = _Kept.of(full, self.edges if drawn.batch else None,
                                           bits=op_name(func) in _MASKS)  # fmt: skip
        return self._rows(func, args, kept.rows(a, b))

    def _draw(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
              drawn: Drawn) -> Any:  # fmt: skip
        """What the whole batch draws at this op: its output (the mask for dropout)."""
        n = self.edges[-1]
        if op_name(func) in BY_FIRST:
            first = _full(args[0], n) if drawn.batch else torch.empty_like(args[0])
            if op_name(func) == "native_dropout.default":
                return func(first.zero_(), *args[1:], **kwargs)[1]
            return func(first, *args[1:], **kwargs)
        i = size_index(func)
        assert i is not None
        size = list(args[i] if i < len(args) else kwargs["size"])
        if drawn.batch:
            size[0] = n
        if i < len(args):
            return func(*args[:i], size, *args[i + 1:], **kwargs)
        return func(*args, **{**kwargs, "size": size})

    @staticmethod
    def _rows(func: Any, args: tuple[Any, ...], rows: torch.Tensor) -> Any:
        """The op's result for a piece handed ``rows`` of the whole batch's draw."""
        if op_name(func) == "native_dropout.default":
            p = float(args[1])
            scale = 0.0 if p >= 1 else 1.0 / (1.0 - p)
            out = torch.ops.aten.native_dropout_backward(args[0], rows, scale)
            return out, rows.clone()
        if func._schema.is_mutable:  # an in-place draw: fill the micro-batch's tensor
            return args[0].copy_(rows)
        return rows.clone()


def rng_states(devices: Sequence[int]) -> list[torch.Tensor]:
    """The global RNG states: the CPU's, then each CUDA device's in ``devices``."""
    return [torch.get_rng_state(), *(torch.cuda.get_rng_state(d) for d in devices)]


def set_rng_states(states: Sequence[torch.Tensor], devices: Sequence[int]) -> None:
    """Puts back what :func:`rng_states` read."""
    torch.set_rng_state(states[0])
    for d, st in zip(devices, states[1:], strict=True):
        torch.cuda.set_rng_state(st, d)
