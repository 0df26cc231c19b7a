"""``fad.elementwise(fn)``: any one-tensor function of FAD primitives as a one-saved-tensor op.

The function is run inside a ``TorchFunctionMode`` that carries each tensor's
element-wise derivative with respect to the input next to its value (paper
section II-D, ``J_f v`` with ``v = 1``), using the rules of
:mod:`leangrad.fad._primitives`. Anything that is not a FAD primitive, or that
mixes in a second source (section III-A, Fig. 3 node 3), raises with the
operator's name: this path has no fallback because the user asked for FAD.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary

from . import _errors as errors
from ._primitives import FLOAT_DTYPES, Dual, lookup, normalize, primitive_names

__all__ = ["Elementwise", "elementwise", "op_name"]


def op_name(func: Any) -> str:
    """A readable name for a torch callable."""
    name = getattr(func, "__name__", None) or repr(func)
    if name == "__get__":
        owner = getattr(getattr(func, "__self__", None), "__name__", None)
        return f"Tensor.{owner}" if owner else name
    return name


class _Tracer(TorchFunctionMode):
    """Strict forward-mode interpreter: every op touching the chain must be a primitive."""

    def __init__(self, x: Tensor) -> None:
        super().__init__()
        self.source = x
        # tensor -> derivative, weakly keyed: intermediates die when fn drops them
        self.derivs: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self.derivs[x] = 1.0

    def dual_of(self, t: Any) -> Dual | None:
        if not isinstance(t, Tensor) or t not in self.derivs:
            return None
        return Dual(t, self.derivs[t])

    def __torch_function__(
        self, func: Any, types: Any, args: Any = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        tracked = [t for t in tree_leaves((args, kwargs)) if self.dual_of(t) is not None]
        if not tracked:
            return func(*args, **kwargs)
        call = lookup(func)
        norm = normalize(call, args, kwargs) if call is not None else None
        if call is None or norm is None:
            out = func(*args, **kwargs)
            if not any(isinstance(t, Tensor) for t in tree_leaves(out)):
                return out  # metadata (shape, dtype, size()): not a computation
            raise errors.FadOpError(
                errors.NOT_ELEMENTWISE.format(op=op_name(func), known=primitive_names())
            )
        operands, params = norm
        name = call.prim.name
        shape = self.source.shape
        duals: list[Any] = []
        for o in operands:
            d = self.dual_of(o)
            if d is not None:
                duals.append(d)
                continue
            if isinstance(o, Tensor):
                if o.requires_grad:
                    why = "the other operand is a tensor that requires grad"
                    raise errors.FadOpError(errors.TWO_SOURCES.format(op=name, why=why))
                if torch.broadcast_shapes(o.shape, shape) != shape:
                    why = f"the other operand's shape {tuple(o.shape)} widens {tuple(shape)}"
                    raise errors.FadOpError(errors.TWO_SOURCES.format(op=name, why=why))
            duals.append(o)
        result = call.prim.rule(*duals, **params)
        if call.inplace:
            target = operands[-1] if call.reverse else operands[0]
            if self.dual_of(target) is None or target is self.source:
                raise errors.FadOpError(errors.INPLACE_INPUT.format(op=op_name(func)))
            target.copy_(result.value)
            result = Dual(target, result.deriv)
        self.derivs[result.value] = result.deriv
        return result.value


def _dual_run(fn: Callable[[Tensor], Any], x: Tensor) -> tuple[list[Tensor], list[Any]]:
    if x.dtype not in FLOAT_DTYPES:
        raise errors.FadDtypeError(
            errors.DTYPE_NO_RULE.format(op=getattr(fn, "__name__", fn), dtype=x.dtype)
        )
    tracer = _Tracer(x)
    with tracer:
        out = fn(x)
    outs = list(out) if isinstance(out, (tuple, list)) else [out]
    if not outs or not all(isinstance(o, Tensor) for o in outs):
        raise errors.FadOpError(errors.NOT_ONE_TENSOR.format(what=type(out).__name__))
    duals = [tracer.dual_of(o) for o in outs]
    if any(d is None for d in duals):
        raise errors.FadOpError(
            errors.NOT_ONE_TENSOR.format(what="a tensor that does not depend on it")
        )
    return [d.value for d in duals], [d.deriv for d in duals]  # type: ignore[union-attr]


class _ElementwiseFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, fn: Callable[[Tensor], Any], n_out: list[int]) -> Any:
        values, derivs = _dual_run(fn, x)
        n_out.append(len(values))
        ctx.consts = [None if isinstance(d, Tensor) else float(d) for d in derivs]
        ctx.save_for_backward(*[d for d in derivs if isinstance(d, Tensor)])
        return tuple(values)

    @staticmethod
    def backward(ctx: Any, *grads: Tensor | None) -> Any:
        saved = iter(ctx.saved_tensors)
        total: Tensor | None = None
        for g, const in zip(grads, ctx.consts, strict=True):
            d = next(saved) if const is None else const
            if g is not None:
                term = g * d
                total = term if total is None else total + term
        return total, None, None


class Elementwise(nn.Module):
    """A one-tensor element-wise function as a module that saves one tensor per output.

    Args:
        fn: ``fn(x) -> tensor`` (or a tuple of tensors) written with FAD primitives
            (:data:`~leangrad.fad.PRIMITIVES`): unary element-wise ops, binaries of two
            values computed from ``x``, and binaries with a constant (a number, or a
            tensor without ``requires_grad`` that broadcasts to ``x``'s shape).

    Forward runs ``fn`` in forward mode (value and derivative per op) and keeps
    only ``d out / d x``; backward is one multiply (paper section II-C, eq. 4).
    Raises :class:`~leangrad.fad.FadOpError` naming the first operator that is
    not element-wise or mixes in a second source, and
    :class:`~leangrad.fad.FadDtypeError` for non-floating inputs.
    """

    def __init__(self, fn: Callable[[Tensor], Any]) -> None:
        super().__init__()
        if not callable(fn):
            raise errors.FadOpError(errors.NOT_A_FUNCTION.format(type=type(fn).__name__))
        self.fn = fn

    def extra_repr(self) -> str:
        return getattr(self.fn, "__name__", repr(self.fn))

    def forward(self, x: Tensor) -> Any:
        if not isinstance(x, Tensor):
            raise errors.FadOpError(
                errors.NOT_A_TENSOR.format(fn=self.extra_repr(), type=type(x).__name__)
            )
        if not (torch.is_grad_enabled() and x.requires_grad):
            values, _ = _dual_run(self.fn, x)  # same checks and errors as with grad
            return values[0] if len(values) == 1 else tuple(values)
        n_out: list[int] = []
        outs = _ElementwiseFn.apply(x, self.fn, n_out)
        return outs[0] if n_out[0] == 1 else outs


def elementwise(fn: Callable[[Tensor], Any]) -> Elementwise:
    """Turn ``fn`` (one tensor in, built from FAD primitives) into an :class:`Elementwise`."""
    return Elementwise(fn)
