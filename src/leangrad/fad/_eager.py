"""``fad.nested()``: nested FAD in eager mode (paper section IV, Fig. 5-6, Table III).

Every torch call inside the block is a *tensor-operator pair* seen by a
``TorchFunctionMode``. Tensors are *fad* (Y: produced by a fad operator of an
open chain) or *nfad* (N); operators are fad (a primitive of
:mod:`leangrad.fad._primitives` whose tensor operands all come from one
source) or nfad. The four forward states (section IV-A):

- **NN** nfad input, nfad op: plain autograd (A, D in Table III).
- **NY** nfad input, fad op: a chain starts; the source ``x`` gets ``FTR = 1``
  and the op's value and derivative are computed together, with no autograd node.
- **YY** fad input, fad op: forward-AD computation (B): value and derivative
  from the input's value and derivative; still no autograd node.
- **YN** fad input, nfad op: the post-process (C): the chain's derivative
  becomes the only saved tensor of one autograd node whose backward is
  ``grad * d`` straight to the source (the paper's updated BFN/NXN), and the
  nfad op runs on that. A binary nfad op with two fad inputs attaches both;
  autograd accumulates their contributions at the sources (the "merge").

fad's own layers (:class:`~leangrad.fad.Swish`, ``GELU``, ``Mish``, any
:class:`~leangrad.fad.FusedChain` or :class:`~leangrad.fad.Elementwise`) are
element-wise operators with one input too: the mode sees their call
(``run_fused`` / ``run_elementwise`` dispatch through ``__torch_function__``)
and runs each as one fad operator, its whole program computing value and
derivative in one go, so a chain continues through it (NY or YY) and still
ends in one saved derivative.

Per-tensor FAD data (the paper's STT/FTR) lives in a weak-keyed table, so it
is freed with the tensor (section IV-B, "resource release"). Each fad tensor
also carries an autograd node that saves nothing and raises if a gradient
ever reaches it: a fad tensor used where the mode cannot see it (after the
block, or inside a custom ``autograd.Function``) fails loudly instead of
giving a wrong gradient. Chains on dtypes without rules (complex) run under
plain autograd with a warning.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import inspect
import warnings
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves, tree_map
from torch.utils.weak import WeakIdKeyDictionary

from . import _errors as errors
from ._elementwise import fused_rule
from ._primitives import FLOAT_DTYPES, Call, Dual, chain_deriv, lookup, normalize

__all__ = ["NestedStats", "nested"]

_META_METHODS = frozenset({
    "size", "dim", "numel", "stride", "is_contiguous", "element_size", "nelement",
    "ndimension", "is_floating_point", "is_complex", "data_ptr", "storage_offset", "__len__",
    "__format__", "__repr__", "item", "tolist", "__bool__", "untyped_storage", "get_device",
    "__hash__", "__get__",
})  # fmt: skip
_TENSOR_PROPS = frozenset({"T", "mT", "H", "mH", "data", "grad", "real", "imag"})


@dataclasses.dataclass
class NestedStats:
    """What the state machine did inside one ``with fad.nested() as stats`` block.

    Attributes:
        states: counts of the forward states ``"NN"``, ``"NY"``, ``"YY"``, ``"YN"``.
        attached: autograd nodes created by the YN post-process (one saved derivative each).
        fallbacks: chains left to autograd (dtype without rules), with the reason.
        trace: ``(state, op)`` per tensor-operator pair, when ``trace=True``.
    """

    states: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)
    attached: int = 0
    fallbacks: list[str] = dataclasses.field(default_factory=list)
    trace: list[tuple[str, str]] | None = None


@dataclasses.dataclass
class _Fate:
    """Shared by a fad tensor's table entry and its :class:`_Pending` node: did the tensor
    outlive the block? (So an unattached gradient's message says what really happened.)"""

    outlived: bool = False


@dataclasses.dataclass
class _FadData:
    """A fad tensor's FAD data (the paper's STT/FTR/SCN).

    ``source`` (a weak reference: FAD must not keep the source's memory alive, unlike
    autograd) and ``version`` identify the chain's source as it was when the chain
    started (a later in-place write makes it a different value); ``anchor`` links to
    the source's autograd node of that moment; ``deriv`` is ``d tensor / d source``.
    """

    source: weakref.ref[Tensor]
    version: int
    anchor: Tensor
    deriv: Tensor | float
    ops: tuple[str, ...]
    fate: _Fate
    attached: Tensor | None = None


class _Box:
    """Hands a tensor to ``_Pending.forward`` without making it an input (so no view)."""

    def __init__(self, value: Tensor) -> None:
        self.value: Tensor | None = value

    def take(self) -> Tensor:
        """The tensor, once: the box lets go of it."""
        value, self.value = self.value, None
        assert value is not None, "a _Box is taken once"
        return value


class _Anchor(torch.autograd.Function):
    """The chain's head node (SCN): a free stand-in for the source, gradient passes through."""

    @staticmethod
    def forward(ctx: Any, source: Tensor) -> Tensor:
        return source.new_zeros(()).expand(source.shape)  # one element, source's shape

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        return grad


class _Pending(torch.autograd.Function):
    """Links a fad tensor to its chain's head; saves nothing; a nonzero gradient reaching
    it means the tensor was used where the mode could not attach its derivative: after
    the block (when the tensor outlived it) or by an operation the mode did not see."""

    @staticmethod
    def forward(ctx: Any, anchor: Tensor, box: _Box, ops: tuple[str, ...], fate: _Fate
                ) -> Tensor:  # fmt: skip
        ctx.ops, ctx.fate = list(ops), fate
        return box.take()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Any:
        if bool(grad.any()):  # zeros come from a full overwrite (copy_), which is fine
            message = errors.ESCAPED if ctx.fate.outlived else errors.UNSEEN_CONSUMER
            raise errors.FadError(message.format(ops=ctx.ops))
        return None, None, None, None


class _Attach(torch.autograd.Function):
    """The YN post-process: one node, one saved derivative, backward ``grad * d``.

    The value comes in a :class:`_Box`, not as an input, so the output is a plain tensor
    (sharing the fad tensor's memory) rather than a view made inside a custom Function:
    autograd then accepts in-place writes to it and to its views, as it does for the
    value an ordinary op would have returned (``x.view(-1).relu_()``).
    """

    @staticmethod
    def forward(ctx: Any, anchor: Tensor, box: _Box, deriv: Tensor | float) -> Tensor:
        if isinstance(deriv, Tensor):
            ctx.save_for_backward(deriv)
            ctx.const = None
        else:
            ctx.const = deriv
        return box.take()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Any:
        d = ctx.saved_tensors[0] if ctx.const is None else ctx.const
        return grad * d, None, None


_INPLACE_DUNDERS = frozenset({"__iadd__", "__isub__", "__imul__", "__itruediv__", "__ipow__",
                              "__setitem__", "__iand__", "__ior__", "__ixor__"})  # fmt: skip


def _writes_first_arg(func: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> bool:
    """Does ``func(*args, **kwargs)`` write into its first argument? In-place methods
    (``relu_``, ``__iadd__``, ...) do, and so do functionals called with ``inplace=True``
    — by keyword (``F.relu(x, inplace=True)``, nn.ReLU) or by position
    (``F.leaky_relu(x, 0.1, True)``, nn.LeakyReLU, nn.Hardtanh, nn.ELU, nn.Dropout)."""
    name = getattr(func, "__name__", "")
    if name in _INPLACE_DUNDERS or (name.endswith("_") and not name.startswith("__")):
        return True
    kwargs = kwargs or {}
    if "inplace" in kwargs:
        return bool(kwargs["inplace"])
    position = _inplace_position(func)
    return position is not None and len(args) > position and bool(args[position])


@functools.lru_cache(maxsize=512)
def _inplace_position(func: Any) -> int | None:
    """Where ``func`` takes ``inplace`` positionally, if it has such a parameter."""
    try:
        params = list(inspect.signature(func).parameters)
    except (TypeError, ValueError):  # builtins without a signature
        return None
    return params.index("inplace") if "inplace" in params else None


def _op_name(func: Any, call: Call | None) -> str:
    return call.prim.name if call is not None else getattr(func, "__name__", repr(func))


def _is_meta(func: Any) -> bool:
    name = getattr(func, "__name__", "")
    if name == "__get__":
        owner = getattr(getattr(func, "__self__", None), "__name__", "")
        return owner not in _TENSOR_PROPS
    return name in _META_METHODS


class _NestedMode(TorchFunctionMode):
    def __init__(self, stats: NestedStats) -> None:
        super().__init__()
        self.stats = stats
        self.fad: WeakIdKeyDictionary = WeakIdKeyDictionary()  # fad tensor -> _FadData
        self.warned: set[str] = set()

    def close(self) -> None:
        """The block ended: mark every chain value still alive as having outlived it."""
        for data in self.fad.values():
            data.fate.outlived = True

    def _note(self, state: str, op: str) -> None:
        self.stats.states[state] += 1
        if self.stats.trace is not None:
            self.stats.trace.append((state, op))

    def __torch_function__(
        self, func: Any, types: Any, args: Any = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        if _is_meta(func):
            return func(*args, **kwargs)
        if not torch.is_grad_enabled():  # nothing is recorded: no chain either
            return func(*args, **kwargs)
        rule = fused_rule(func, args, kwargs)
        if rule is not None and (fused := self._fused_op(args[0], *rule)) is not None:
            return fused
        call = lookup(func)
        if call is not None and (norm := normalize(call, args, kwargs)) is not None:
            out = self._fad_op(call, *norm)
            if out is not None:
                return out
        fads = [t for t in tree_leaves((args, kwargs)) if isinstance(t, Tensor) and t in self.fad]
        if not fads:
            self._note("NN", _op_name(func, call))
            return func(*args, **kwargs)
        self._note("YN", _op_name(func, call))
        target = args[0] if args else None
        if _writes_first_arg(func, args, kwargs) and isinstance(target, Tensor) \
                and target in self.fad:  # fmt: skip
            # an nfad op writes into a fad tensor: give the tensor itself its graph first
            attached = self._attach(target)
            del self.fad[target]
            target.copy_(attached)
            args, kwargs = tree_map(self._attach, (args[1:], kwargs))
            return func(target, *args, **kwargs)
        args, kwargs = tree_map(self._attach, (args, kwargs))
        return func(*args, **kwargs)

    def _attach(self, t: Any) -> Any:
        """YN post-process: the fad tensor as one autograd node saving its derivative."""
        if not isinstance(t, Tensor) or t not in self.fad:
            return t
        data: _FadData = self.fad[t]
        if data.attached is None:
            data.attached = _Attach.apply(data.anchor, _Box(t.detach()), data.deriv)
            self.stats.attached += 1
        return data.attached

    def _fad_op(self, call: Call, operands: tuple[Any, ...], params: dict[str, Any]) -> Any:
        """NY / YY: compute value and derivative, or ``None`` when the pair is not fad."""
        heads = self._heads(operands)
        if len(heads) != 1:
            return None  # no recorded input (NN), or two sources (nfad, paper Fig. 3 node 3)
        source, version = heads[0]
        src_ref = source if isinstance(source, weakref.ref) else weakref.ref(source)
        name = call.prim.name
        target = (operands[-1] if call.reverse else operands[0]) if call.inplace else None
        if call.inplace and not (isinstance(target, Tensor) and target in self.fad):
            return None  # writing into a tensor outside a chain: plain autograd
        if not self._has_rules(name, operands):
            return None
        chained = self._duals(operands, source)
        if chained is None:
            return None
        duals, prev = chained
        self._note("NY" if prev is None else "YY", name)
        ops: tuple[str, ...]
        if prev is None:
            anchor, ops = _Anchor.apply(source), (name,)  # NY: source is a live tensor here
        else:
            anchor, ops = prev.anchor, (*prev.ops, name)
        with torch.no_grad():
            result = call.prim.rule(*duals, **params)
            if target is not None:
                target.copy_(result.value)
                fate = self.fad[target].fate  # the same tensor, the same _Pending node
                self.fad[target] = _FadData(src_ref, version, anchor, result.deriv, ops, fate)
                return target
        return self._pending(result.value, _FadData(src_ref, version, anchor, result.deriv,
                                                    ops, _Fate()))  # fmt: skip

    def _pending(self, value: Tensor, data: _FadData) -> Tensor:
        """A new fad tensor: ``value`` linked to its chain's head, with its FAD data."""
        out = _Pending.apply(data.anchor, _Box(value), data.ops, data.fate)
        self.fad[out] = data
        return out

    def _fused_op(self, x: Tensor, name: str, rule: Callable[[Tensor], Any]
                  ) -> tuple[Tensor, ...] | None:  # fmt: skip
        """NY / YY for one of fad's own layers (a whole program as one operator): values
        and derivatives by the layer's forward rule, times the chain's derivative so far;
        ``None`` when ``x`` is no chain value nor a source (the layer then runs as is)."""
        heads = self._heads((x,))
        if len(heads) != 1:
            return None
        source, version = heads[0]
        if not self._has_rules(name, (x,)):
            return None
        prev: _FadData | None = self.fad.get(x, None)
        self._note("NY" if prev is None else "YY", name)
        values, derivs = rule(x)
        ops: tuple[str, ...]
        inner: Tensor | float
        if prev is None:
            anchor, ops, inner = _Anchor.apply(source), (name,), 1.0
        else:
            anchor, ops, inner = prev.anchor, (*prev.ops, name), prev.deriv
        src_ref = source if isinstance(source, weakref.ref) else weakref.ref(source)
        with torch.no_grad():
            datas = [_FadData(src_ref, version, anchor, chain_deriv(d, inner), ops, _Fate())
                     for d in derivs]  # fmt: skip
        return tuple(self._pending(v, data) for v, data in zip(values, datas, strict=True))

    def _heads(self, operands: tuple[Any, ...]) -> list[tuple[Any, int]]:
        """The distinct sources the operands come from: (tensor, or a dead weak reference to
        it, version); constants have none."""
        heads: list[tuple[Any, int]] = []
        for o in operands:
            if not isinstance(o, Tensor):
                continue
            if o in self.fad:
                data: _FadData = self.fad[o]
                alive = data.source()
                head = (alive if alive is not None else data.source, data.version)
            elif o.requires_grad:
                head = (o, o._version)
            else:
                continue  # a constant
            if not any(head[0] is h[0] and head[1] == h[1] for h in heads):
                heads.append(head)
        return heads

    def _has_rules(self, name: str, operands: tuple[Any, ...]) -> bool:
        """Is the chain's dtype one with forward-mode rules? Otherwise warn once, count it."""
        dtype = next(o.dtype for o in operands if isinstance(o, Tensor) and o.requires_grad)
        if dtype in FLOAT_DTYPES:
            return True
        why = f"no forward-mode rule for dtype {dtype}"
        if why not in self.warned:
            self.warned.add(why)
            warnings.warn(errors.FALLBACK.format(ops=[name], why=why), stacklevel=4)
        self.stats.fallbacks.append(f"{name}: {why}")
        return False

    def _duals(
        self, operands: tuple[Any, ...], source: Any
    ) -> tuple[list[Any], _FadData | None] | None:
        """The rule's operands (chain values as :class:`Dual`, the source with derivative 1,
        constants as they are) and the longest chain feeding it, or ``None`` when a constant
        widens the chain (not element-wise in the source)."""
        shape = next(o.shape for o in operands if isinstance(o, Tensor) and o.requires_grad)
        duals: list[Any] = []
        prev: _FadData | None = None
        for o in operands:
            if isinstance(o, Tensor) and o in self.fad:
                data: _FadData = self.fad[o]
                duals.append(Dual(o, data.deriv))
                prev = data if prev is None or len(data.ops) > len(prev.ops) else prev
            elif o is source:
                duals.append(Dual(o, 1.0))
            elif isinstance(o, Tensor) and torch.broadcast_shapes(o.shape, shape) != shape:
                return None
            else:
                duals.append(o)
        return duals, prev


@contextlib.contextmanager
def nested(*, trace: bool = False) -> Iterator[NestedStats]:
    """Nest forward-mode AD of element-wise chains inside autograd, eagerly (section IV).

    Use it around the forward *and* the loss::

        with fad.nested():
            loss = loss_fn(model(x))
        loss.backward()

    Every element-wise chain with one source (Swish written as ``x * sigmoid(x)``,
    tanh-GELU, Mish, ...) then keeps one derivative tensor per value leaving it,
    whatever code computes it (no tracing: data-dependent control flow is fine).

    Args:
        trace: record ``(state, op)`` for every tensor-operator pair in the stats.

    Yields:
        :class:`NestedStats`, filled while the block runs.

    Trade-off: one Python-level dispatch per torch call inside the block (small
    next to convolutions and matmuls, visible on tiny tensors).
    """
    stats = NestedStats(trace=[] if trace else None)
    mode = _NestedMode(stats)
    try:
        with mode:
            yield stats
    finally:
        mode.close()
