"""``segments="auto"``: segment boundaries chosen from measured block sizes.

Checkpointing a sequence of blocks in segments keeps, through the backward pass, the
input of every segment but the last, plus — at the worst moment — the activations of
one segment being recomputed (or of the last segment, never dropped). With ``a_i`` the
bytes of block i's input and ``s_i`` the bytes autograd saves inside block i, a split
into contiguous segments costs about

    Σ_{segments k but the last} a_first(k)  +  max_k Σ_{i ∈ k} s_i

(Chen et al. 2016, section 4.1, with measured sizes instead of equal ones). One forward
with saved-tensor hooks measures ``a_i`` and ``s_i`` (the RNG is forked and statistics
are put back, so the step itself is unchanged); the split is then the best of every
greedy split under a cap on segment activations, and of every equal split by count
(so it is never estimated worse than ``checkpoint_sequential`` with any segment count).

:func:`saved_inside` sizes the blocks of any model for ``fragment_blocks=n``:
the bytes autograd saves inside each block during one forward, on fake tensors (shapes
only: nothing is allocated or computed, the model's tensors are untouched).
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from .._contract import keep_nothing

__all__ = ["auto_segments", "block_sizes", "estimate", "largest", "saved_inside"]


def _key(t: torch.Tensor) -> int:
    """The identity of ``t``'s storage: its C++ object, not ``data_ptr()``, which is 0 for
    every fake tensor (a step estimated on fake tensors would count one tensor and call the
    rest seen) and warns there."""
    return int(t.untyped_storage()._cdata)


def _bytes(t: torch.Tensor, seen: set[int]) -> int:
    key = _key(t)
    if key in seen:
        return 0
    seen.add(key)
    return t.untyped_storage().nbytes()


def block_sizes(
    blocks: Sequence[nn.Module], xs: tuple[torch.Tensor, ...]
) -> tuple[list[int], list[int]]:
    """``(a, s)``: each block's input bytes and the bytes autograd saves inside it."""
    a: list[int] = []
    s: list[int] = []
    owners = [m for b in blocks for m in b.modules()]
    saved_buffers = [(b, b.detach().clone()) for m in owners for b in m.buffers(recurse=False)]
    devices = [x.device for x in xs if x.device.type == "cuda"]
    with torch.random.fork_rng(devices=devices), torch.enable_grad():
        args: tuple[object, ...] = xs
        own: set[int] = set()  # parameters and buffers exist anyway: not counted
        for m in owners:
            for t in [*m.parameters(recurse=False), *m.buffers(recurse=False)]:
                _bytes(t, own)
        for block in blocks:
            seen_in: set[int] = set(own)
            a.append(sum(_bytes(x, seen_in) for x in args if isinstance(x, torch.Tensor)))
            # An input the block saves counts in s too: inside a segment it is the previous
            # block's output, which the recomputation holds (for a segment's first block it
            # is the kept input, counted twice: a slight overestimate).
            seen: set[int] = set(own)
            total = [0]

            def count(t: torch.Tensor, seen: set[int] = seen, total: list[int] = total) -> None:
                total[0] += _bytes(t, seen)

            with _counted(count):
                out = block(*args)
            s.append(total[0])
            if isinstance(out, torch.Tensor):  # as in the real step: the next input needs grad
                out = out.detach().requires_grad_(out.is_floating_point())
            args = (out,)
            del out
    with torch.no_grad():
        for b, value in saved_buffers:
            b.copy_(value)
    return a, s


def estimate(groups: Sequence[range], a: Sequence[int], s: Sequence[int]) -> int:
    """The peak estimate of the module docstring for a split into ``groups``."""
    kept = sum(a[g[0]] for g in groups[:-1])
    return kept + max(sum(s[i] for i in g) for g in groups)


def _greedy(cap: int, s: Sequence[int]) -> list[range]:
    groups: list[range] = []
    start, total = 0, 0
    for i, si in enumerate(s):
        if i > start and total + si > cap:
            groups.append(range(start, i))
            start, total = i, 0
        total += si
    groups.append(range(start, len(s)))
    return groups


def _equal(n: int, k: int) -> list[range]:
    bounds = [round(i * n / k) for i in range(k + 1)]
    return [range(x, y) for x, y in itertools.pairwise(bounds) if x < y]


def auto_segments(a: Sequence[int], s: Sequence[int]) -> list[range]:
    """The split with the lowest estimate (ties: fewer segments, i.e. less recomputation
    bookkeeping), among greedy splits under every cap and equal splits by count."""
    n = len(s)
    caps = sorted({sum(s[i:j]) for i in range(n) for j in range(i + 1, n + 1)})
    if len(caps) > 256:  # O(n^3) otherwise; 256 quantiles of the caps are plenty
        caps = [caps[round(q * (len(caps) - 1) / 255)] for q in range(256)]
    candidates = [_greedy(c, s) for c in caps] + [_equal(n, k) for k in range(1, n + 1)]
    return min(candidates, key=lambda g: (estimate(g, a, s), len(g)))


