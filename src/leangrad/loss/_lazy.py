"""Logits that are never computed: a model's final linear layer hands its loss a
:class:`LazyLogits`, and ``F.cross_entropy`` on it runs :func:`linear_cross_entropy`.

A user's loss reads the model's output as it always did —
``F.cross_entropy(out.logits.reshape(-1, V), y.reshape(-1))`` — and under
:func:`chunked_logits` the ``(N, T, V)`` logits never exist. :class:`LazyLogits` is a
tensor with the logits' shape, dtype and device but no storage: it holds the final layer's
input and weight. Views of its leading dimensions (``reshape``/``view``/``flatten`` keeping
the class dimension last, indexing that leaves the class dimension whole) are applied to
the held input; ``.contiguous()`` and a cast to its own dtype return it; and
``F.cross_entropy`` computes the loss in chunks. Anything else that reads it raises
:class:`LogitsReadError` naming the operation: a silent fallback would hold the logits after
all, and the user asked for a loss that does not.

The final layer is found by :func:`final_linear` (an ``nn.Linear`` with a vocabulary-sized
output) and recognised at run time by its weight, so a weight tied to the embedding, a
module copied by a transform or a model that calls ``F.linear`` with that weight all work.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Sequence
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from .. import _errors as errors
from ._chunked import GradSink, _apply

__all__ = ["MIN_CLASSES", "Head", "LazyLogits", "LogitsReadError", "chunked_logits",
           "final_linear"]  # fmt: skip

MIN_CLASSES = 1024
"""A final layer with fewer outputs than this is not worth chunking: its logits are small."""
WIDER = 4
"""...nor one with fewer than this many outputs per input feature (its logits are no bigger
than the activations before it)."""
READ = (
    "chunked logits: {op} read the logits of {head}, which were never computed (chunked "
    "cross-entropy); only views of their leading dimensions (reshape/view/flatten/indexing "
    "that keep the class dimension last and whole), .contiguous(), .float() and "
    "F.cross_entropy(logits, target) may use them. Give the logits straight to "
    "F.cross_entropy, or leave chunked cross-entropy out (an engine without +chunked_ce)"
)
UNSUPPORTED = (
    "chunked logits: F.cross_entropy({what}) is not computed in chunks; call it without "
    "{what}, or leave chunked cross-entropy out (an engine without +chunked_ce)"
)
NO_HEAD = (
    "no final nn.Linear with a vocabulary-sized output (at least {least:,} outputs and "
    "{wider}x its inputs, none of them taken by a later nn.Linear) outside the blocks, so "
    "there are no logits worth chunking"
)


class LogitsReadError(errors.EngineInputError):
    """Something other than a view or ``F.cross_entropy`` read :class:`LazyLogits`."""


@dataclasses.dataclass(frozen=True)
class Head:
    """The final linear layer whose logits go to the loss."""

    name: str
    module: nn.Linear


def final_linear(model: nn.Module, *, outside: Sequence[str] = ()) -> Head | str:
    """The model's output layer, or why there is none: the last ``nn.Linear`` registered in
    ``model`` with at least :data:`MIN_CLASSES` outputs and :data:`WIDER` times as many
    outputs as inputs whose width no later ``nn.Linear`` takes as input, not inside a module
    named in ``outside`` (e.g. checkpointed blocks, which recompute it).

    The width rule keeps a widening layer inside a block (an MLP's first layer, ``d → 4d``,
    followed by ``4d → d``) from passing for the output layer of a model whose vocabulary
    is too small to qualify: such a model has no logits worth chunking."""
    linears = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    found: Head | None = None
    taken: set[int] = set()  # the input widths of the layers registered after this one
    for name, mod in reversed(linears):
        out = mod.out_features
        if out >= MIN_CLASSES and out >= WIDER * mod.in_features and out not in taken:
            found = Head(name, mod)
            break
        taken.add(mod.in_features)
    if found is None:
        return NO_HEAD.format(least=MIN_CLASSES, wider=WIDER)
    inside = [b for b in outside if found.name == b or found.name.startswith(b + ".")]
    if inside:
        return (f"the output layer {found.name!r} lies inside block {inside[0]!r}, which "
                "is recomputed as a whole; its logits cannot be left uncomputed there")
    return found


class LazyLogits(torch.Tensor):
    """The logits ``F.linear(hidden, weight, bias)`` with no storage (module docstring).

    Attributes:
        hidden: the final layer's input, reshaped along with the logits' leading dimensions.
        weight, bias: the final layer's parameters.
        head: the final layer's name, for error messages.
        chunk_size: rows per chunk of the loss (``None``: about 8 MiB of logits).
    """

    hidden: torch.Tensor
    weight: torch.Tensor
    bias: torch.Tensor | None
    head: str
    chunk_size: int | None
    sink: GradSink | None
    _METADATA: ClassVar[frozenset[Any]] = frozenset()

    @staticmethod
    def __new__(cls, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                *, head: str = "the output layer", chunk_size: int | None = None,
                sink: GradSink | None = None) -> LazyLogits:  # fmt: skip
        needs = hidden.requires_grad or weight.requires_grad or (
            bias is not None and bias.requires_grad)  # fmt: skip
        shape = (*hidden.shape[:-1], weight.shape[0])
        out = torch.Tensor._make_wrapper_subclass(
            cls, shape, dtype=hidden.dtype, device=hidden.device, requires_grad=needs)
        out.hidden, out.weight, out.bias = hidden, weight, bias
        out.head, out.chunk_size, out.sink = head, chunk_size, sink
        return out

    def _like(self, hidden: torch.Tensor) -> LazyLogits:
        return LazyLogits(hidden, self.weight, self.bias, head=self.head,
                          chunk_size=self.chunk_size, sink=self.sink)  # fmt: skip

    def __repr__(self, *args: Any, **kwargs: Any) -> str:  # type: ignore[override]
        return (f"LazyLogits(shape={tuple(self.shape)}, dtype={self.dtype}, head={self.head!r}"
                ": never computed)")  # fmt: skip

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:  # fmt: skip
        kwargs = kwargs or {}
        if func in _metadata():
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        if func is torch.Tensor.register_hook and _fsdp_hook(args[1] if len(args) > 1 else None):
            # FSDP2's pre-backward hook on a unit's output. No gradient reaches the logits
            # (the chunked loss differentiates the hidden states and the weight), so it does
            # not fire; the unit is the root (ChunkedCETransform refuses any other), whose
            # gathered weight stays until FSDP2's end-of-backward callback reduces it.
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        handler = _HANDLERS.get(func)
        lazy = next((a for a in (*args, *kwargs.values()) if isinstance(a, LazyLogits)), None)
        if handler is None or lazy is None or not isinstance(args[0] if args else None,
                                                             LazyLogits):  # fmt: skip
            if func is F.cross_entropy:
                return _cross_entropy(*args, **kwargs)
            head = lazy.head if lazy is not None else "the output layer"
            raise LogitsReadError(READ.format(op=_name(func), head=repr(head)))
        return handler(*args, **kwargs)

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (),  # type: ignore[override]
                           kwargs: Any = None) -> Any:  # fmt: skip
        head = next((a.head for a in args if isinstance(a, LazyLogits)), "the output layer")
        raise LogitsReadError(READ.format(op=str(func), head=repr(head)))


def _metadata() -> frozenset[Any]:
    """Tensor attributes that read only shape, dtype and device (no storage)."""
    if not LazyLogits._METADATA:
        T = torch.Tensor
        props = ("shape", "dtype", "device", "ndim", "requires_grad", "grad_fn", "is_leaf",
                 "layout", "is_cuda", "is_sparse", "is_meta", "is_quantized", "grad",
                 "_base")  # fmt: skip
        methods = ("size", "dim", "numel", "nelement", "__len__", "is_floating_point",
                   "is_complex", "element_size", "get_device", "stride", "is_contiguous",
                   "__hash__", "ndimension", "__format__")  # fmt: skip
        LazyLogits._METADATA = frozenset(
            [getattr(T, p).__get__ for p in props] + [getattr(T, m) for m in methods])
    return LazyLogits._METADATA


def _fsdp_hook(hook: Any) -> bool:
    """Whether ``hook`` is a method of an FSDP2 unit's state (its pre-backward hook)."""
    try:
        from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState
    except ImportError:  # a build without distributed support
        return False
    return isinstance(getattr(hook, "__self__", None), FSDPState)


