"""FAD-compatible primitives and their forward-mode derivative rules.

Paper (nested forward-AD of activations), section III-A: an operator is *fad*
when it is element-wise with one input (``R^1 -> R^1``): a unary operator, a
binary operator with one constant operand, or a binary operator whose two
operands come from the same source. Framework "symbolic" operators (sigmoid,
tanh, softplus, erf) count as primitives. Everything else is *nfad*.

A value in a chain is a :class:`Dual`: the value and its element-wise
derivative with respect to the chain's source (section II-D,
``J_f v`` with ``v = 1``). The source is ``Dual(x, 1.0)`` (the paper's
``FTR = 1``). Each rule computes the output value and, next to it, the output
derivative (eq. 3: ``v3' = v1 * v2' + v1' * v2`` for a product).

Derivatives follow the formulas of PyTorch's own backward formulas
(``tools/autograd/derivatives.yaml``) so float64 gradients agree with autograd
to rounding.
"""

from __future__ import annotations

import dataclasses
import math
import operator
from collections.abc import Callable
from typing import Any, TypeGuard

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = [
    "DONATE",
    "FLOAT_DTYPES",
    "PRIMITIVES",
    "Call",
    "Dual",
    "Primitive",
    "chain_deriv",
    "is_const",
    "lookup",
    "lookup_method",
    "normalize",
    "primitive_names",
]

FLOAT_DTYPES = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64})
"""Dtypes that have forward-mode rules."""

Deriv = Tensor | float
Operand = Any  # Dual, or a constant: Python number or a tensor outside the chain


@dataclasses.dataclass(slots=True)
class Dual:
    """A chain value and its element-wise derivative ``d value / d source``.

    ``deriv`` is a float when it is the same for every element (``1.0`` at the
    source, ``2.0`` after ``2 * x``), so no tensor is stored for it.
    """

    value: Tensor
    deriv: Deriv


def _scale(factor: Tensor | float, d: Deriv) -> Deriv:
    """``factor * d``, without a multiply when ``d`` is exactly 1 (the source)."""
    if isinstance(d, float) and d == 1.0:
        return factor
    return factor * d


def chain_deriv(outer: Deriv, inner: Deriv) -> Deriv:
    """``outer * inner`` (the chain rule, element-wise), skipping a multiply by exactly 1."""
    if isinstance(outer, float) and outer == 1.0:
        return inner
    return _scale(outer, inner)


_aten = torch.ops.aten

DONATE: set[int] = set()
"""Ids of tensors the running step may overwrite: chain temporaries whose last use is this
step and that nothing else references. Filled by ``Program.run_dual`` only (the eager mode
cannot know lifetimes), so rules write in place into them instead of allocating (the
paper's "reuse the tensor immediately", section III-B)."""


def _own(t: Any, *like: Any) -> TypeGuard[Tensor]:
    """May the rule write into ``t``, with the shape and dtype of the tensors ``like``?"""
    return isinstance(t, Tensor) and id(t) in DONATE and _same(t, *like)


def _same(t: Tensor, *like: Any) -> bool:
    return all(o.shape == t.shape and o.dtype == t.dtype for o in like if isinstance(o, Tensor))


def _take(t: Tensor) -> Tensor:
    DONATE.discard(id(t))
    return t


def _fused_backward(kernel: Any, d: Deriv, *args: Any) -> Deriv:
    """``d * f'(x)`` with PyTorch's own backward kernel, which multiplies by ``d`` in the
    same pass (one kernel instead of two or three, and autograd's exact formula)."""
    out = args[0]
    if isinstance(d, Tensor) and d.shape == out.shape:
        if _own(d, out):
            return kernel.grad_input(d, *args, grad_input=_take(d))
        return kernel(d, *args)
    # a contiguous ones buffer, overwritten in place: the kernels' broadcast (stride-0)
    # path is several times slower than the vectorised contiguous one
    one = torch.ones_like(out, memory_format=torch.contiguous_format)
    return _scale(kernel.grad_input(one, *args, grad_input=one), d)


def _v(a: Operand) -> Any:
    return a.value if isinstance(a, Dual) else a


def _sum(*terms: Deriv | None) -> Deriv:
    out: Deriv | None = None
    for t in terms:
        if t is not None:
            out = t if out is None else out + t
    assert out is not None, "a rule needs at least one chain operand"
    return out


# -- unary rules: value and derivative factor next to each other ------------------------
def _neg(a: Dual) -> Dual:
    return Dual(-a.value, -a.deriv)


def _exp(a: Dual) -> Dual:
    v = torch.exp(a.value)
    return Dual(v, _scale(v, a.deriv))


