"""Dropout masks drawn as autograd draws them, replayed under ``torch.func`` transforms.

Under ``vmap`` (and ``jvp``) PyTorch draws a dropout mask in the memory layout of the
transformed tensor, which is not the layout of the activation autograd sees: on a
channels-last activation autograd fills its mask in channels-last order, the vmapped
forward in contiguous order, so the same random numbers land on other elements and the
forward-mode engines computed the gradient of another network (fuzz finding F1).

:class:`DropoutTape` fixes it at the draw: one real forward of the model (the one the
engines already run to find the used parameters) records each dropout call's mask, drawn
by PyTorch's own function on a tensor of the activation's shape and strides from the
step's RNG state; every transformed run then multiplies by the recorded mask instead of
drawing, and leaves the RNG stream where autograd's draw leaves it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F

from .. import _errors as errors
from ..layers._bits import PackedBits, pack_bits, unpack_bits
from ._functional import CallMode
from ._loss_fn import ModelRun

__all__ = ["DropoutTape", "replayed"]

TAPE_MISMATCH = (
    "engine {engine!r}: the model's forward made other dropout calls than on its first run "
    "(call {index}: {got}, first run: {want}); the forward-mode engines replay autograd's "
    "dropout masks, which needs the same calls on every run: make the forward's control "
    "flow independent of the data, or use an engine that runs the forward once (backprop)"
)

_SCALED = (F.dropout, F.dropout1d, F.dropout2d, F.dropout3d, torch.dropout,
           torch.feature_dropout)  # fmt: skip
"""Functions whose result is ``input * mask / (1 - p)``, mask in {0, 1}."""
_ALPHA = (F.alpha_dropout, F.feature_alpha_dropout, torch.alpha_dropout,
          torch.feature_alpha_dropout)  # fmt: skip
"""Functions whose result is ``input * a + b`` (a, b drawn)."""
_INPLACE = {torch.dropout_: torch.dropout, torch.feature_dropout_: torch.feature_dropout,
            torch.alpha_dropout_: torch.alpha_dropout,
            torch.feature_alpha_dropout_: torch.feature_alpha_dropout}  # fmt: skip
_DRAWS: frozenset[Callable[..., Any]] = frozenset((*_SCALED, *_ALPHA, *_INPLACE))


def _call_args(func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``(input, p, training, inplace)`` of a dropout call, defaults applied."""
    base = _INPLACE.get(func, func)
    if base in (torch.dropout, torch.feature_dropout, torch.alpha_dropout,
                torch.feature_alpha_dropout):  # fmt: skip
        a = {**dict(zip(("input", "p", "train"), args, strict=False)), **kwargs}
        return a["input"], float(a["p"]), bool(a["train"]), func in _INPLACE
    bound = inspect.signature(func).bind(*args, **kwargs)
    bound.apply_defaults()
    a = bound.arguments
    return a["input"], float(a["p"]), bool(a["training"]), bool(a["inplace"])


def _rng_state(device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), cuda


def _set_rng_state(state: tuple[torch.Tensor, torch.Tensor | None], device: torch.device) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1], device)


@dataclasses.dataclass
class _Draw:
    """One recorded dropout call: the logical shape, the mask (packed bits and scale for
    plain and feature dropout, with ``p``; the affine ``a``, ``b`` for alpha dropout) and the RNG
    state right after autograd's draw."""

    name: str
    shape: tuple[int, ...]
    bits: PackedBits | None
    p: float
    a: torch.Tensor | None
    b: torch.Tensor | None
    after: tuple[torch.Tensor, torch.Tensor | None]

    def apply(self, x: torch.Tensor, inplace: bool) -> torch.Tensor:
        if self.bits is not None:
            m = unpack_bits(self.bits).to(x.dtype)
            if self.p < 1:  # p = 1: all zeros (PyTorch multiplies by zero, no division)
                m = m.div_(1.0 - self.p)
            return x.mul_(m) if inplace else x * m
        assert self.a is not None and self.b is not None
        return x.mul_(self.a).add_(self.b) if inplace else x * self.a + self.b


