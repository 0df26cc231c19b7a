"""Which layers couple the examples of a batch: why running pieces of it one after
another (accumulate's micro-batches, checkpoint's fragments) would not add up to the
whole batch's gradient. Shared by :mod:`leangrad.engines._transforms` and
:mod:`leangrad.engines._fragments`, which both import it from below.
"""

from __future__ import annotations

import torch
from torch import nn
from torch._subclasses.fake_tensor import is_fake
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.dropout import _DropoutNd
from torch.nn.modules.instancenorm import _InstanceNorm
from torch.utils import _pytree as pytree

from ._draws import drawing

__all__ = ["BATCH_COUPLED", "RANDOM_LAYER", "batch_coupling", "watched_coupling"]

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
                   skip_batchnorm: bool = False) -> str | None:  # fmt: skip
    """Why ``pieces`` of the batch run through ``model`` one after another would not add up
    to the whole batch's gradient (a training-mode layer whose output depends on the other
    examples, or one that draws random masks), or ``None``; the message's fix is to leave
    out ``option``. ``skip_batchnorm``: BatchNorm layers are not counted (the caller
    handles them)."""
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
        if p > 0:
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


def watched_coupling(model: nn.Module, xs: tuple[torch.Tensor, ...], *,
                     pieces: str = "micro-batches", option: str = "accumulate") -> str | None:
    """Why ``pieces`` of the batch ``xs`` (every tensor one row per example) run through
    ``model`` one after another would not add up to the whole batch's gradient, found by
    watching one forward rather than by the layers' classes: a random draw anywhere
    (:mod:`._draws`), a buffer the forward changes, or an output row that depends on
    another example (two examples at once against each alone; plain tensors only: a
    subclass such as chunked cross-entropy's lazy logits is not read). Runs without
    autograd on two examples, with the RNG streams forked and every buffer put back."""
    n = xs[0].shape[0] if xs and xs[0].dim() else 0
    if n == 0:
        return None
    rows = [x[:2] for x in xs]
    buffers = list(model.named_buffers())
    saved = [(b._version, b.detach().clone()) for _, b in buffers]
    devices = sorted({x.device.index or 0 for x in xs if x.device.type == "cuda"})
    try:
        with torch.random.fork_rng(devices=devices, device_type="cuda"), torch.no_grad():
            both, drawn = drawing(model, lambda: model(*rows), pieces=pieces, option=option)
            alone = [model(*[x[i:i + 1] for x in rows]) for i in range(min(n, 2))]
    finally:
        changed = [name for (name, b), (v, _) in zip(buffers, saved, strict=True)
                   if b._version != v]  # fmt: skip
        with torch.no_grad():
            for (_, b), (_, value) in zip(buffers, saved, strict=True):
                b.copy_(value)
    if drawn is not None:
        return drawn
    if changed:
        names = ", ".join(repr(c) for c in changed[:3])
        return CHANGES_BUFFERS.format(names=f"buffer(s) {names}", pieces=pieces, option=option)
    if n < 2 or any(is_fake(x) for x in xs):  # a fake tensor has no values to compare
        return None
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