def _expm1(a: Dual) -> Dual:
    v = torch.expm1(a.value)
    return Dual(v, _scale(v + 1, a.deriv))


def _log(a: Dual) -> Dual:
    return Dual(torch.log(a.value), a.deriv / a.value)


def _log1p(a: Dual) -> Dual:
    return Dual(torch.log1p(a.value), a.deriv / (a.value + 1))


def _sqrt(a: Dual) -> Dual:
    v = torch.sqrt(a.value)
    return Dual(v, a.deriv / (2 * v))


def _rsqrt(a: Dual) -> Dual:
    v = torch.rsqrt(a.value)
    return Dual(v, _scale(-0.5 * v.pow(3), a.deriv))


def _reciprocal(a: Dual) -> Dual:
    v = torch.reciprocal(a.value)
    return Dual(v, _scale(-(v * v), a.deriv))


def _sigmoid(a: Dual) -> Dual:
    x = a.value
    v = _take(x).sigmoid_() if _own(x) else torch.sigmoid(x)
    return Dual(v, _fused_backward(_aten.sigmoid_backward, a.deriv, v))  # d * (1 - v) * v


def _tanh(a: Dual) -> Dual:
    x = a.value
    v = _take(x).tanh_() if _own(x) else torch.tanh(x)
    return Dual(v, _fused_backward(_aten.tanh_backward, a.deriv, v))  # d * (1 - v^2)


def _softplus(a: Dual, beta: float = 1.0, threshold: float = 20.0) -> Dual:
    x = a.value
    # d * sigmoid(beta x), or d where beta x > threshold; before x may be overwritten
    d = _fused_backward(_aten.softplus_backward, a.deriv, x, beta, threshold)
    if _own(x):
        return Dual(torch._C._nn.softplus(x, beta, threshold, out=_take(x)), d)  # type: ignore[call-arg]
    return Dual(F.softplus(x, beta, threshold), d)


_TWO_OVER_SQRT_PI = 2.0 / math.sqrt(math.pi)


def _erf(a: Dual) -> Dual:
    factor = _TWO_OVER_SQRT_PI * torch.exp(-a.value.pow(2))
    return Dual(torch.erf(a.value), _scale(factor, a.deriv))


def _sin(a: Dual) -> Dual:
    return Dual(torch.sin(a.value), _scale(torch.cos(a.value), a.deriv))


def _cos(a: Dual) -> Dual:
    return Dual(torch.cos(a.value), _scale(-torch.sin(a.value), a.deriv))


def _relu(a: Dual) -> Dual:
    v = torch.relu(a.value)
    return Dual(v, _scale((v > 0).to(v.dtype), a.deriv))


def _abs(a: Dual) -> Dual:
    return Dual(torch.abs(a.value), _scale(torch.sgn(a.value), a.deriv))


def _square(a: Dual) -> Dual:
    return Dual(a.value * a.value, _scale(2 * a.value, a.deriv))


def _clone(a: Dual) -> Dual:
    return Dual(a.value.clone(), a.deriv)


# -- binary rules: either operand may be a constant ----------------------------------------
def _add(a: Operand, b: Operand, alpha: float = 1) -> Dual:
    av, bv = _v(a), _v(b)
    if isinstance(av, Tensor) and _own(av, bv):
        v = _take(av).add_(bv, alpha=alpha)
    elif alpha == 1 and _own(bv, av):
        v = _take(bv).add_(av)
    elif isinstance(av, Tensor):
        v = torch.add(av, bv, alpha=alpha)
    else:
        v = av + (bv if alpha == 1 else alpha * bv)
    da = a.deriv if isinstance(a, Dual) else None
    db = (b.deriv if alpha == 1 else alpha * b.deriv) if isinstance(b, Dual) else None
    if da is not None and db is not None:
        if _own(da, db):
            return Dual(v, _take(da).add_(db))
        if _own(db, da):
            return Dual(v, _take(db).add_(da))
    return Dual(v, _sum(da, db))


def _sub(a: Operand, b: Operand, alpha: float = 1) -> Dual:
    av, bv = _v(a), _v(b)
    if isinstance(av, Tensor):
        v = torch.sub(av, bv, alpha=alpha)
    else:
        v = av - (bv if alpha == 1 else alpha * bv)
    da = a.deriv if isinstance(a, Dual) else None
    db = (-b.deriv if alpha == 1 else -alpha * b.deriv) if isinstance(b, Dual) else None
    return Dual(v, _sum(da, db))


