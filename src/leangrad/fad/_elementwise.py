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
from torch import Tensor, fx, nn
from torch.overrides import TorchFunctionMode, handle_torch_function, has_torch_function_unary
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary

from . import _errors as errors
from ._primitives import FLOAT_DTYPES, Dual, chain_deriv, lookup, normalize, primitive_names
from ._program import Program, run_fused
from ._trace import as_leaf

__all__ = ["Elementwise", "FusedRule", "elementwise", "fused_rule", "op_name", "run_elementwise"]


def op_name(func: Any) -> str:
    """A readable name for a torch callable."""
    name = getattr(func, "__name__", None) or repr(func)
    if name == "__get__":
        owner = getattr(getattr(func, "__self__", None), "__name__", None)
        return f"Tensor.{owner}" if owner else name
    return name


class _Tracer(TorchFunctionMode):
    """Strict forward-mode interpreter: every op touching the chain must be a primitive.

    With ``values_only`` (no gradient to record) it makes the same checks but runs each
    operator as called, computing no derivative: cheaper, and it stays composable with
    ``torch.func`` transforms (``jvp``, ``vmap``), which the rules' fused backward kernels
    (``out=`` variants) are not.
    """

    def __init__(self, x: Tensor, *, values_only: bool = False) -> None:
        super().__init__()
        self.source = x
        self.values_only = values_only
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
        fused = fused_rule(func, args, kwargs)
        if fused is not None and (d := self.dual_of(args[0])) is not None:
            # one of fad's own layers, on a chain value: an element-wise op of its own
            if self.values_only:
                return self._track(func(*args, **kwargs))
            values, derivs = fused[1](d.value)
            for v, dv in zip(values, derivs, strict=True):
                self.derivs[v] = chain_deriv(dv, d.deriv)
            return tuple(values)
        call = lookup(func)
        norm = normalize(call, args, kwargs) if call is not None else None
        if call is None or norm is None:
            out = func(*args, **kwargs)
            if not any(isinstance(t, Tensor) for t in tree_leaves(out)):
                return out  # metadata (shape, dtype, size()): not a computation
            if call is not None:  # a primitive, called with arguments its rule does not take
                raise errors.FadOpError(errors.UNSUPPORTED_ARGS.format(
                    op=op_name(func), args=_show_args(args, kwargs),
                    params=", ".join(k for k, _ in call.prim.params) or "(none)"))  # fmt: skip
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
        target = (operands[-1] if call.reverse else operands[0]) if call.inplace else None
        if call.inplace and (self.dual_of(target) is None or target is self.source):
            where = "the function's input" if target is self.source else (
                "a tensor outside the chain (a constant operand)")  # fmt: skip
            raise errors.FadOpError(errors.INPLACE_INPUT.format(op=op_name(func), target=where))
        if self.values_only:
            return self._track(func(*args, **kwargs))
        result = call.prim.rule(*duals, **params)
        if target is not None:
            target.copy_(result.value)
            result = Dual(target, result.deriv)
        self.derivs[result.value] = result.deriv
        return result.value

    def _track(self, out: Any) -> Any:
        """Values-only mode: mark the op's results as chain values (no derivative)."""
        for t in tree_leaves(out):
            if isinstance(t, Tensor):
                self.derivs[t] = 0.0
        return out