def _name(func: Any) -> str:
    name = getattr(func, "__qualname__", None) or getattr(func, "__name__", None) or str(func)
    name = name.replace("TensorBase.", "Tensor.").replace("getset_descriptor.__get__", "an "
                                                                   "attribute")  # fmt: skip
    return f"torch.{name}" if not name.startswith(("torch.", "an ")) else name


def _shape_arg(args: tuple[Any, ...]) -> tuple[int, ...]:
    if len(args) == 1 and isinstance(args[0], (tuple, list, torch.Size)):
        return tuple(args[0])
    return tuple(args)


def _reshape(self: LazyLogits, *shape: Any) -> LazyLogits:
    dims = _shape_arg(shape)
    classes = self.shape[-1]
    if not dims or dims[-1] != classes:
        raise LogitsReadError(READ.format(op=f"reshape/view to {dims} (the class dimension "
                                             f"{classes} not last)", head=repr(self.head)))
    return self._like(self.hidden.reshape(*dims[:-1], self.hidden.shape[-1]))


def _flatten(self: LazyLogits, start_dim: int = 0, end_dim: int = -1) -> LazyLogits:
    n = self.dim()
    end = end_dim % n if n else 0
    if end >= n - 1:
        raise LogitsReadError(READ.format(op="flatten over the class dimension",
                                          head=repr(self.head)))  # fmt: skip
    return self._like(self.hidden.flatten(start_dim, end))


