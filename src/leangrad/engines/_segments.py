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
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch
from torch import nn

__all__ = ["auto_segments", "block_sizes", "estimate"]


def _bytes(t: torch.Tensor, seen: set[int]) -> int:
    st = t.untyped_storage()
    if st.data_ptr() in seen:
        return 0
    seen.add(st.data_ptr())
    return st.nbytes()


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

            def pack(t: torch.Tensor, seen: set[int] = seen, total: list[int] = total) -> object:
                total[0] += _bytes(t, seen)
                return t

            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
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
