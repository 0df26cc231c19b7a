"""Two-level checkpointing: the √L scheme applied to the block boundaries.

Per-block checkpointing (``checkpoint``) keeps every block's input — its *boundary* — for
the whole backward pass: L boundaries for L blocks. Where the blocks' internals are cut small
(fragments of the batch,
:mod:`leangrad.engines.checkpoint._fragments`), those boundaries are most of
what is left of the peak (~60% on the full GPT with ``fragments=8``). Chen et al. (2016,
"Training deep nets with sublinear memory cost") keep only every ``√L``-th boundary and
recompute the rest; applied one level up:

- the blocks, in the order the model calls them, form ``s`` outer segments (``√L`` by
  default). During the forward pass only the *first* input of each segment is kept; the
  inputs of the segment's other blocks are dropped — each block is still checkpointed on
  its own, but its saved input is replaced by a recipe (which segment, which position);
- during the backward pass, when a segment's first recipe is unpacked (its last block's
  recomputation: the first of its blocks the backward reaches), the segment's blocks are
  run forward once more from the kept input, which rebuilds the boundaries; nothing of
  that run's graph is kept (each block call is made as the forward made it — under
  checkpoint, or in the same fragments of the batch — and only its output is kept,
  detached), and each boundary is kept only until its block's recomputation takes it.
  Each block then recomputes its internals as under plain checkpointing (in fragments,
  with ``fragments=k``).

Memory: ``s`` kept inputs plus one segment's ``L/s`` boundaries instead of ``L``, for about
one more forward pass of the blocks. It works on models written the ordinary way (a class
whose ``forward`` loops over its blocks) through a ``saved_tensors_hooks`` pack hook
around each block's checkpoint: torch's non-reentrant checkpoint (and the fragments'
autograd function) save the block's arguments as saved tensors, and the hook swaps the
one that is the previous block's output for its recipe.

Exactness: a block's input is dropped only where it *is* the previous block call's output
— the same tensor object, not changed in place since (its version counter) — so running
that block again rebuilds it; any other input (something the model's code computed between
blocks, the first block's input, a block called out of order) is kept as before. The
rebuild replays each block call as the forward made it: its other arguments, the global
RNG streams (CPU and the devices of its tensors) and the generators its layers own as they
were when it started (dropout draws the same masks), and the forward's autocast. It leaves
the RNG streams and generators where it found them; BatchNorm's running statistics that
the rebuild moves are put back at the end of the step, as for every recomputation
(:class:`~leangrad.engines._contract.BufferGuard`). A kept input changed in place after the
forward used it is refused when its segment is rebuilt (as checkpoint's own saved inputs
are). A block call made inside another one (a block's wrapper reached inside another
block) is not a link of the chain: it runs as it is, recomputed with the block around it;
chained, it would have been taken for the next block and its output rebuilt in place of
the outer block's (a wrong gradient).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import math
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.utils import _pytree as pytree
from torch.utils.checkpoint import get_device_states, set_device_states

from ... import _errors as errors
from .._generators import layer_generators

__all__ = ["ARGUMENT_CHANGED", "BAD_LEVELS", "INPUT_CHANGED", "LEVELS_AND_AUTO",
           "LEVELS_AND_CHUNKS", "TwoLevel", "TwoLevelStats", "outer_segments"]  # fmt: skip

BAD_LEVELS = "levels must be 1 (per-block checkpointing) or 2 (two-level), got {value!r}"
LEVELS_AND_AUTO = (
    "segments='auto' measures where to cut one level of checkpoints and cannot be combined "
    "with levels=2, whose segments are outer groups of blocks; give segments an int or 'sqrt'"
)
LEVELS_AND_CHUNKS = (
    "time_chunks= and levels=2 cannot be combined: time chunks checkpoint fused recurrent "
    "modules alone, outside the blocks; drop one of them"
)
INPUT_CHANGED = (
    "levels=2 cannot rebuild the boundaries of the outer segment that starts at block call "
    "{index} ({block}): its input, kept since the forward pass, was changed in place after "
    "the block used it (version {then} -> {now}), so the blocks would no longer compute what "
    "the forward computed; do not modify a block's input in place after the block ran, or "
    "use levels=1"
)
ARGUMENT_CHANGED = (
    "levels=2 cannot rebuild the boundaries after block {block}: a tensor argument it was "
    "called with was changed in place after the call (version {then} -> {now}), so running "
    "it again would not compute what the forward computed; do not modify a block's "
    "arguments in place after the block ran, or use levels=1"
)


def outer_segments(n_blocks: int, segments: int | str | None) -> int:
    """How many outer segments ``levels=2`` makes of ``n_blocks`` block calls: ⌈√L⌉ for
    ``None`` or ``"sqrt"``, else ``segments`` (at most one per block)."""
    n = max(1, n_blocks)
    if segments is None or segments == "sqrt":
        return max(1, math.ceil(math.sqrt(n)))
    return max(1, min(int(segments), n))


@dataclasses.dataclass
class TwoLevelStats:
    """What one step's two levels did: outer segments formed, block inputs dropped in the
    forward (replaced by a recipe), boundaries rebuilt in the backward."""

    segments: int = 0
    dropped: int = 0
    rebuilt: int = 0

    def info(self) -> dict[str, int]:
        return {"segments": self.segments, "dropped": self.dropped, "rebuilt": self.rebuilt}


@dataclasses.dataclass(frozen=True)
class _Slot:
    """Where the block's input stood among its call's argument leaves."""


_INPUT = _Slot()


@dataclasses.dataclass(frozen=True)
class _Recipe:
    """What a dropped input is saved as: its position in its outer segment."""

    pos: int


@dataclasses.dataclass
class _Rng:
    """The random state a block call started from: the CPU stream, the streams of the
    devices its tensors live on, and the generators its layers own."""

    cpu: torch.Tensor
    device_type: str
    devices: list[int]
    device_states: list[torch.Tensor]
    generators: list[tuple[torch.Generator, torch.Tensor]]

    @staticmethod
    def now(tensors: Sequence[torch.Tensor], gens: Sequence[torch.Generator]) -> _Rng:
        one = {t.device: t for t in tensors if t.device.type not in ("cpu", "meta")}
        kinds = {d.type for d in one}
        with unset_fake_temporarily():
            devices, states = get_device_states(*one.values()) if one else ([], [])
            return _Rng(torch.get_rng_state(), min(kinds) if kinds else "cuda", devices,
                        states, [(g, g.get_state()) for g in gens])  # fmt: skip

    def restore(self) -> None:
        with unset_fake_temporarily():
            torch.set_rng_state(self.cpu)
            if self.devices:
                set_device_states(self.devices, self.device_states, device_type=self.device_type)
            for g, s in self.generators:
                g.set_state(s)


def _autocast_state(device_type: str) -> list[tuple[str, bool, torch.dtype, bool]]:
    """The autocast state of the CPU and of ``device_type`` (enabled, dtype, cache), to run
    a block again under what its forward ran under (the backward runs outside it)."""
    out = []
    for kind in dict.fromkeys(("cpu", device_type)):
        if torch.amp.is_autocast_available(kind):
            out.append((kind, torch.is_autocast_enabled(kind), torch.get_autocast_dtype(kind),
                        torch.is_autocast_cache_enabled()))  # fmt: skip
    return out


@dataclasses.dataclass
class _Step:
    """One block call of the forward pass, as the rebuild replays it: ``fn`` is the call
    the forward made (the block under checkpoint, or in fragments of the batch)."""

    fn: Callable[..., Any]
    name: str
    grad: bool  # whether the input required grad
    spec: pytree.TreeSpec
    leaves: list[Any]  # the arguments' leaves, the input replaced by _INPUT
    versions: list[tuple[torch.Tensor, int]]  # the other tensor arguments, their versions
    rng: _Rng
    autocast: list[tuple[str, bool, torch.dtype, bool]]
    out_index: int = -1  # which output leaf is the next block's input (set when it links)

    def rerun(self, x: torch.Tensor) -> torch.Tensor:
        """The block's output leaf that the next block took, from input ``x``: the call is
        made as the forward made it — with grad enabled, so that a block the forward ran in
        fragments of the batch runs in the same fragments (and the same kernels run) — and
        its graph, which saved nothing but the arguments, dropped with the result's
        detach."""
        for t, v in self.versions:
            if t._version != v:
                raise errors.EngineInputError(ARGUMENT_CHANGED.format(
                    block=self.name, then=v, now=t._version))  # fmt: skip
        self.rng.restore()
        x = x.detach().requires_grad_(self.grad)
        args, kwargs = pytree.tree_unflatten([x if v is _INPUT else v for v in self.leaves],
                                             self.spec)  # fmt: skip
        with contextlib.ExitStack() as stack:
            for kind, on, dtype, cache in self.autocast:
                stack.enter_context(torch.autocast(kind, enabled=on, dtype=dtype,
                                                   cache_enabled=cache))  # fmt: skip
            stack.enter_context(torch.enable_grad())
            out = self.fn(*args, **kwargs)
        leaf = pytree.tree_leaves(out)[self.out_index]
        assert isinstance(leaf, torch.Tensor)
        return leaf.detach()


class _Segment:
    """An outer segment: its kept first input, its block calls, and the boundaries rebuilt
    for its backward (each dropped once its block's recomputation took it)."""

    def __init__(self, first: torch.Tensor, index: int, stats: TwoLevelStats) -> None:
        self.first = first
        self.version = first._version
        self.index = index
        self.stats = stats
        self.steps: list[_Step] = []
        self.cache: dict[int, torch.Tensor] = {}
        self.waiting: collections.Counter[int] = collections.Counter()

    def boundary(self, pos: int) -> torch.Tensor:
        """The input of the segment's ``pos``-th block, rebuilt with every earlier boundary
        still waiting on the first request."""
        if pos not in self.cache:
            self._rebuild(pos)
        t = self.cache[pos]
        self.waiting[pos] -= 1
        if self.waiting[pos] <= 0:
            del self.cache[pos]
        return t

    def _rebuild(self, upto: int) -> None:
        if self.first._version != self.version:
            raise errors.EngineInputError(INPUT_CHANGED.format(
                index=self.index, block=self.steps[0].name, then=self.version,
                now=self.first._version))  # fmt: skip
        steps = self.steps[:upto]
        now = _Rng.now([t for s in steps for t in s.leaves if isinstance(t, torch.Tensor)]
                       + [self.first], [g for s in steps for g, _ in s.rng.generators])  # fmt: skip
        x = self.first
        try:
            for pos, step in enumerate(steps, start=1):
                x = step.rerun(x)
                if pos == upto or self.waiting[pos] > 0:
                    self.cache[pos] = x
                self.stats.rebuilt += 1
        finally:
            now.restore()


class _Packer:
    """The ``saved_tensors_hooks`` around one block call: the block's input, where it is
    the previous block's output, is saved as a recipe; every other tensor as itself. It
    holds the input only while the block runs (torch keeps the hooks as long as what they
    saved)."""

    def __init__(self, segment: _Segment, pos: int, target: torch.Tensor) -> None:
        self.segment = segment
        self.pos = pos
        self.target: torch.Tensor | None = target

    def pack(self, t: torch.Tensor) -> Any:
        if self.target is not None and t is self.target:
            self.segment.waiting[self.pos] += 1
            self.segment.stats.dropped += 1
            return _Recipe(self.pos)
        return t

    def unpack(self, saved: Any) -> torch.Tensor:
        if isinstance(saved, _Recipe):
            return self.segment.boundary(saved.pos)
        assert isinstance(saved, torch.Tensor)
        return saved


class _Run:
    """One forward pass: block calls counted in order, chained into outer segments."""

    def __init__(self, segment_of: Callable[[int], int]) -> None:
        self.segment_of = segment_of
        self.stats = TwoLevelStats()
        self.calls = 0
        self.current: _Segment | None = None
        self.current_id = -1
        self.last: list[tuple[weakref.ref[torch.Tensor], int] | None] = []
        self.running = False  # a block call is under way: a call now is nested in it

    def _link(self, x: torch.Tensor) -> int | None:
        """The index of the previous call's output leaf that ``x`` is, unchanged."""
        for i, entry in enumerate(self.last):
            if entry is not None and entry[0]() is x and x._version == entry[1]:
                return i
        return None

    def call(self, block: nn.Module, name: str, fn: Callable[..., Any],
             args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:  # fmt: skip
        if self.running:  # nested in a block call: recomputed with it, never a boundary
            return fn(*args, **kwargs)
        self.running = True
        try:
            return self._chain(block, name, fn, args, kwargs)
        finally:
            self.running = False

    def _chain(self, block: nn.Module, name: str, fn: Callable[..., Any],
               args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:  # fmt: skip
        """One block call, chained into the outer segments (:meth:`call`)."""
        index = self.calls
        self.calls += 1
        leaves, spec = pytree.tree_flatten((args, kwargs))
        at = next((i for i, v in enumerate(leaves) if isinstance(v, torch.Tensor)), None)
        if at is None:  # nothing to keep or drop; the chain breaks here
            self.current, self.last = None, []
            return fn(*args, **kwargs)
        x = leaves[at]
        seg_id = self.segment_of(index)
        seg = self.current
        link = self._link(x) if seg is not None and seg_id == self.current_id else None
        if seg is None or link is None:
            seg = _Segment(x, index, self.stats)
            self.stats.segments += 1
        else:
            seg.steps[-1].out_index = link
        self.current, self.current_id = seg, seg_id
        pos = len(seg.steps)
        tensors = [v for v in leaves if isinstance(v, torch.Tensor)]
        seg.steps.append(_Step(
            fn=fn, name=name, grad=x.requires_grad, spec=spec,
            leaves=[_INPUT if i == at else v for i, v in enumerate(leaves)],
            versions=[(t, t._version) for i, t in enumerate(leaves)
                      if isinstance(t, torch.Tensor) and i != at],
            rng=_Rng.now(tensors, layer_generators([block])),
            autocast=_autocast_state(x.device.type)))  # fmt: skip
        if pos == 0:
            out = fn(*args, **kwargs)
        else:
            packer = _Packer(seg, pos, x)
            try:
                with torch.autograd.graph.saved_tensors_hooks(packer.pack, packer.unpack):
                    out = fn(*args, **kwargs)
            finally:
                packer.target = None
        del x, tensors, leaves
        self.last = [(weakref.ref(v), v._version) if isinstance(v, torch.Tensor) else None
                     for v in pytree.tree_leaves(out)]  # fmt: skip
        return out


class TwoLevel:
    """The two levels for one prepared model: block calls ``0 .. n-1`` of each forward in
    ``segments`` outer segments (contiguous, near-equal), and the forward pass now running.

    Args:
        n_blocks: how many block calls a forward makes (the blocks found); later calls
            belong to the last segment.
        segments: how many outer segments.
    """

    def __init__(self, n_blocks: int, segments: int) -> None:
        self.n_blocks = max(1, n_blocks)
        self.segments = max(1, min(segments, self.n_blocks))
        bounds = [round(i * self.n_blocks / self.segments) for i in range(self.segments + 1)]
        self._seg = [j for j in range(self.segments) for _ in range(bounds[j], bounds[j + 1])]
        self._run: _Run | None = None

    def segment_of(self, call: int) -> int:
        """The outer segment of the ``call``-th block call of a forward."""
        return self._seg[min(call, self.n_blocks - 1)]

    @contextlib.contextmanager
    def forward(self) -> Iterator[TwoLevelStats]:
        """One forward pass whose block calls chain into outer segments; yields the step's
        counts (``rebuilt`` fills in during the backward)."""
        run = _Run(self.segment_of)
        self._run = run
        try:
            yield run.stats
        finally:
            self._run = None
            run.current, run.last = None, []

    def call(self, block: nn.Module, name: str, fn: Callable[..., Any],
             args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:  # fmt: skip
        """``fn(*args, **kwargs)`` — a call of the checkpointed ``block`` (``name``: in
        errors) — inside the current forward's outer segments; a rebuild calls ``fn``
        again. Outside :meth:`forward` (or without grad): ``fn`` as it is."""
        state = self._run
        if state is None or not torch.is_grad_enabled():
            return fn(*args, **kwargs)
        return state.call(block, name, fn, args, kwargs)
