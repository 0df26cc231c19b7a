"""Fragmented recomputation along the batch.

Moonwalk v2's fragmental checkpointing keeps fragments and rebuilds the rest piecewise
during the backward pass (``../shared/papers``, Moonwalk v2, section on fragmental
checkpointing). Applied to the blocks people train: a checkpointed block keeps only its
inputs during the forward pass, and PyTorch's ``checkpoint`` recomputes the *whole* block
for its backward, so one block's internals over the whole batch are alive at once — the
floor of per-block checkpointing. Where a block does not couple the examples of its batch
(no training-mode BatchNorm, no random draws), its forward and its recomputation run in
``k`` fragments of the batch, one after another; each fragment's recomputation and
backward finish before the next starts, so about ``1/k`` of the block's internals are
alive. The parameters' gradients add up over the fragments and reach autograd once, as
one gradient per parameter from the block: post-accumulate hooks fire once, and a
parameter shared with other blocks accumulates as under ``loss.backward()``.

Which tensors are split: every tensor argument whose first dimension is the batch (the
size of the first tensor argument's); the others (a causal mask of shape ``(1, 1, T, T)``,
rotary tables) go whole to every fragment. Before its first use per kind of call, a block
is *probed* on two examples: run on both at once and on each alone, the results must agree
(a block that mixes examples, or an argument mistaken for a batch, shows here), every
output must be batch-shaped, its graph may reach no parameter outside the block (a
weight read from another module: its gradient would be lost), and no buffer may change (it
would change once per fragment). A block that fails runs whole, as plain checkpointing
does, with the reason kept for :func:`leangrad.explain` and the step's info.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import is_fake
from torch.utils import _pytree as pytree

from .._batch_draws import BatchDraws, Drawn, layout, rng_states, set_rng_states
from .._contract import graph_nodes, keep_nothing
from .._coupling import _tolerance, batch_coupling
from .._draws import Draws, aside
from .._generators import layer_generators
from ._batchnorm import (
    BnStats,
    bn_buffers,
    capture_stats,
    dependencies,
    frozen_stats,
    gather_sums,
    is_bn_only,
    schedule,
)

__all__ = ["BAD_FRAGMENTS", "Fragmenter", "fragment_edges", "frozen_batchnorm", "split_reason",
           "static_reason"]

BAD_FRAGMENTS = "fragments must be an int >= 2 or None (recompute blocks whole), got {value!r}"
NOT_SPLIT = "{what}: runs whole"
MIXES = (
    "it mixes the examples of its batch (run on two examples at once and on each alone, "
    "the outputs differ by {diff:.3g})"
)
OUTSIDE = (
    "its graph reaches {count} parameter(s) that are not the block's (a weight read from "
    "another module), whose gradient fragments could not hand on"
)
BUFFERS = "it changes buffer(s) {names} in its forward, which fragments would do k times"
NOT_BATCH = "output {index} has no batch dimension (shape {shape}), so it cannot be split"
FAILED = "running it on one example failed ({error})"
DIM_NAMES = {0: "example", 1: "position"}
GENERATORS = "its layers draw from generators of their own, which fragments would draw k times"


def static_reason(modules: Sequence[nn.Module], *, batchnorm: bool = False,
                  random: bool = True) -> str | None:  # fmt: skip
    """Why ``modules`` cannot run in fragments of the batch, seen from their types alone
    (training-mode BatchNorm unless ``batchnorm``, dropout unless ``random=False`` — cut
    along the batch, the probe watches the draws and the fragments replay them — layers
    holding their own generators), or ``None``."""
    for module in modules:
        why = batch_coupling(module, pieces="fragments", option="fragments=", root="the block",
                             skip_batchnorm=batchnorm, random=random)  # fmt: skip
        if why is not None:
            return why
    if layer_generators(modules):
        return GENERATORS
    return None


def frozen_batchnorm(modules: Sequence[nn.Module]) -> bool:
    """Whether what couples the examples in ``modules`` is training-mode BatchNorm alone,
    which runs in fragments with its statistics frozen (:mod:`._fragments_bn`)."""
    return is_bn_only(modules) and static_reason(modules, batchnorm=True, random=False) is None


def split_reason(modules: Sequence[nn.Module]) -> str | None:
    """Why ``modules`` cannot run in fragments of the batch, from their types alone (the
    first call's probe may still find a reason), or ``None``: training-mode BatchNorm runs
    in fragments with frozen statistics."""
    why = static_reason(modules, random=False)
    if why is None or frozen_batchnorm(modules):
        return None
    return static_reason(modules, batchnorm=True, random=False) or why  # besides BatchNorm


def fragment_edges(rows: int, fragments: int) -> list[tuple[int, int]]:
    """``fragments`` contiguous ranges of ``range(rows)`` whose sizes differ by at most one
    (one row each where there are fewer rows than fragments)."""
    m = max(1, min(fragments, rows))
    bounds = [rows * i // m for i in range(m + 1)]
    return [(bounds[i], bounds[i + 1]) for i in range(m)]


@dataclasses.dataclass
class _Call:
    """One call of a fragmented block: what to run, how its arguments split, and how its
    outputs were laid out (filled by the forward)."""

    fn: Callable[..., Any]
    spec: pytree.TreeSpec
    leaves: list[Any]  # the arguments' leaves; tensors replaced by their index in `tensors`
    split: list[bool]  # per tensor argument: cut along the batch?
    edges: list[tuple[int, int]]
    n_tensors: int
    dim: int = 0  # the dimension cut: 0 the batch; 1 a batch-first sequence or time-first batch
    bn: bool = False  # training-mode BatchNorm inside: forward whole, statistics frozen
    params: list[nn.Parameter] = dataclasses.field(default_factory=list)
    out_dims: tuple[int, ...] = ()  # per output tensor: its batch dimension (the probe's)
    out_spec: pytree.TreeSpec | None = None
    out_leaves: list[Any] | None = None  # non-tensor output leaves; tensors: _TENSOR
    overwritten: frozenset[int] = frozenset()  # BatchNorm calls whose output is written in place
    draws: tuple[Drawn, ...] = ()  # random draws the fragments replay (_batch_draws)

    def replay(self) -> BatchDraws | None:
        """What replays the whole batch's draws in this call's fragments, or ``None``."""
        if not self.draws:
            return None
        return BatchDraws(self.draws, edges=(0, *(b for _, b in self.edges)), forward_only=False)

    def args(self, tensors: Sequence[torch.Tensor]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        leaves = [tensors[v.index] if isinstance(v, _Slot) else v for v in self.leaves]
        args, kwargs = pytree.tree_unflatten(leaves, self.spec)
        return args, kwargs

    def piece(self, tensors: Sequence[torch.Tensor], a: int, b: int) -> list[torch.Tensor]:
        d = self.dim
        return [_rows(t, d, a, b) if s else t
                for t, s in zip(tensors, self.split, strict=True)]  # fmt: skip

    def run(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        args, kwargs = self.args(tensors)
        out_leaves, out_spec = pytree.tree_flatten(self.fn(*args, **kwargs))
        if self.out_spec is None:
            self.out_spec = out_spec
            self.out_leaves = [_TENSOR if isinstance(v, torch.Tensor) else v
                               for v in out_leaves]  # fmt: skip
        return [v for v in out_leaves if isinstance(v, torch.Tensor)]

    def output(self, outs: Sequence[torch.Tensor]) -> Any:
        assert self.out_spec is not None and self.out_leaves is not None
        it = iter(outs)
        leaves = [next(it) if v is _TENSOR else v for v in self.out_leaves]
        return pytree.tree_unflatten(leaves, self.out_spec)


_TENSOR = object()  # marks where a tensor stood among a call's output leaves


def _rows(t: torch.Tensor, dim: int, a: int, b: int) -> torch.Tensor:
    """Rows ``a:b`` of ``t`` along ``dim``, contiguous where ``t`` is: the piece a block
    gets is laid out as the whole it would get. A cut along the batch of a contiguous
    tensor is contiguous already; one along the sequence is not, and code that calls
    ``.view`` on its input (GPT-2's ``Conv1D`` flattens it with ``x.view(-1, x.size(-1))``)
    fails on it. The copy is one fragment of the input (or of the output's gradient)."""
    piece = t.narrow(dim, a, b - a)
    return piece.contiguous() if t.is_contiguous() else piece


@dataclasses.dataclass(frozen=True)
class _Slot:
    index: int


class _Fragmented(torch.autograd.Function):
    """The block's forward in fragments (nothing saved but its inputs); its backward
    recomputes and differentiates one fragment at a time."""

    @staticmethod
    def forward(ctx: Any, call: _Call, *tensors: torch.Tensor) -> Any:
        inputs = tensors[: call.n_tensors]
        ctx.call = call
        ctx.autocast = _autocast_now(inputs)
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(*inputs)
        ctx.stats = None
        ctx.replay = replay = call.replay()
        if call.bn:  # whole, keeping each BatchNorm's statistics (_fragments_bn)
            with capture_stats() as mode, _span(replay, 0, call.edges[-1][1]):
                out = call.run(inputs)
            ctx.stats = mode.stats
        else:
            out = []
            for a, b in call.edges:
                with _span(replay, a, b):
                    part = call.run(call.piece(inputs, a, b))
                if not out:
                    rows = call.edges[-1][1]
                    out = [_empty_as(p, (*p.shape[:d], rows, *p.shape[d + 1:]))
                           for p, d in zip(part, call.out_dims, strict=True)]  # fmt: skip
                for o, p, d in zip(out, part, call.out_dims, strict=True):
                    o.narrow(d, a, b - a).copy_(p)
                del part
        ctx.mark_non_differentiable(*[o for o in out if not o.is_floating_point()])
        return tuple(out)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> Any:
        call: _Call = ctx.call
        run = _Recompute(call, list(ctx.saved_tensors), grads, ctx.needs_input_grad[1:],
                         ctx.autocast, ctx.stats, ctx.replay)  # fmt: skip
        if ctx.stats is not None:
            run.gather_batchnorm_sums()
        return (None, *run.differentiate())


Pair = tuple[torch.Tensor, torch.Tensor]


class _Recompute:
    """A fragmented block's backward: its fragments recomputed one at a time, under the
    forward's autocast and (with BatchNorm) its frozen statistics."""

    def __init__(self, call: _Call, inputs: list[torch.Tensor],
                 grads: Sequence[torch.Tensor | None], needs: Sequence[bool],
                 autocast: tuple[str, torch.dtype] | None,
                 stats: list[BnStats] | None, replay: BatchDraws | None) -> None:  # fmt: skip
        self.call, self.inputs, self.grads, self.needs = call, inputs, grads, needs
        self.autocast, self.stats, self.replay = autocast, stats, replay
        n = call.n_tensors
        self.whole = [t.detach().requires_grad_(need) if not s and need else t
                      for t, s, need in zip(inputs, call.split, needs[:n],
                                            strict=True)]  # fmt: skip

    def fragment(self, a: int, b: int) -> tuple[list[torch.Tensor], list[Pair], list[Any]]:
        """Recompute rows ``a:b``: ``(inputs, (output, its gradient) pairs, BatchNorm
        calls)``."""
        call, n = self.call, self.call.n_tensors
        mode: Any = contextlib.nullcontext() if self.stats is None else frozen_stats(
            self.stats, clone=call.overwritten)  # fmt: skip
        with torch.enable_grad(), _autocast(self.autocast), mode, \
                _span(self.replay, a, b, recompute=True):
            part = [_rows(t, call.dim, a, b).detach().requires_grad_(need) if s else w
                    for t, w, s, need in zip(self.inputs, self.whole, call.split,
                                             self.needs[:n], strict=True)]  # fmt: skip
            outs = call.run(part)
            pairs = [(o, _rows(g, d, a, b))
                     for o, g, d in zip(outs, self.grads, call.out_dims, strict=True)
                     if g is not None and o.requires_grad]  # fmt: skip
        seen = [] if self.stats is None else mode.seen
        return part, pairs, seen

    def gather_batchnorm_sums(self) -> None:
        """Passes over the fragments that gather every BatchNorm call's whole-batch sums,
        in the order their dependencies allow (:func:`schedule`)."""
        assert self.stats is not None
        for st in self.stats:
            st.sums = None
        order: list[list[int]] | None = None
        for _ in range(len(self.stats) + 1):
            for a, b in self.call.edges:
                _, pairs, seen = self.fragment(a, b)
                if order is None:
                    order = schedule(dependencies(seen))
                if not order:
                    return
                gather_sums(self.stats, order[0], seen, [o for o, _ in pairs],
                            [g for _, g in pairs])  # fmt: skip
                del pairs, seen
            assert order is not None
            order = order[1:]
            if not order:
                return

    def differentiate(self) -> list[torch.Tensor | None]:
        """The last pass: every fragment differentiated; input gradients assembled,
        parameter gradients summed."""
        call, needs, n = self.call, self.needs, self.call.n_tensors
        params = call.params
        grads_in: list[torch.Tensor | None] = [None] * n
        grads_p: list[torch.Tensor | None] = [None] * len(params)
        owned: set[int] = set()  # sums this backward allocated (safe to add into)
        for a, b in call.edges:
            part, pairs, _ = self.fragment(a, b)
            wrt = [(i, t) for i, t in enumerate(part) if needs[i] and t.requires_grad]
            wrt_p = [(j, p) for j, p in enumerate(params) if needs[n + j]]
            if not pairs or not (wrt or wrt_p):
                continue
            got = torch.autograd.grad([o for o, _ in pairs], [t for _, t in wrt + wrt_p],
                                      [g for _, g in pairs], allow_unused=True)  # fmt: skip
            del pairs
            for (i, _), g in zip(wrt, got[: len(wrt)], strict=True):
                if g is None:
                    continue
                if call.split[i]:
                    full = grads_in[i]
                    if full is None:
                        full = grads_in[i] = torch.zeros_like(self.inputs[i])
                    full.narrow(call.dim, a, b - a).copy_(g)
                else:
                    have = grads_in[i]
                    grads_in[i] = g if have is None else have + g
            for (j, _), g in zip(wrt_p, got[len(wrt):], strict=True):
                if g is not None:
                    have = grads_p[j]
                    if have is None:  # may be a view of the output's gradient: not ours
                        grads_p[j] = g
                    elif j in owned:
                        have.add_(g)
                    else:
                        grads_p[j] = have + g
                        owned.add(j)
        return [*grads_in, *grads_p]


def _empty_as(part: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """An empty tensor of ``shape`` laid out as ``part`` is: a channels-last output stays
    channels-last, as the whole block's would be, so that the next block computes (and
    draws its dropout masks, which follow the memory order) as under autograd."""
    fmt = {4: torch.channels_last, 5: torch.channels_last_3d}.get(part.dim())
    if fmt is not None and not part.is_contiguous() and part.is_contiguous(memory_format=fmt):
        return torch.empty(shape, dtype=part.dtype, device=part.device, memory_format=fmt)
    return part.new_empty(shape)


def _span(replay: BatchDraws | None, a: int, b: int, *,
          recompute: bool = False) -> contextlib.AbstractContextManager[None]:  # fmt: skip
    """Rows ``a:b`` handed their part of the whole batch's draws (where there are any)."""
    if replay is None:
        return contextlib.nullcontext()
    return replay.span(a, b, recompute=recompute)


def _autocast_now(inputs: Sequence[torch.Tensor]) -> tuple[str, torch.dtype] | None:
    """The autocast the forward ran under (device type, dtype), for the recomputation:
    a custom Function's backward runs outside it."""
    kinds = {t.device.type for t in inputs} | {"cpu"}
    for kind in sorted(kinds):
        if torch.is_autocast_enabled(kind):
            return kind, torch.get_autocast_dtype(kind)
    return None


def _autocast(state: tuple[str, torch.dtype] | None) -> Any:
    if state is None:
        return contextlib.nullcontext()
    return torch.autocast(state[0], dtype=state[1])


class Fragmenter:
    """Runs one checkpointed block (or segment of blocks) in ``fragments`` pieces of the
    batch where it can (module docstring), and says why not where it cannot.

    Args:
        modules: the block's modules (their parameters get the gradients).
        fragments: how many pieces of the batch.
        dim: the dimension cut: 0, the batch; 1, the sequence of batch-first token-wise
            modules (an MLP, a norm: what the probe finds position by position).
    """

    def __init__(self, modules: Sequence[nn.Module], *, fragments: int, dim: int = 0) -> None:
        self.modules = list(modules)
        self.fragments = fragments
        self.dim = dim
        self.bn = dim == 0 and frozen_batchnorm(self.modules)
        self.static = static_reason(self.modules) if dim else split_reason(self.modules)
        self._probed: dict[Any, tuple[str | None, tuple[int, ...], tuple[Drawn, ...]]] = {}
        self._overwritten: dict[Any, frozenset[int]] = {}  # BatchNorm calls written in place
        self.last: str | None = self.static
        """Why the last call ran whole (``None``: it ran in fragments)."""

    def __call__(self, fn: Callable[..., Any], whole: Callable[..., Any], *args: Any,
                 **kwargs: Any) -> Any:  # fmt: skip
        """``fn(*args, **kwargs)`` in fragments, or ``whole(*args, **kwargs)`` (plain
        checkpointing) where the block cannot be split."""
        if self.static is not None or not torch.is_grad_enabled():
            return whole(*args, **kwargs)
        leaves, spec = pytree.tree_flatten((args, kwargs))
        tensors = [v for v in leaves if isinstance(v, torch.Tensor)]
        first: str | None = None
        for dim in self._dims():
            call = self._prepare(fn, spec, leaves, tensors, dim)
            if isinstance(call, str):
                first = first or call
                continue
            if self._verdict(call, tensors) is None:
                self.last = None
                return call.output(_apply(call, tensors, call.params))
            first = first or self.last
        self.last = first
        return whole(*args, **kwargs)

    def _dims(self) -> tuple[int, ...]:
        """The dimensions tried, in order: the batch, then — for blocks without BatchNorm —
        the second dimension, where a time-first layer (``(T, N, ...)``: leangrad's
        ``GRULayer``, ``nn.GRU`` without ``batch_first``) keeps its examples; the probe
        decides, so a block that mixes along it runs whole."""
        return (0, 1) if self.dim == 0 and not self.bn else (self.dim,)

    def _prepare(self, fn: Callable[..., Any], spec: Any, leaves: list[Any],
                 tensors: list[torch.Tensor], dim: int) -> _Call | str:  # fmt: skip
        """The call cut along ``dim``, or why there is nothing to cut."""
        batched = [t for t in tensors if t.dim() > dim]
        if not batched or batched[0].shape[dim] < 2:
            return f"one {DIM_NAMES[dim]}: nothing to split"
        rows = batched[0].shape[dim]
        split = [t.dim() > dim and t.shape[dim] == rows for t in tensors]
        slots: list[Any] = []
        count = 0
        for v in leaves:
            if isinstance(v, torch.Tensor):
                slots.append(_Slot(count))
                count += 1
            else:
                slots.append(v)
        params = [p for m in self.modules for p in m.parameters() if p.requires_grad]
        call = _Call(fn=fn, spec=spec, leaves=slots, split=split,
                     edges=fragment_edges(rows, self.fragments), n_tensors=len(tensors),
                     dim=dim, bn=self.bn and dim == 0)  # fmt: skip
        call.params = list({id(p): p for p in params}.values())
        return call

    def _verdict(self, call: _Call, tensors: list[torch.Tensor]) -> str | None:
        """Why ``call`` cannot run in fragments (probed once per kind of call), or ``None``;
        sets :attr:`last` and ``call.out_dims``."""
        dim, split, slots = call.dim, call.split, call.leaves
        key = (dim, tuple((_shape_but(t.shape, dim if s else None), t.dtype, t.device, s,
                           t.requires_grad)
                          for t, s in zip(tensors, split, strict=True)), repr(call.spec),
               tuple(repr(v) for v in slots if not isinstance(v, _Slot)),
               any(is_fake(t) for t in tensors),
               tuple(m.training for root in self.modules for m in root.modules()))  # fmt: skip
        verdict = self._probed.get(key)
        if verdict is None:
            pair = _differing_rows(tensors, split, dim)
            verdict = self._probe(call, tensors, call.params, pair=pair or 1)
            self._overwritten[key] = call.overwritten
            if pair is not None:  # all examples equal: this batch cannot show mixing
                self._probed[key] = verdict
        self.last, call.out_dims, call.draws = verdict
        call.overwritten = self._overwritten.get(key, frozenset())
        return self.last

    def _draws(self, probe: _Call, tensors: list[torch.Tensor], seen: Draws, start: Any,
               devices: list[int], frozen: Callable[[], Any],
               ) -> tuple[tuple[Drawn, ...], str | None]:  # fmt: skip
        """The draws of the probe's two examples (``seen``) laid out for replay in pieces:
        one example run alone from the same generator states (``start``), each draw's
        shape compared (:func:`~leangrad.engines._batch_draws.layout`); with why they
        cannot be replayed, or ``None``. The generators are left at ``start``."""
        set_rng_states(start, devices)
        with torch.no_grad(), frozen(), Draws(self.modules, root_name="the block") as single:
            probe.run(probe.piece(tensors, 0, 1))
        draws, why = layout(seen.shapes, single.shapes, n_whole=2, n_piece=1,
                            pieces="fragments", option="fragments=")  # fmt: skip
        set_rng_states(start, devices)
        return draws, why

    def _probe(self, call: _Call, tensors: list[torch.Tensor], params: list[nn.Parameter], *,
               pair: int) -> tuple[str | None, tuple[int, ...], tuple[Drawn, ...]]:  # fmt: skip
        """Why this call cannot run in fragments (module docstring), or ``None``, each
        output's batch dimension (where two examples give 2 and one gives 1: an LSTM's
        ``(h, c)`` have it second) and the random draws the fragments replay (cut along
        the batch, where each draw's shape follows it or is shared: :mod:`._batch_draws`;
        the examples alone are run with the two's draws replayed). The probe's two
        examples are the first and the ``pair``-th (one that differs from the first: equal
        ones would hide mixing)."""
        d = call.dim
        tensors = [torch.cat([t.narrow(d, 0, 1), t.narrow(d, pair, 1)], d) if s else t
                   for t, s in zip(tensors, call.split, strict=True)]  # fmt: skip
        buffers = [(n, b) for m in self.modules for n, b in m.named_buffers()]
        saved = [(b, b._version, b.detach().clone()) for _, b in buffers]
        # arguments passed whole go to every run of the probe as they are: a BatchNorm's
        # running statistics handed in as arguments (an fx split of a model passes them
        # so) would advance with each run; they are put back as the buffers are
        whole = [(t, t.detach().clone()) for t, s in zip(tensors, call.split, strict=True)
                 if not s and not is_fake(t)]  # fmt: skip
        own = bn_buffers(self.modules) if call.bn else set()  # they advance in the forward
        probe = _Call(fn=call.fn, spec=call.spec, leaves=call.leaves, split=call.split,
                      edges=[(0, 2)], n_tensors=call.n_tensors, dim=call.dim,
                      bn=call.bn)  # fmt: skip
        devices = sorted({t.device.index or 0 for t in tensors if t.device.type == "cuda"})
        draws: tuple[Drawn, ...] = ()
        try:
            # own saved-tensor hooks: inside a checkpointed block's forward, torch's
            # checkpoint would count the probe's saved tensors, which its recomputation
            # (probed already) does not save again; and they keep nothing, since the
            # probe's graph is walked, never differentiated (keep_nothing says why not the
            # tensors themselves: they stayed alive for good, one example's activations per
            # block, and the first step's peak was 1.1-1.5x the later ones' on the quick
            # GPT, BERT, ViT and U-Net)
            with torch.random.fork_rng(devices=devices, device_type="cuda"), aside(), \
                    torch.autograd.graph.saved_tensors_hooks(keep_nothing, keep_nothing):
                # both examples at once (under BatchNorm: its statistics kept), then each
                # alone (under BatchNorm: with the two's statistics frozen)
                start = rng_states(devices)
                capture: Any = capture_stats() if call.bn else contextlib.nullcontext()
                with torch.no_grad(), capture, Draws(self.modules, root_name="the block") as seen:
                    both = probe.run(probe.piece(tensors, 0, 2))
                drawn = seen.reason(pieces="fragments", option="fragments=")

                def frozen() -> Any:
                    return frozen_stats(capture.stats) if call.bn else contextlib.nullcontext()

                if drawn is not None and d == 0:  # replayed, where each draw's shape allows
                    after = rng_states(devices)
                    draws, drawn = self._draws(probe, tensors, seen, start, devices, frozen)
                replay = BatchDraws(draws, edges=(0, 1, 2), forward_only=False) if draws else None
                watch: Any = (Draws(self.modules, root_name="the block") if replay is None
                              else contextlib.nullcontext())  # fmt: skip
                with watch, torch.enable_grad(), frozen() as watched, _piece(replay, 0):
                    fresh = [t.detach().requires_grad_(t.requires_grad)
                             for t in probe.piece(tensors, 0, 1)]  # fmt: skip
                    one = probe.run(fresh)
                    outside = _outside_leaves(one, {id(t) for t in fresh}, params)
                    if call.bn:  # BatchNorm outputs an in-place op overwrote (ReLU(inplace))
                        call.overwritten = watched.written_in_place()
                with watch, torch.no_grad(), frozen(), _piece(replay, 1):
                    other = probe.run(probe.piece(tensors, 1, 2))
                if drawn is None and replay is None:
                    drawn = watch.reason(pieces="fragments", option="fragments=")
                if replay is not None and not all(
                        torch.equal(x, y) for x, y in zip(after, rng_states(devices),
                                                          strict=True)):  # fmt: skip
                    drawn = seen.reason(pieces="fragments", option="fragments=")
        except Exception as err:  # the block cannot run on a piece: run it whole
            first = (str(err).strip().splitlines() or [""])[0][:120]
            return FAILED.format(error=f"{type(err).__name__}: {first}"), (), ()
        finally:
            changed = _put_back(buffers, saved, whole, own)
        if drawn is not None:
            return drawn, (), ()
        if changed:
            return BUFFERS.format(names=", ".join(changed[:3])), (), ()
        if outside:
            return OUTSIDE.format(count=outside), (), ()
        why, dims = _apart(both, one, other)
        return (why, (), ()) if why is not None else (None, dims, draws)


def _put_back(buffers: list[tuple[str, torch.Tensor]],
              saved: list[tuple[torch.Tensor, int, torch.Tensor]],
              whole: list[tuple[torch.Tensor, torch.Tensor]], own: set[int]) -> list[str]:
    """The buffers and the arguments passed whole as they were before the probe; the names
    of the buffers it changed (but ``own``: a BatchNorm's, which advance in the forward)."""
    changed = [n for (n, _), (b, v, _) in zip(buffers, saved, strict=True)
               if b._version != v and id(b) not in own]  # fmt: skip
    with torch.no_grad():
        for b, _, value in saved:
            b.copy_(value)
        for t, value in whole:  # only what changed: a copy would bump versions
            if not torch.equal(t, value):
                t.copy_(value)
    return changed


def _apart(both: Sequence[torch.Tensor], one: Sequence[torch.Tensor],
           other: Sequence[torch.Tensor]) -> tuple[str | None, tuple[int, ...]]:  # fmt: skip
    """Why the outputs of two examples run at once (``both``) are not those of each run
    alone (``one``, ``other``) joined along a batch dimension, or ``None``; with each
    output's batch dimension."""
    dims: list[int] = []
    for i, (b, x, y) in enumerate(zip(both, one, other, strict=True)):
        at = _batch_dim(b.shape, x.shape)
        if at is None:
            return NOT_BATCH.format(index=i, shape=tuple(b.shape)), ()
        dims.append(at)
        if is_fake(b):  # a memory estimate on fake tensors: shapes only, no values
            continue
        apart = torch.cat([x.detach(), y], dim=at)
        if not b.is_floating_point():
            if not torch.equal(b, apart):
                return MIXES.format(diff=float("nan")), ()
            continue
        diff = float((b - apart).abs().max())
        scale = float(b.abs().max()) + 1e-30
        if not diff <= _tolerance(b.dtype) * scale:  # NaN differences fail too
            return MIXES.format(diff=diff), ()
    return None, tuple(dims)


def _piece(replay: BatchDraws | None, index: int) -> contextlib.AbstractContextManager[None]:
    return contextlib.nullcontext() if replay is None else replay.piece(index)


def _differing_rows(tensors: Sequence[torch.Tensor], split: Sequence[bool],
                    dim: int) -> int | None:  # fmt: skip
    """The first index along ``dim`` whose slice of the split tensors differs from the
    first's (1 on fake tensors, whose values are unknown); ``None`` when all are equal."""
    cut = [t for t, s in zip(tensors, split, strict=True) if s]
    if any(is_fake(t) for t in cut):
        return 1
    rows = cut[0].shape[dim]
    same = torch.ones(rows, dtype=torch.bool, device=cut[0].device)
    for t in cut:
        moved = t.detach().movedim(dim, 0).reshape(rows, -1)
        same &= (moved == moved[:1]).all(dim=1)
    differ = (~same).nonzero()
    return int(differ[0, 0]) if differ.numel() else None


def _shape_but(shape: torch.Size, dim: int | None) -> tuple[int, ...]:
    return tuple(v for i, v in enumerate(shape) if i != dim)


def _batch_dim(two: torch.Size, one: torch.Size) -> int | None:
    """The dimension that is 2 on two examples and 1 on one, all others equal."""
    if len(two) != len(one):
        return None
    for d, (p, q) in enumerate(zip(two, one, strict=True)):
        if p == 2 and q == 1 and two[:d] == one[:d] and two[d + 1:] == one[d + 1:]:
            return d
    return None


def _apply(call: _Call, tensors: list[torch.Tensor], params: list[nn.Parameter]) -> Any:
    call.params = params
    return _Fragmented.apply(call, *tensors, *params)


def _outside_leaves(outs: Sequence[torch.Tensor], fresh: set[int],
                    params: Sequence[nn.Parameter]) -> int:  # fmt: skip
    """How many leaves that require grad ``outs``' graph reaches besides the block's
    parameters and the probe's own inputs (ids in ``fresh``)."""
    known = {id(p) for p in params} | fresh
    leaves = (getattr(n, "variable", None) for n in graph_nodes(o.grad_fn for o in outs))
    return sum(1 for v in leaves if v is not None and id(v) not in known)