@contextlib.contextmanager
def _fakes_swapped(root: nn.Module, mode: FakeTensorMode) -> Iterator[None]:
    """Every parameter and buffer of ``root`` replaced by a fake of it (a tensor held by
    several modules or names: one fake) while the context is open, and put back after it,
    once per module and slot. Not ``torch.func.functional_call``: it swaps by name, and a module
    registered under two names (a block used twice, ``nn.Sequential(lin, act, lin)``) is
    swapped twice — its second swap saves the first's fake as the "original", which it then
    puts back, leaving the user's model holding fake tensors (torch 2.13)."""
    slots: list[tuple[dict[str, Any], str, torch.Tensor]] = []
    fakes: dict[int, torch.Tensor] = {}
    for m in root.modules():  # each module once, however many names it has
        tables: tuple[dict[str, Any], ...] = (m._parameters, m._buffers)
        for table in tables:
            for name, t in table.items():
                if t is None:
                    continue
                if id(t) not in fakes:
                    with mode:
                        fakes[id(t)] = mode.from_tensor(t)
                slots.append((table, name, t))
    try:
        for table, name, t in slots:
            table[name] = fakes[id(t)]
        yield
    finally:
        for table, name, t in slots:
            table[name] = t


def saved_inside(root: nn.Module, run: Callable[..., object], modules: Mapping[str, nn.Module],
                 inputs: tuple[torch.Tensor, ...]) -> dict[str, int]:  # fmt: skip
    """The bytes autograd saves inside each of ``modules`` (by name) during ``run(*inputs)``,
    ``root`` holding every tensor it reads: the internals a block's recomputation holds at
    once (its inputs, kept by checkpointing anyway, and the parameters and buffers are not
    counted; a tensor saved twice counts once). Measured on fake tensors under
    ``FakeTensorMode``: shapes only, nothing allocated, the real parameters, buffers and
    RNG untouched (:func:`_fakes_swapped`). A block called more than once (one module at
    several places of the model, under one name or several) is sized by its largest call,
    what one recomputation of it holds, and every name of it gets that size. Raises what
    the forward raises on fake tensors (a step that reads values)."""
    names_of: dict[int, list[str]] = {}
    for name, module in modules.items():
        names_of.setdefault(id(module), []).append(name)
    by_module = dict.fromkeys(names_of, 0)
    stack: list[tuple[int, set[int], list[int]]] = []  # the running block, its inputs'
    seen: set[int] = set()  # storages, the bytes its call saved so far

    def count(t: torch.Tensor) -> None:
        if stack and _key(t) not in stack[-1][1] and _key(t) not in seen:
            seen.add(_key(t))
            stack[-1][2][0] += t.untyped_storage().nbytes()

    def enter(m: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        ins = [v for v in (*args, *kwargs.values()) if isinstance(v, torch.Tensor)]
        stack.append((id(m), {_key(v) for v in ins}, [0]))

    def leave(_m: nn.Module, _args: object, _out: object) -> None:
        at, _, saved = stack.pop()
        by_module[at] = max(by_module[at], saved[0])

    handles = []
    for names in names_of.values():  # one pair of hooks per module, not per name
        module = modules[names[0]]
        handles += [module.register_forward_pre_hook(enter, with_kwargs=True),
                    module.register_forward_hook(leave)]  # fmt: skip
    devices = [x.device for x in inputs if x.device.type == "cuda"]
    try:
        mode = FakeTensorMode()
        with mode:
            fake = tuple(mode.from_tensor(x) for x in inputs)
        with _fakes_swapped(root, mode):
            # parameters, buffers: not activations
            seen.update(_key(t) for m in root.modules()
                        for t in (*m._parameters.values(), *m._buffers.values())
                        if t is not None)  # fmt: skip
            with torch.random.fork_rng(devices=devices), torch.enable_grad(), \
                    _counted(count), mode:
                run(*fake)
    finally:
        for h in handles:
            h.remove()
    return {n: by_module[i] for i, names in names_of.items() for n in names}


@contextlib.contextmanager
def _counted(count: Callable[[torch.Tensor], None]) -> Iterator[None]:
    """Saved-tensor hooks for a measuring forward, whose graph is never differentiated:
    ``count`` sees each tensor autograd saves, and a list of the measurement's own keeps it
    alive until the measurement ends (storage keys stay distinct while they are counted),
    not the graph (:func:`~leangrad.engines._contract.keep_nothing` says why: a graph
    holding its saved outputs itself kept them for good)."""
    kept: list[torch.Tensor] = []

    def pack(t: torch.Tensor) -> None:
        count(t)
        kept.append(t)

    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, keep_nothing):
            yield
    finally:
        kept.clear()


def largest(sizes: Mapping[str, int], n: int) -> list[str]:
    """The ``n`` names with the largest sizes (ties: the earlier first), in their order."""
    order = list(sizes)
    top = set(sorted(order, key=lambda k: (-sizes[k], order.index(k)))[:n])
    return [k for k in order if k in top]
