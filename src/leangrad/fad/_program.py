"""A straight-line element-wise chain and the one autograd function that runs it.

Paper section II-E: for primitives ``v_n .. v_m`` composing an element-wise
``R^1 -> R^M`` operation, ``dL/dv_n = (dv_{m+1}/dv_n) * g``. :class:`Program`
holds such a chain (a list of primitive steps over numbered slots, slot 0 the
source); :class:`FusedChain` runs it as one ``torch.autograd.Function`` whose
forward propagates value and derivative together and saves only the
derivative of each output (one tensor per output, none when the derivative is
a constant), and whose backward is ``sum_i grad_i * d_i``: no recomputation,
no intermediate kept.
"""

from __future__ import annotations

import collections
import dataclasses
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor, fx, nn
from torch.overrides import handle_torch_function, has_torch_function_unary

from . import _errors as errors
from ._primitives import DONATE, FLOAT_DTYPES, PRIMITIVES, Dual, Primitive, primitive_names
from ._trace import as_leaf

__all__ = ["Builder", "FusedChain", "Program", "Ref", "Step", "run_fused"]


@dataclasses.dataclass(frozen=True)
class Ref:
    """An operand read from slot ``index`` (0 is the chain's source)."""

    index: int


@dataclasses.dataclass(frozen=True)
class Step:
    """One primitive applied to slots and constants; writes the next slot."""

    prim: Primitive
    operands: tuple[Ref | float | int, ...]
    params: tuple[tuple[str, Any], ...] = ()


@dataclasses.dataclass(frozen=True)
class Program:
    """An element-wise chain with one source and ``len(outputs)`` outputs.

    Attributes:
        name: shown in messages (e.g. ``"swish"``).
        steps: in execution order; step ``i`` writes slot ``i + 1``.
        outputs: slots returned, in order.
    """

    name: str
    steps: tuple[Step, ...]
    outputs: tuple[int, ...]

    @property
    def ops(self) -> list[str]:
        """Primitive names in execution order."""
        return [s.prim.name for s in self.steps]

    def _last_use(self) -> list[int]:
        last = [-1] * (len(self.steps) + 1)
        for i, s in enumerate(self.steps):
            for o in s.operands:
                if isinstance(o, Ref):
                    last[o.index] = i
        for o in self.outputs:
            last[o] = len(self.steps)
        return last

    def run_dual(self, x: Tensor) -> tuple[list[Tensor], list[Tensor | float]]:
        """Values and derivatives of the outputs (forward mode; no autograd graph).

        A slot is dropped right after its last use, and a temporary made inside the
        chain whose last use is the current step is handed to the rule to overwrite
        (``DONATE``), so the chain runs in about the memory of its live frontier
        (paper section III-B, "reuse the tensor immediately"; IV-B, "resource release").
        """
        if x.dtype not in FLOAT_DTYPES:
            op = self.steps[0].prim.name if self.steps else self.name
            raise errors.FadDtypeError(errors.DTYPE_NO_RULE.format(op=op, dtype=x.dtype))
        last = self._last_use()
        slots: list[Dual | None] = [Dual(x, 1.0)]
        refs: collections.Counter[int] = collections.Counter()  # id -> live slot references
        owned: set[int] = set()  # temporaries this run allocated (never x or a constant)
        pinned = {id(x)} | {id(o) for s in self.steps for o in s.operands if isinstance(o, Tensor)}

        def hold(d: Dual, n: int) -> None:
            for t in (d.value, d.deriv):
                if isinstance(t, Tensor):
                    refs[id(t)] += n
                    if refs[id(t)] <= 0:
                        del refs[id(t)]
                        owned.discard(id(t))

        hold(slots[0], 1)  # type: ignore[arg-type]
        try:
            for i, step in enumerate(self.steps):
                uses = collections.Counter(o.index for o in step.operands if isinstance(o, Ref))
                DONATE.clear()
                for idx, n in uses.items():
                    dying = slots[idx]
                    if last[idx] == i and n == 1 and dying is not None:
                        for t in (dying.value, dying.deriv):
                            if isinstance(t, Tensor) and id(t) in owned and refs[id(t)] == 1:
                                DONATE.add(id(t))
                donated = set(DONATE)
                args = [slots[o.index] if isinstance(o, Ref) else o for o in step.operands]
                out = step.prim.rule(*args, **dict(step.params))
                DONATE.clear()
                for t in (out.value, out.deriv):
                    if isinstance(t, Tensor) and (
                        id(t) in donated or (id(t) not in refs and id(t) not in pinned)
                    ):
                        owned.add(id(t))
                hold(out, 1)
                slots.append(out)
                for idx in uses:
                    if last[idx] == i:
                        hold(slots[idx], -1)  # type: ignore[arg-type]
                        slots[idx] = None
        finally:
            DONATE.clear()
        outs = [slots[o] for o in self.outputs]
        assert all(d is not None for d in outs)
        return [d.value for d in outs], [d.deriv for d in outs]  # type: ignore[union-attr]

    def run_plain(self, x: Tensor) -> list[Tensor]:
        """The same chain with the plain operators, under whatever autograd mode is on."""
        slots: list[Any] = [x]
        for step in self.steps:
            args = [slots[o.index] if isinstance(o, Ref) else o for o in step.operands]
            slots.append(_plain_call(step.prim, args, dict(step.params)))
        return [slots[o] for o in self.outputs]