def _show_args(args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    """The arguments of a call, tensors by shape, for a message."""

    def show(a: Any) -> str:
        return f"tensor{tuple(a.shape)}" if isinstance(a, Tensor) else repr(a)

    return ", ".join([*map(show, args), *(f"{k}={show(v)}" for k, v in kwargs.items())])


def _returned(out: Any) -> str:
    """What a function returned, for :data:`~leangrad.fad._errors.NOT_ONE_TENSOR`."""
    if isinstance(out, (tuple, list)):
        if not out:
            return f"an empty {type(out).__name__}"
        kinds = sorted({type(o).__name__ for o in out if not isinstance(o, Tensor)})
        return f"a {type(out).__name__} holding {', '.join(kinds)}"
    return type(out).__name__


FusedRule = tuple[str, Callable[[Tensor], tuple[list[Tensor], list[Tensor | float]]]]
"""A fad layer's name (for messages and traces) and forward rule ``x -> (values, d/dx)``."""


def fused_rule(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any] | None = None
               ) -> FusedRule | None:  # fmt: skip
    """The name and forward rule of a call of one of fad's own layers
    (:func:`~leangrad.fad._program.run_fused`, :func:`run_elementwise`), else ``None``.

    Values that are ``x`` itself (an identity chain) come back as copies, so each value is a
    fresh tensor, as the primitives' are."""
    if func is not run_fused and func is not run_elementwise:
        return None
    if kwargs or len(args) != 2 or not isinstance(args[0], Tensor):
        return None
    what = args[1]
    if func is run_fused and isinstance(what, Program):
        run: Callable[[Tensor], tuple[list[Tensor], list[Any]]] = what.run_dual
        name = what.name
    elif func is run_elementwise and callable(what):
        run = lambda x: _dual_run(what, x)  # noqa: E731
        name = f"elementwise({getattr(what, '__name__', type(what).__name__)})"
    else:
        return None

    def rule(x: Tensor) -> tuple[list[Tensor], list[Tensor | float]]:
        with torch.no_grad():
            values, derivs = run(x)
        return [v.clone() if v is x else v for v in values], derivs

    return name, rule


def _dual_run(fn: Callable[[Tensor], Any], x: Tensor, *, values_only: bool = False
              ) -> tuple[list[Tensor], list[Any]]:  # fmt: skip
    """``fn``'s values and their derivatives with respect to ``x`` (derivatives ``0.0``,
    not computed, with ``values_only``), after checking that ``fn`` is element-wise."""
    if x.dtype not in FLOAT_DTYPES:
        raise errors.FadDtypeError(
            errors.DTYPE_NO_RULE.format(op=getattr(fn, "__name__", fn), dtype=x.dtype)
        )
    tracer = _Tracer(x, values_only=values_only)
    with tracer:
        out = fn(x)
    outs = list(out) if isinstance(out, (tuple, list)) else [out]
    if not outs or not all(isinstance(o, Tensor) for o in outs):
        raise errors.FadOpError(errors.NOT_ONE_TENSOR.format(what=_returned(out)))
    duals = [tracer.dual_of(o) for o in outs]
    if any(d is None for d in duals):
        raise errors.FadOpError(
            errors.NOT_ONE_TENSOR.format(what="a tensor that does not depend on it")
        )
    return [d.value for d in duals], [d.deriv for d in duals]  # type: ignore[union-attr]


class _ElementwiseFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, fn: Callable[[Tensor], Any]) -> Any:
        values, derivs = _dual_run(fn, x)
        values = [v.clone() if v is x else v for v in values]  # the input returned as is
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
        return total, None


def run_elementwise(x: Tensor, fn: Callable[[Tensor], Any]) -> tuple[Tensor, ...]:
    """Run ``fn`` on ``x`` in forward mode; one autograd node saving ``d out / d x``.

    Like :func:`~leangrad.fad._program.run_fused`, the call goes through
    ``__torch_function__``, so ``fad.nested()`` continues its chain through it.
    """
    if has_torch_function_unary(x):
        return handle_torch_function(run_elementwise, (x,), x, fn)
    if not (torch.is_grad_enabled() and x.requires_grad):
        values, _ = _dual_run(fn, x, values_only=True)  # same checks and errors as with grad
        return tuple(values)
    return tuple(_ElementwiseFn.apply(x, fn))


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
        if isinstance(x, fx.Proxy):  # traced: one call_module node (see leangrad.fad._trace)
            return as_leaf(self, x, outputs=None, inline=self.fn)
        if not isinstance(x, Tensor):
            layer = f"fad.elementwise({self.extra_repr()})"
            raise errors.FadOpError(errors.NOT_A_TENSOR.format(layer=layer, type=type(x).__name__))
        outs = run_elementwise(x, self.fn)
        return outs[0] if len(outs) == 1 else outs


def elementwise(fn: Callable[[Tensor], Any]) -> Elementwise:
    """Turn ``fn`` (one tensor in, built from FAD primitives) into an :class:`Elementwise`."""
    return Elementwise(fn)
