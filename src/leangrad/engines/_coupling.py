"""Which layers couple the examples of a batch: why running pieces of it one after
another (accumulate's micro-batches, checkpoint's fragments) would not add up to the
whole batch's gradient. Shared by :mod:`leangrad.engines._transforms` and
:mod:`leangrad.engines.checkpoint._fragments`, which both import it from below.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import is_fake
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.dropout import _DropoutNd
from torch.nn.modules.instancenorm import _InstanceNorm
from torch.utils import _pytree as pytree

from .. import _errors as errors
from ._batch_draws import BatchDraws, Drawn, layout, rng_states, set_rng_states
from ._draws import DRAWS, Draws

__all__ = ["BATCH_COUPLED", "RANDOM_LAYER", "Watched", "batch_coupling", "watched_coupling"]

BATCH_COUPLED = (
    "{name} ({kind}) couples the examples of a batch in training mode (its statistics are "
    "the batch's), so {pieces} would not compute the whole batch's gradient; put it "
    "in eval mode, use GroupNorm/LayerNorm, or leave out {option}"
)
RANDOM_LAYER = (
    "{name} ({kind}, p={p}) draws its masks per forward: {pieces} would draw other "
    "masks than one forward of the whole batch (another gradient than autograd's); set "
    "p=0 or eval mode for it, or leave out {option}"
)


def batch_coupling(model: nn.Module, *, pieces: str = "micro-batches",
                   option: str = "accumulate", root: str = "the model",
                   skip_batchnorm: bool = False, random: bool = True) -> str | None:  # fmt: skip
    """Why ``pieces`` of the batch run through ``model`` one after another would not add up
    to the whole batch's gradient (a training-mode layer whose output depends on the other
    examples, or one that draws random masks), or ``None``; the message's fix is to leave
    out ``option``. ``skip_batchnorm``: BatchNorm layers are not counted (the caller
    handles them); ``random=False``: layers drawing masks are not counted (accumulate replays
    the whole batch's draws, :mod:`._batch_draws`)."""
    for name, m in model.named_modules():
        if not m.training:
            continue
        where = repr(name) if name else root
        if isinstance(m, _BatchNorm) and skip_batchnorm:
            continue
        if isinstance(m, _BatchNorm) or (isinstance(m, _InstanceNorm)
                                         and m.track_running_stats):  # fmt: skip
            return BATCH_COUPLED.format(name=where, kind=type(m).__name__, pieces=pieces,
                                        option=option)  # fmt: skip
        p = m.p if isinstance(m, _DropoutNd) else (
            m.dropout if isinstance(m, nn.RNNBase) and m.num_layers > 1 else 0)  # fmt: skip
        if p > 0 and random:
            return RANDOM_LAYER.format(name=where, kind=type(m).__name__, p=p, pieces=pieces,
                                       option=option)  # fmt: skip
    return None


CHANGES_BUFFERS = (
    "{names} change in the model's forward, which {pieces} would change once per piece "
    "instead of once; put the module in eval mode, or leave out {option}"
)
MIXES_EXAMPLES = (
    "the model mixes the examples of its batch (run on two examples at once and on each "
    "alone, output {index} differs by {diff:.3g}), so {pieces} would not compute the whole "
    "batch's gradient; leave out {option}"
)


@dataclasses.dataclass(frozen=True)
class Watched:
    """What one watched forward says about running a batch in pieces: ``why`` they would
    not add up to the whole batch's gradient (or ``None``), and the random draws the pieces
    replay (:class:`~leangrad.engines._batch_draws.BatchDraws`; empty: none)."""

    why: str | None
    draws: tuple[Drawn, ...] = ()


def watched_coupling(model: nn.Module, xs: tuple[torch.Tensor, ...], *,
                     pieces: str = "micro-batches", option: str = "accumulate") -> Watched:
    """Whether ``pieces`` of the batch ``xs`` (every tensor one row per example) run through
    ``model`` one after another add up to the whole batch's gradient, found by watching one
    forward rather than by the layers' classes: a buffer the forward changes, an output row
    that depends on another example (two examples at once against each alone; plain
    tensors only: a subclass such as chunked cross-entropy's lazy logits is not read), and
    random draws (:mod:`._draws`), which the pieces replay where each draw's shape follows
    the batch or is shared by it (:func:`~leangrad.engines._batch_draws.layout`) and the
    examples alone then match them at once, and refuse where not. Runs without autograd on
    two examples, with the RNG streams forked and every buffer put back."""
    n = xs[0].shape[0] if xs and xs[0].dim() else 0
    if n == 0:
        return Watched(None)
    rows = [x[:2] for x in xs]
    m = min(n, 2)
    buffers = list(model.named_buffers())
    saved = [(b._version, b.detach().clone()) for _, b in buffers]
    devices = sorted({x.device.index or 0 for x in xs if x.device.type == "cuda"})
    draws: tuple[Drawn, ...] = ()
    try:
        with torch.random.fork_rng(devices=devices, device_type="cuda"), torch.no_grad():
            start = rng_states(devices)
            with Draws(model) as whole:
                both = model(*rows)
            after = rng_states(devices)
            if whole.found:
                set_rng_states(start, devices)
                with Draws(model) as one:
                    model(*[x[:1] for x in rows])
                draws, why = layout(whole.shapes, one.shapes, n_whole=m, n_piece=1,
                                    pieces=pieces, option=option)  # fmt: skip
                if why is not None:
                    return Watched(why)
                set_rng_states(start, devices)
            replay = BatchDraws(draws, edges=range(m + 1))
            alone = []
            for i in range(m):
                with replay.piece(i) if draws else contextlib.nullcontext():
                    alone.append(model(*[x[i:i + 1] for x in rows]))
            if draws and not all(torch.equal(a, b) for a, b in
                                 zip(after, rng_states(devices), strict=True)):  # fmt: skip
                where, op, _ = whole.shapes[0]
                return Watched(DRAWS.format(where=where, op=op, pieces=pieces, option=option))
    except errors.LeangradError as e:  # a replay that does not match: refused, named
        return Watched(str(e))
    finally:
        changed = [name for (name, b), (v, _) in zip(buffers, saved, strict=True)
                   if b._version != v]  # fmt: skip
        with torch.no_grad():
            for (_, b), (_, value) in zip(buffers, saved, strict=True):
                b.copy_(value)
    if changed:
        names = ", ".join(repr(c) for c in changed[:3])
        why = CHANGES_BUFFERS.format(names=f"buffer(s) {names}", pieces=pieces, option=option)
        return Watched(why)
    if n < 2 or any(is_fake(x) for x in xs):  # a fake tensor has no values to compare
        return Watched(None, draws)
    return Watched(_mixing(both, alone, pieces=pieces, option=option), draws)


def _mixing(both: Any, alone: list[Any], *, pieces: str, option: str) -> str | None:
    """Why the outputs of two examples run at once (``both``) are not those of each run
    alone joined along the batch (plain floating tensors with a batch row each; others,
    and non-finite ones, are not compared), or ``None``."""
    for i, (b, x, y) in enumerate(zip(*(pytree.tree_leaves(o) for o in (both, *alone)),
                                      strict=False)):  # fmt: skip
        if not (type(b) is torch.Tensor and b.is_floating_point() and b.dim()
                and b.shape[0] == 2 and isinstance(x, torch.Tensor) and x.shape[:1] == (1,)
                and isinstance(y, torch.Tensor) and y.shape == x.shape):  # fmt: skip
            continue
        if not bool(torch.isfinite(b).all()):  # NaN/Inf inputs: nothing to compare with
            continue
        diff = float((b - torch.cat([x, y])).abs().max())
        if not diff <= _tolerance(b.dtype) * (float(b.abs().max()) + 1e-30):
            return MIXES_EXAMPLES.format(index=i, diff=diff, pieces=pieces, option=option)
    return None


def _tolerance(dtype: torch.dtype) -> float:
    if dtype == torch.float64:
        return 1e-9
    if dtype in (torch.float16, torch.bfloat16):
        return 2e-2
    return 1e-4