class _Mode(CallMode):
    leangrad_plain_ops = True  # lean layers (bits.BitDropout) call F.dropout: it is recorded

    def __init__(self, tape: DropoutTape, *, record: bool) -> None:
        super().__init__()
        self.tape, self.record, self.index = tape, record, 0

    def call(self, func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if func not in _DRAWS:
            return func(*args, **kwargs)
        x, p, training, inplace = _call_args(func, args, kwargs)
        if not training or not isinstance(x, torch.Tensor):
            return func(*args, **kwargs)  # eval mode: the identity, nothing drawn
        if self.record:
            draw = self._draw(func, x, p)
            self.tape.draws.append(draw)
            return draw.apply(x, inplace)
        return self._replay(func, x, inplace)

    def _draw(self, func: Callable[..., Any], x: torch.Tensor, p: float) -> _Draw:
        """PyTorch's own draw, on a tensor with the activation's shape, strides, dtype and
        device (``ones_like`` keeps the layout as autograd's mask allocation does)."""
        base = _INPLACE.get(func, func)
        with torch.no_grad():
            if base in _SCALED:
                m = base(torch.ones_like(x), p, True)
                bits, a, b = pack_bits(m != 0), None, None
            else:
                before = _rng_state(x.device)
                b = base(torch.zeros_like(x), p, True)
                _set_rng_state(before, x.device)
                a, bits = base(torch.ones_like(x), p, True) - b, None
        name = getattr(base, "__name__", str(base))
        return _Draw(name, tuple(x.shape), bits, p, a, b, _rng_state(x.device))

    def _replay(self, func: Callable[..., Any], x: torch.Tensor, inplace: bool) -> torch.Tensor:
        base = _INPLACE.get(func, func)
        name = getattr(base, "__name__", str(base))
        got = f"{name} on shape {tuple(x.shape)}"
        draws = self.tape.draws
        key = (name, tuple(x.shape))
        if self.index >= len(draws) or (draws[self.index].name, draws[self.index].shape) != key:
            want = "none" if self.index >= len(draws) else (
                f"{draws[self.index].name} on shape {draws[self.index].shape}"
            )  # fmt: skip
            raise errors.EngineInputError(TAPE_MISMATCH.format(
                engine=self.tape.engine, index=self.index, got=got, want=want))  # fmt: skip
        draw = draws[self.index]
        self.index += 1
        out = draw.apply(x, inplace)
        _set_rng_state(draw.after, x.device)  # the stream moves on as autograd's draw moved it
        return out


class DropoutTape:
    """Records the dropout masks of one real forward; replays them in transformed runs.

    ``recording(run)`` wraps a ``run(fn, xs)`` callable (as the engines pass to
    ``used_parameters``) so that the forward it runs records; ``replaying()`` is a
    context manager for each transformed run of the model.
    """

    def __init__(self, engine: str) -> None:
        self.engine = engine
        self.draws: list[_Draw] = []

    def recording(self, run: ModelRun) -> ModelRun:
        def recorded(fn: Callable[..., Any], xs: tuple[torch.Tensor, ...]) -> Any:
            self.draws.clear()
            with _Mode(self, record=True):
                return run(fn, xs)

        return recorded

    @contextlib.contextmanager
    def replaying(self) -> Iterator[None]:
        if not self.draws:  # nothing drawn on the real forward: no per-op dispatch cost
            yield
            return
        with _Mode(self, record=False):
            yield


def replayed(
    tape: DropoutTape,
    f: Callable[[dict[str, torch.Tensor], dict[str, torch.Tensor]], torch.Tensor],
) -> Callable[[dict[str, torch.Tensor], dict[str, torch.Tensor]], torch.Tensor]:
    """``f`` (a :func:`~._functional.pure_loss`) run with ``tape``'s masks replayed."""

    def g(values: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor]) -> torch.Tensor:
        with tape.replaying():
            return f(values, buffers)

    return g