def _getitem(self: LazyLogits, index: Any) -> LazyLogits:
    idx = index if isinstance(index, tuple) else (index,)
    # a boolean mask indexes as many dimensions as it has
    span = sum(i.dim() if isinstance(i, torch.Tensor) and i.dtype == torch.bool else 1
               for i in idx if i is not None and i is not Ellipsis)  # fmt: skip
    last_whole = isinstance(idx[-1], slice) and idx[-1] == slice(None) if idx else False
    if span > self.dim() or (span == self.dim() and not last_whole):
        raise LogitsReadError(READ.format(op=f"indexing with {_short(index)} (it reaches the "
                                             "class dimension)", head=repr(self.head)))
    plain = [i for i in idx if i is not None and i is not Ellipsis]
    whole_last = len(plain) == self.dim() and plain[-1] == slice(None)
    if any(i is None or i is Ellipsis for i in idx) or (len(plain) >= self.dim()
                                                        and not whole_last):  # fmt: skip
        raise LogitsReadError(READ.format(op=f"indexing with {_short(index)} (it reaches the "
                                             "class dimension)", head=repr(self.head)))
    if whole_last:
        idx = idx[:-1]
    return self._like(self.hidden[idx])


def _short(index: Any) -> str:
    """An index for a message: tensors by their shape, not their values."""
    idx = index if isinstance(index, tuple) else (index,)
    parts = [f"<{i.dtype} tensor {tuple(i.shape)}>" if isinstance(i, torch.Tensor) else repr(i)
             for i in idx]  # fmt: skip
    return f"[{', '.join(parts)}]"


def _same(self: LazyLogits, *args: Any, **kwargs: Any) -> LazyLogits:
    return self