def _mul(a: Operand, b: Operand) -> Dual:
    av, bv = _v(a), _v(b)
    # derivative first: the value may then overwrite an operand that is not needed any more
    d: Deriv
    if not isinstance(b, Dual):  # chain * constant
        d = _take(a.deriv).mul_(bv) if _own(a.deriv, bv, av) else _scale(bv, a.deriv)
    elif not isinstance(a, Dual):  # constant * chain
        d = _take(b.deriv).mul_(av) if _own(b.deriv, av, bv) else _scale(av, b.deriv)
    elif isinstance(a.deriv, float) and _own(b.deriv, av, bv):
        d = _take(b.deriv).mul_(av).add_(bv, alpha=a.deriv)  # c * b + a * db, in place
    elif isinstance(b.deriv, float) and _own(a.deriv, av, bv):
        d = _take(a.deriv).mul_(bv).add_(av, alpha=b.deriv)  # da * b + c * a, in place
    else:
        da, db = _scale(bv, a.deriv), b.deriv
        if not (isinstance(da, Tensor) and isinstance(av, Tensor) and isinstance(db, Tensor)):
            d = _sum(da, _scale(av, db))
        elif _own(db, av, da):
            d = _take(db).mul_(av).add_(da)  # da + a * db, in place
        elif da is not bv and da is not a.deriv and _same(da, av, db):
            d = da.addcmul_(av, db)  # da is a product made just above: ours
        else:
            d = torch.addcmul(da, av, db)  # da + a * db in one kernel
    if _own(av, bv) and av is not d:
        return Dual(_take(av).mul_(bv), d)
    if _own(bv, av) and bv is not d:
        return Dual(_take(bv).mul_(av), d)
    return Dual(av * bv, d)


def _div(a: Operand, b: Operand) -> Dual:
    av, bv = _v(a), _v(b)
    v = av / bv
    da = a.deriv / bv if isinstance(a, Dual) else None
    db = _scale(-(v / bv), b.deriv) if isinstance(b, Dual) else None
    return Dual(v, _sum(da, db))


def _pow(a: Operand, b: Operand) -> Dual:
    av, bv = _v(a), _v(b)
    v = av**bv
    da: Deriv | None = None
    db: Deriv | None = None
    if isinstance(a, Dual):
        if isinstance(bv, (int, float)) and bv == 0:
            da = 0.0
        else:
            da = _scale(torch.pow(av, bv - 1).mul_(bv), a.deriv)
    if isinstance(b, Dual):
        base = av if isinstance(av, Tensor) else torch.as_tensor(av, dtype=v.dtype, device=v.device)
        factor = torch.where((base == 0) & (bv >= 0), 0.0, v * torch.log(base))
        db = _scale(factor, b.deriv)
    return Dual(v, _sum(da, db))


@dataclasses.dataclass(frozen=True)
class Primitive:
    """One FAD-compatible operator.

    Attributes:
        name: canonical name (the ``torch`` function's name).
        arity: 1 (unary) or 2 (binary: same-source or with one constant operand).
        params: extra keyword parameters and their defaults (e.g. softplus's ``beta``).
        plain: the autograd operator itself (value only), used for fallbacks.
        rule: ``rule(*operands, **params) -> Dual`` (value and derivative together).
    """

    name: str
    arity: int
    params: tuple[tuple[str, Any], ...]
    plain: Callable[..., Any]
    rule: Callable[..., Dual]


def _p(name: str, arity: int, plain: Callable[..., Any], rule: Callable[..., Dual],
       **params: Any) -> Primitive:  # fmt: skip
    return Primitive(name, arity, tuple(params.items()), plain, rule)


def _torch_p(rule: Callable[..., Dual], arity: int, **params: Any) -> Primitive:
    """The primitive of ``torch.<name>`` whose rule is the function ``_<name>``."""
    name = rule.__name__.removeprefix("_")
    return _p(name, arity, getattr(torch, name), rule, **params)


PRIMITIVES: dict[str, Primitive] = {
    p.name: p
    for p in (
        *(_torch_p(rule, 1) for rule in (_neg, _exp, _expm1, _log, _log1p, _sqrt, _rsqrt,
                                         _reciprocal, _sigmoid, _tanh)),
        _p("softplus", 1, F.softplus, _softplus, beta=1.0, threshold=20.0),
        *(_torch_p(rule, 1) for rule in (_erf, _sin, _cos, _relu, _abs, _square, _clone)),
        _torch_p(_add, 2, alpha=1),
        _torch_p(_sub, 2, alpha=1),
        *(_torch_p(rule, 2) for rule in (_mul, _div, _pow)),
    )
}  # fmt: skip
"""Canonical name -> primitive: the op table of paper section III-A."""


def primitive_names() -> str:
    """The table's names, comma separated (for error messages)."""
    return ", ".join(sorted(PRIMITIVES))


