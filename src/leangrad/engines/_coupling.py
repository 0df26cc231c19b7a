"""Which layers couple the examples of a batch: why running pieces of it one after
another (accumulate's micro-batches, checkpoint's fragments) would not add up to the
whole batch's gradient. Shared by :mod:`leangrad.engines._transforms` and
:mod:`leangrad.engines._fragments`, which both import it from below.
"""

from __future__ import annotations

from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.dropout import _DropoutNd
from torch.nn.modules.instancenorm import _InstanceNorm

__all__ = ["BATCH_COUPLED", "RANDOM_LAYER", "batch_coupling"]

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