def _cast(self: LazyLogits, *args: Any, **kwargs: Any) -> LazyLogits:
    dtype = kwargs.get("dtype", next((a for a in args if isinstance(a, torch.dtype)), None))
    device = kwargs.get("device", next((a for a in args if isinstance(a, (str, torch.device))),
                                       None))  # fmt: skip
    other = next((a for a in args if isinstance(a, torch.Tensor)), None)
    if other is not None:
        dtype, device = other.dtype, other.device
    if (dtype is not None and dtype != self.dtype) or (
            device is not None and torch.device(device) != self.device):  # fmt: skip
        raise LogitsReadError(READ.format(op=f"a cast to {dtype or device}",
                                          head=repr(self.head)))  # fmt: skip
    return self


def _float(self: LazyLogits) -> LazyLogits:
    return _cast(self, torch.float32)


def _cross_entropy(input: Any, target: torch.Tensor, weight: torch.Tensor | None = None,
                   size_average: Any = None, ignore_index: int = -100, reduce: Any = None,
                   reduction: str = "mean", label_smoothing: float = 0.0,
                   ) -> torch.Tensor:  # fmt: skip
    if not isinstance(input, LazyLogits) or isinstance(target, LazyLogits):
        head = next(a.head for a in (input, target) if isinstance(a, LazyLogits))
        raise LogitsReadError(READ.format(op="F.cross_entropy with the logits as its target",
                                          head=repr(head)))  # fmt: skip
    for what, value in (("weight=", weight), ("size_average=", size_average),
                        ("reduce=", reduce)):  # fmt: skip
        if value is not None:
            raise LogitsReadError(UNSUPPORTED.format(what=what))
    if input.dim() > 2:
        raise LogitsReadError(UNSUPPORTED.format(
            what=f"input of {input.dim()} dimensions (the classes must be dimension 1 there; "
                 "flatten to (rows, classes) first)"))  # fmt: skip
    if target.is_floating_point():
        raise LogitsReadError(UNSUPPORTED.format(what="class probabilities as the target"))
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"F.cross_entropy: {reduction!r} is not a valid value for reduction")
    if tuple(target.shape) != tuple(input.shape[:-1]):
        raise ValueError(f"F.cross_entropy: expected target of shape {tuple(input.shape[:-1])}, "
                         f"got {tuple(target.shape)}")  # fmt: skip
    return _apply(input.hidden, input.weight, target, input.bias, ignore_index, reduction,
                  label_smoothing, input.chunk_size, input.sink)  # fmt: skip


T = torch.Tensor
_HANDLERS: dict[Any, Any] = {
    T.reshape: _reshape, torch.reshape: _reshape, T.view: _reshape,
    T.flatten: _flatten, torch.flatten: _flatten,
    T.__getitem__: _getitem,
    T.contiguous: _same,
    T.float: _float, T.to: _cast, T.type_as: _cast,
    F.cross_entropy: _cross_entropy,
}
del T


class _HeadMode(TorchFunctionMode):
    """Turns ``F.linear(x, weight, bias)`` with the head's weight into :class:`LazyLogits`,
    and ``F.embedding`` with the same weight (a tied input embedding) into
    :class:`_TiedEmbedding`, whose backward adds into the loss's weight gradient."""

    def __init__(self, head: Head, chunk_size: int | None) -> None:
        super().__init__()
        self.head, self.chunk_size = head, chunk_size
        self.calls = 0
        self.sink = GradSink()

    def __torch_function__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:  # fmt: skip
        kwargs = kwargs or {}
        weight = self.head.module.weight
        if func is F.linear:
            a = dict(zip(("input", "weight", "bias"), args, strict=False)) | kwargs
            if a.get("weight") is weight and not isinstance(a.get("input"), LazyLogits):
                self.calls += 1
                return LazyLogits(a["input"], a["weight"], a.get("bias"), head=self.head.name,
                                  chunk_size=self.chunk_size, sink=self.sink)  # fmt: skip
        elif func is F.embedding:
            a = dict(zip(_EMBEDDING_ARGS, args, strict=False)) | kwargs
            plain = all(a.get(k) in (None, False) for k in ("max_norm", "scale_grad_by_freq",
                                                            "sparse"))  # fmt: skip
            ids = a.get("input")
            if (a.get("weight") is weight and plain and isinstance(ids, torch.Tensor)
                    and weight.requires_grad and torch.is_grad_enabled()):  # fmt: skip
                pad = a.get("padding_idx")
                pad = None if pad is None else pad % weight.shape[0]
                out: torch.Tensor = _TiedEmbedding.apply(ids, weight, pad, self.sink)
                return out
        return func(*args, **kwargs)


