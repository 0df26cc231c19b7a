"""Random draws seen as they happen, and the module whose forward made them.

Whether a piece of a model draws random numbers is decided by watching it, never by its
class: every aten op PyTorch tags ``nondeterministic_seeded`` (``bernoulli_``,
``native_dropout``, ``rand``, ``normal_``, ``randperm``, ...) reaches a dispatch mode, so
``nn.Dropout``, ``F.dropout`` called inside a ``forward``, timm's ``DropPath`` and
torchvision's ``StochasticDepth`` (``x.new_empty(...).bernoulli_()``), attention's
``dropout_p`` and a layer drawing from a generator of its own are all seen alike.

Running the batch in pieces (checkpoint's fragments, accumulate's micro-batches) draws
other numbers than one forward of the whole batch, so whoever splits a batch asks
:class:`Draws` first: it records each draw's shape, and where every draw's shape follows
the batch (or is shared by it) the pieces are handed the whole batch's draws
(:mod:`._batch_draws`); where not, the splitter refuses, naming the module.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import is_fake
from torch.nn.modules import module as module_hooks
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["BY_FIRST", "DRAWS", "REPLAYING", "Draws", "aside", "draw_shape", "drawing", "may_draw",
           "op_name", "size_index"]

DRAWS = (
    "{where} draws random numbers in its forward ({op}), and {pieces} would draw other "
    "numbers than one forward of the whole batch (another gradient than autograd's); "
    "put it in eval mode or set its probability to 0, or leave out {option}"
)


BY_FIRST = frozenset({
    "bernoulli_.float", "bernoulli.p", "uniform_.default", "normal_.default",
    "exponential_.default", "geometric_.default", "log_normal_.default", "cauchy_.default",
    "random_.default", "random_.from", "random_.to", "rand_like.default",
    "randn_like.default", "randint_like.default", "randint_like.low_dtype",
    "native_dropout.default",
})  # fmt: skip
"""Ops whose draw depends on their first tensor's shape and layout only, not its values
(``native_dropout``'s output does, its mask does not: it is replayed through the mask)."""

REPLAYING: list[Any] = []
"""The :class:`~leangrad.engines._batch_draws.BatchDraws` replaying a batch's draws now
(below any :class:`Draws`, which then sees no generator move and counts every seeded op
that may draw). A plain list, not thread-local: the backward pass may run on other
threads."""


@contextlib.contextmanager
def aside() -> Iterator[None]:
    """A probe's run beside the step (on copies, its RNG streams forked): any replay of a
    batch's draws passes its draws through, for they are the probe's own."""
    held = REPLAYING[:]
    for r in held:
        r.paused += 1
    REPLAYING.clear()
    try:
        yield
    finally:
        REPLAYING[:] = held
        for r in held:
            r.paused -= 1


class Draws(TorchDispatchMode):
    """Records the random ops run under it, each with the innermost module of ``root``
    whose forward was running (``root_name`` where none was).

    Example::

        with Draws(block, root_name="the block") as d:
            block(x)
        d.first()  # e.g. ("'drop_path'", "bernoulli_"), or None
    """

    def __init__(self, root: nn.Module | Sequence[nn.Module], *,
                 root_name: str = "the model") -> None:  # fmt: skip
        super().__init__()
        roots = [root] if isinstance(root, nn.Module) else list(root)
        self.names: dict[int, str] = {}
        for i, r in enumerate(roots):
            prefix = f"{i}." if len(roots) > 1 else ""
            for n, m in r.named_modules():
                if n or prefix:
                    self.names.setdefault(id(m), repr(f"{prefix}{n}".rstrip(".")))
        self.root_name = root_name
        self.stack: list[str] = []
        self.found: list[tuple[str, str]] = []
        self.shapes: list[tuple[str, str, tuple[int, ...] | None]] = []
        """Per draw: module, ``op.overload`` and the shape it draws (``draw_shape``)."""
        self._handles: list[Any] = []

    def __enter__(self) -> Draws:
        def pre(module: nn.Module, args: Any) -> None:
            name = self.names.get(id(module))
            self.stack.append(name if name is not None else "")

        def post(module: nn.Module, args: Any, out: Any) -> None:
            if self.stack:
                self.stack.pop()

        self._handles = [module_hooks.register_module_forward_pre_hook(pre),
                         module_hooks.register_module_forward_hook(post, always_call=True)]
        super().__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        for h in self._handles:
            h.remove()
        self._handles = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:  # fmt: skip
        kwargs = kwargs or {}
        if torch.Tag.nondeterministic_seeded not in func.tags:
            return func(*args, **kwargs)
        # tagged ops may draw (attention kernels with dropout_p=0 do not): watch the
        # generator they would draw from; on fake tensors, which move none, read the
        # arguments that switch the draw off
        gens = _generators(args, kwargs)
        before = [g.get_state() for g in gens]
        out = func(*args, **kwargs)
        fake = any(is_fake(t) for t in pytree.tree_leaves((args, kwargs))
                   if isinstance(t, torch.Tensor))  # fmt: skip
        if (may_draw(func, args, kwargs) if fake or not gens or REPLAYING else
                any(not torch.equal(b, g.get_state()) for b, g in zip(before, gens,
                                                                     strict=True))):
            where = next((n for n in reversed(self.stack) if n), self.root_name)
            self.found.append((where, func.overloadpacket.__name__))
            self.shapes.append((where, op_name(func),
                                draw_shape(func, args, kwargs)))
        return out

    def first(self) -> tuple[str, str] | None:
        """``(module, op)`` of the first draw, or ``None``."""
        return self.found[0] if self.found else None

    def reason(self, *, pieces: str, option: str) -> str | None:
        """Why ``pieces`` of the batch would not compute the whole batch's gradient (the
        first draw, named), or ``None``."""
        hit = self.first()
        if hit is None:
            return None
        return DRAWS.format(where=hit[0], op=hit[1], pieces=pieces, option=option)


def _generators(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[torch.Generator]:
    """The generator an op draws from: its ``generator=``, else its device's default."""
    given = kwargs.get("generator")
    if isinstance(given, torch.Generator):
        return [given]
    device = kwargs.get("device")
    if device is None:
        device = next((t.device for t in pytree.tree_leaves(args)
                       if isinstance(t, torch.Tensor)), torch.device("cpu"))  # fmt: skip
    device = torch.device(device)
    if device.type == "cpu":
        return [torch.default_generator]
    if device.type == "cuda":
        return [torch.cuda.default_generators[device.index or 0]]
    return []


def may_draw(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether a seeded op's arguments let it draw: not with ``dropout_p``/``p`` 0 or
    ``train``/``training`` false."""
    for i, a in enumerate(func._schema.arguments):
        value = args[i] if i < len(args) else kwargs.get(a.name, a.default_value)
        if a.name in ("dropout_p", "p") and isinstance(value, int | float) and value == 0:
            return False
        if a.name in ("train", "training") and value is False:
            return False
    return True


def drawing(root: nn.Module | Sequence[nn.Module], run: Callable[[], Any], *, pieces: str,
            option: str, root_name: str = "the model") -> tuple[Any, str | None]:  # fmt: skip
    """``run()`` watched for random draws: its result and why ``pieces`` would not be
    exact (:data:`DRAWS`), or ``None``."""
    with Draws(root, root_name=root_name) as d:
        out = run()
    return out, d.reason(pieces=pieces, option=option)


def op_name(func: Any) -> str:
    return f"{func.overloadpacket.__name__}.{func._overloadname}"


def size_index(func: Any) -> int | None:
    return next((i for i, a in enumerate(func._schema.arguments) if a.name == "size"), None)


def draw_shape(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[int, ...] | None:
    """The shape a random op draws, where its draw depends on nothing else (a factory's
    ``size``, or the first tensor of an op in :data:`BY_FIRST`); ``None`` where the op
    cannot be replayed by shape."""
    if op_name(func) in BY_FIRST and args and isinstance(args[0], torch.Tensor):
        return tuple(args[0].shape)
    i = size_index(func)
    if i is not None:
        size = args[i] if i < len(args) else kwargs.get("size")
        if isinstance(size, Sequence) and all(isinstance(s, int) for s in size):
            return tuple(size)
    return None