def _plain_call(prim: Primitive, args: list[Any], params: dict[str, Any]) -> Any:
    if prim.arity == 2 and not isinstance(args[0], Tensor):  # constant first: use operators
        a, b = args
        alpha = params.get("alpha", 1)
        ops = {"add": lambda: a + alpha * b, "sub": lambda: a - alpha * b,
               "mul": lambda: a * b, "div": lambda: a / b, "pow": lambda: a**b}  # fmt: skip
        return ops[prim.name]()
    return prim.plain(*args, **params)


class Builder:
    """Write a :class:`Program` step by step: ``b.op("sigmoid", b.source)`` returns a Ref."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.steps: list[Step] = []
        self.source = Ref(0)

    def op(self, name: str, *operands: Ref | float | int, **params: Any) -> Ref:
        if name not in PRIMITIVES:
            raise errors.FadOpError(
                errors.UNKNOWN_PRIMITIVE.format(name=name, known=primitive_names())
            )
        self.steps.append(Step(PRIMITIVES[name], tuple(operands), tuple(params.items())))
        return Ref(len(self.steps))

    def build(self, *outputs: Ref) -> Program:
        return Program(self.name, tuple(self.steps), tuple(o.index for o in outputs))


class _Fused(torch.autograd.Function):
    """Forward: values and derivatives together; saves one derivative per output."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, program: Program) -> tuple[Tensor, ...]:
        values, derivs = program.run_dual(x)
        values = [v.clone() if v is x else v for v in values]  # the source returned as is
        ctx.derivs = [None if isinstance(d, Tensor) else d for d in derivs]
        ctx.save_for_backward(*[d for d in derivs if isinstance(d, Tensor)])
        return tuple(values)

    @staticmethod
    def backward(ctx: Any, *grads: Tensor | None) -> tuple[Tensor | None, None]:
        saved = iter(ctx.saved_tensors)
        total: Tensor | None = None
        for g, const in zip(grads, ctx.derivs, strict=True):
            d = next(saved) if const is None else const
            if g is None:
                continue
            term = g * d if not (isinstance(d, float) and d == 1.0) else g
            total = term if total is None else total + term
        return total, None


def run_fused(x: Tensor, program: Program) -> tuple[Tensor, ...]:
    """Run ``program`` on ``x``; one autograd node saving one derivative per output.

    Without a gradient to record (grad mode off, or ``x`` not requiring grad) it
    runs the plain operators, which is cheaper.

    The call goes through ``__torch_function__``: a mode that sees it (``fad.nested()``,
    ``fad.elementwise``'s tracer) takes it as one element-wise operator whose forward rule is
    ``program.run_dual``, so a fused layer continues a chain instead of hiding its input
    inside an autograd Function the mode cannot see.
    """
    if has_torch_function_unary(x):
        return handle_torch_function(run_fused, (x,), x, program)
    if not (torch.is_grad_enabled() and x.requires_grad):
        with torch.no_grad():
            return tuple(program.run_plain(x))
    return _Fused.apply(x, program)


class FusedChain(nn.Module):
    """An element-wise chain as a module: one saved tensor per output (paper Fig. 4).

    Args:
        program: the chain.
        fallback: on a dtype without forward rules, warn and run plain autograd
            (``True``, what :func:`~leangrad.fad.nest` inserts) or raise (``False``).
    """

    def __init__(self, program: Program, *, fallback: bool = False) -> None:
        super().__init__()
        self.program = program
        self.fallback = fallback

    def extra_repr(self) -> str:
        return f"{self.program.name}: {' -> '.join(self.program.ops)}"

    def forward(self, x: Tensor) -> Any:
        outs: Sequence[Tensor]
        if isinstance(x, fx.Proxy):  # traced: one call_module node (see leangrad.fad._trace)
            n = len(self.program.outputs)
            return as_leaf(self, x, outputs=n, inline=lambda p: _one(self.program.run_plain(p)))
        if not isinstance(x, Tensor):
            layer = f"fad.{type(self).__name__}({self.program.name})"
            raise errors.FadOpError(errors.NOT_A_TENSOR.format(layer=layer,
                                                               type=type(x).__name__))  # fmt: skip
        if x.dtype not in FLOAT_DTYPES:
            if not self.fallback:
                op = self.program.ops[0] if self.program.ops else self.program.name
                raise errors.FadDtypeError(errors.DTYPE_NO_RULE.format(op=op, dtype=x.dtype))
            why = f"no forward-mode rule for dtype {x.dtype}"
            warnings.warn(errors.FALLBACK.format(ops=self.program.ops, why=why), stacklevel=2)
            outs = self.program.run_plain(x)
        else:
            outs = run_fused(x, self.program)
        return _one(outs)


def _one(outs: Sequence[Any]) -> Any:
    """A layer's result: its one output, or the tuple of them."""
    return outs[0] if len(outs) == 1 else tuple(outs)


def program_of(name: str, write: Callable[[Builder], Sequence[Ref]]) -> Program:
    """Build a program with ``write(builder) -> output refs``."""
    b = Builder(name)
    return b.build(*write(b))