@dataclasses.dataclass(frozen=True)
class Call:
    """How one Python callable maps onto a primitive.

    Attributes:
        prim: the primitive.
        inplace: writes its result into the first operand (``mul_``, ``*=``).
        reverse: operands come swapped (``__rsub__(self, other) = other - self``).
    """

    prim: Primitive
    inplace: bool = False
    reverse: bool = False


_ALIASES: dict[str, tuple[str, ...]] = {
    "neg": ("negative",),
    "sigmoid": (),
    "div": ("divide", "true_divide"),
    "sub": ("subtract",),
    "mul": ("multiply",),
}
_DUNDER = {"add": "add", "sub": "sub", "mul": "mul", "div": "truediv", "pow": "pow"}
_UNARY_OPERATORS = ("neg", "abs")
"""Primitives with an ``operator`` function of their name (binary ones: of their dunder's)."""
_EXTRA_FUNCS: tuple[tuple[Callable[..., Any], str], ...] = (
    (F.sigmoid, "sigmoid"),
    (torch.special.expit, "sigmoid"),
    (F.tanh, "tanh"),
    (F.softplus, "softplus"),
    (torch.special.erf, "erf"),
    (torch.special.expm1, "expm1"),
    (torch.special.log1p, "log1p"),
    (F.relu, "relu"),
)
"""Other callables of a primitive (``torch.nn.functional``'s and ``torch.special``'s)."""


def _build_table() -> tuple[dict[Any, Call], dict[str, Call]]:
    funcs: dict[Any, Call] = {}
    methods: dict[str, Call] = {}
    bases = (torch.Tensor, torch._C.TensorBase)

    def add(obj: Any, call: Call) -> None:
        if obj is not None:
            funcs.setdefault(obj, call)

    def register(calls: dict[str, Call], owners: tuple[Any, ...]) -> None:
        """Each name of ``calls`` as a tensor method, and each owner's attribute of that
        name (owners in order, then names in order: the first registration of an object
        wins)."""
        methods.update(calls)
        for owner in owners:
            for attr, call in calls.items():
                add(getattr(owner, attr, None), call)

    for name, prim in PRIMITIVES.items():
        for n in (name, *_ALIASES.get(name, ())):
            register({n: Call(prim), n + "_": Call(prim, inplace=True)}, (torch, *bases))
        if name in _DUNDER:
            d = _DUNDER[name]
            dunders = {
                f"__{d}__": Call(prim),
                f"__r{d}__": Call(prim, reverse=True),
                f"__i{d}__": Call(prim, inplace=True),
            }
            register(dunders, bases)
            add(getattr(operator, d), Call(prim))
            add(getattr(operator, f"i{d}"), Call(prim, inplace=True))
        elif name in _UNARY_OPERATORS:
            add(getattr(operator, name), Call(prim))
    for fn, name in _EXTRA_FUNCS:
        add(fn, Call(PRIMITIVES[name]))
    add(torch.rsub, Call(PRIMITIVES["sub"], reverse=True))
    return funcs, methods


_FUNCS, _METHODS = _build_table()


def lookup(func: Any) -> Call | None:
    """The primitive behind a Python callable (``torch.sigmoid``, ``Tensor.__mul__``, ...)."""
    try:
        return _FUNCS.get(func)
    except TypeError:  # unhashable callables are never primitives
        return None


def lookup_method(name: str) -> Call | None:
    """The primitive behind a tensor method name (torch.fx ``call_method`` targets)."""
    return _METHODS.get(name)


def is_const(x: Any) -> bool:
    """Python numbers (not bool) are constants; tensors are judged by the caller."""
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def normalize(call: Call, args: tuple[Any, ...], kwargs: dict[str, Any]
              ) -> tuple[tuple[Any, ...], dict[str, Any]] | None:  # fmt: skip
    """Operands (in the primitive's order) and parameters of one call, or ``None`` when the
    call uses an argument the rule does not know (``out=``, ``rounding_mode=``, ...)."""
    prim = call.prim
    if len(args) < prim.arity:
        names = ("input", "other")[: prim.arity]
        if any(n not in kwargs for n in names[len(args) :]):
            return None
        kwargs = dict(kwargs)
        args = (*args, *(kwargs.pop(n) for n in names[len(args) :]))
    operands, extra = args[: prim.arity], args[prim.arity :]
    defaults = dict(prim.params)
    if len(extra) > len(defaults):
        return None
    params = dict(zip(defaults, extra, strict=False))
    for k, v in kwargs.items():
        if k == "inplace" and prim.name == "relu":
            if v:
                return None
            continue
        if k not in defaults or k in params:
            return None
        params[k] = v
    if any(isinstance(v, Tensor) for v in params.values()):
        return None
    if call.reverse:
        operands = operands[::-1]
    return operands, params