_EMBEDDING_ARGS = ("input", "weight", "padding_idx", "max_norm", "norm_type",
                   "scale_grad_by_freq", "sparse")  # fmt: skip


class _TiedEmbedding(torch.autograd.Function):
    """``F.embedding(ids, weight, padding_idx)`` whose weight is also the output layer's.

    Autograd would return a dense ``(V, D)`` gradient for the weight here and add it to the
    output layer's: three ``(V, D)`` tensors at once (measured: 3.0x against 2.0x untied).
    The chunked loss runs its backward first and leaves its weight gradient — the very
    tensor autograd will accumulate — in the :class:`GradSink`; this backward adds its rows
    into it (``index_add_``, the padding row left out, as autograd's rule does) and
    returns no gradient for the weight. Where the loss left nothing (it did not run, or did
    not need the weight's gradient) it returns autograd's dense gradient instead.
    """

    @staticmethod
    def forward(ctx: Any, ids: torch.Tensor, weight: torch.Tensor, padding_idx: int | None,
                sink: GradSink) -> torch.Tensor:  # fmt: skip
        ctx.save_for_backward(ids)
        ctx.padding_idx, ctx.sink, ctx.shape = padding_idx, sink, weight.shape
        ctx.dtype = weight.dtype
        sink.pending += 1
        return F.embedding(ids, weight, padding_idx)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        (ids,) = ctx.saved_tensors
        sink = ctx.sink
        sink.pending -= 1
        if not ctx.needs_input_grad[1]:
            return None, None, None, None
        flat = ids.reshape(-1)
        rows = grad.reshape(-1, grad.shape[-1]).to(ctx.dtype)
        if ctx.padding_idx is not None:
            rows = rows.masked_fill((flat == ctx.padding_idx)[:, None], 0.0)
        into = sink.weight_grad
        if sink.pending == 0:
            sink.weight_grad = None  # autograd's reference alone: it adopts the tensor
        if into is None:
            dense = torch.zeros(ctx.shape, dtype=ctx.dtype, device=grad.device)
            return None, dense.index_add_(0, flat, rows), None, None
        into.index_add_(0, flat, rows)
        return None, None, None, None


@contextlib.contextmanager
def chunked_logits(model: nn.Module | Head, *, chunk_size: int | None = None,
                   outside: Sequence[str] = ()) -> Iterator[Head]:  # fmt: skip
    """Within the block, ``model``'s final linear layer (:func:`final_linear`) returns
    :class:`LazyLogits`: ``F.cross_entropy`` on them computes the loss in chunks of
    ``chunk_size`` rows without the logits; any other read raises :class:`LogitsReadError`.

    Example::

        with leangrad.loss.chunked_logits(model):
            out = model(x)
            loss = F.cross_entropy(out.logits.flatten(0, 1), y.flatten())
            loss.backward()

    Raises:
        EngineInputError: the model has no such layer (the message says why), or the
            layer was not called through ``F.linear`` inside the block.
    """
    head = model if isinstance(model, Head) else final_linear(model, outside=outside)
    if isinstance(head, str):
        raise errors.EngineInputError(f"chunked logits: {head}")
    mode = _HeadMode(head, chunk_size)
    with mode:
        yield head
    if mode.calls == 0:
        raise errors.EngineInputError(
            f"chunked logits: the output layer {head.name!r} was not called through "
            "F.linear inside the block, so nothing was chunked; call the model inside it"
        )
